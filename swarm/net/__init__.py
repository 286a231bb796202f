"""The network side: gRPC channels and TLS, frame messages, credentials metadata, discovery, certificates.

The wire schema lives in ``proto/swarm/v1/`` and its generated stubs in :mod:`swarm._proto`;
:mod:`swarm.net.frames` converts between those messages and the in-memory frames of
:mod:`swarm.runtime.wire` and :mod:`swarm.core.subspace`.
"""
