"""Developer tools run as modules (``python -m swarm.tools.<name>``)."""
