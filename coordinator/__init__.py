"""The coordinator of a swarm run: membership, stage assignment, artifacts, rotations, progress.

* :mod:`swarm.coordinator.service`: the ``swarm.v1.Coordinator`` gRPC service and its server.
* :mod:`swarm.coordinator.assignment`: which node hosts which stage, and who dials whom.
* :mod:`swarm.coordinator.rotation`: boundary statistics in, subspace rotations out.
* :mod:`swarm.coordinator.state`: the SQLite file a restarted coordinator resumes from.
* :mod:`swarm.coordinator.cli`: ``swarm-coordinator serve``.
"""

import swarm.ops.logs  # noqa: F401 - quiets gRPC's C core before grpc loads
