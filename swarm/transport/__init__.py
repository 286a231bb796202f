"""The network side of the swarm: protobuf messages and gRPC services between stages and the coordinator.

The wire schema lives in ``proto/swarm/v1/`` and its generated stubs in :mod:`swarm._proto`;
:mod:`swarm.transport.frames` converts between those messages and the in-memory frames of
:mod:`swarm.wire` and :mod:`swarm.subspace`.
"""
