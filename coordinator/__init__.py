"""The coordinator of a swarm run: membership, stage assignment, artifacts, rotations, progress.

* :mod:`swarm.coordinator.service`: the ``swarm.v1.Coordinator`` gRPC service and its server,
  wiring the collaborators below.
* :mod:`swarm.coordinator.settings`: the coordinator's tunables and their defaults.
* :mod:`swarm.coordinator.roster`: the nodes, their liveness, identities and capacity.
* :mod:`swarm.coordinator.planner`: who hosts which stage (its ``replan``), the plan each node is told.
* :mod:`swarm.coordinator.assignment`: which node hosts which stage, and who dials whom (pure).
* :mod:`swarm.coordinator.ledger`: plan epochs, checkpoint cuts, the microbatches dealt.
* :mod:`swarm.coordinator.gate`: join tokens, session credentials, refusals
  (:mod:`~swarm.coordinator.tokens`, :mod:`~swarm.coordinator.sessions`, :mod:`~swarm.coordinator.errors`).
* :mod:`swarm.coordinator.judge`: who to evict on an accusation of invalid frames.
* :mod:`swarm.coordinator.audits`: sibling replicas' recomputations of each other, and evictions on them.
* :mod:`swarm.coordinator.rotation`: boundary statistics in, subspace rotations out;
  :mod:`swarm.coordinator.rotation_hub` keeps and streams them.
* :mod:`swarm.coordinator.progress`: step reports and the ``Status`` document.
* :mod:`swarm.coordinator.artifacts`: the embedding, stage snapshots (:mod:`~swarm.coordinator.store`)
  and the trained model (:mod:`~swarm.coordinator.export`).
* :mod:`swarm.coordinator.state`: the SQLite file a restarted coordinator resumes from.
* :mod:`swarm.coordinator.cli`: ``swarm-coordinator serve``.
"""

import swarm.ops.logs  # noqa: F401 - quiets gRPC's C core before grpc loads
