"""The node daemon (``swarm-node join``): hosts pipeline stages of a run.

* :mod:`swarm.node.daemon`: join, follow plan epochs, leave.
* :mod:`swarm.node.coordinator_client`, :mod:`swarm.node.link_manager`,
  :mod:`swarm.node.stage_host`: its parts.
* :mod:`swarm.node.cli`: the command line.
"""

import swarm.ops.logs  # noqa: F401 - quiets gRPC's C core before grpc loads
