"""The node daemon (``swarm-node join``): hosts pipeline stages of a run.

* :mod:`node.daemon`: join, follow plan epochs, leave.
* :mod:`node.coordinator_client`, :mod:`node.link_manager`, :mod:`node.stage_host`: its parts.
* :mod:`node.cli`: the command line.
"""

import swarm.logs  # noqa: F401 - quiets gRPC's C core before grpc loads
