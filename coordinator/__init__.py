"""The coordinator of a swarm run: membership, stage assignment, artifacts, rotations, progress.

* :mod:`coordinator.service`: the ``swarm.v1.Coordinator`` gRPC service and its server.
* :mod:`coordinator.assignment`: which node hosts which stage, and who dials whom.
* :mod:`coordinator.rotation`: boundary statistics in, subspace rotations out.
* :mod:`coordinator.state`: the SQLite file a restarted coordinator resumes from.
* :mod:`coordinator.cli`: ``swarm-coordinator serve``.
"""

import swarm.logs  # noqa: F401 - quiets gRPC's C core before grpc loads
