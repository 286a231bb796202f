"""The standard gRPC health service (``grpc.health.v1``) and server reflection on a server.

Every gRPC port of the swarm serves both, so load balancers, ``grpc_health_probe`` and
``grpcurl`` work against coordinators and nodes without our protos. Health is SERVING
for the overall server ("") and each named service from start until :meth:`Health.stop`.
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection


class Health:
    """Health and reflection for ``services`` (full names, e.g. ``swarm.v1.Coordinator``) on ``server``."""

    def __init__(self, server: grpc.aio.Server, services: list[str]):
        self.services = ["", *services]
        self.servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)
        reflection.enable_server_reflection([*services, health.SERVICE_NAME, reflection.SERVICE_NAME], server)

    async def serving(self) -> None:
        for name in self.services:
            await self.set(name, True)

    async def set(self, service: str, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse
        await self.servicer.set(service, status.SERVING if serving else status.NOT_SERVING)

    async def stop(self) -> None:
        """NOT_SERVING for every service, and watchers are told (call before stopping the server)."""
        await self.servicer.enter_graceful_shutdown()
