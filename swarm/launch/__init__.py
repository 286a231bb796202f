"""Local swarms: every process of a run on one machine (``swarm up``), and churn on purpose."""
