"""``swarm-node serve``: one stage of a trained model, serving generation sessions over gRPC.

Each ``Inference.Session`` stream is a session with its own KV cache, dropped when the
stream ends or after ``session_timeout_s`` without a request. Malformed requests (wrong
stage, wrong position, bad frames, too long) end the session with INVALID_ARGUMENT or
FAILED_PRECONDITION and a counter, never a crash.
"""

from __future__ import annotations

import asyncio

import grpc

from swarm._proto.swarm.v1 import inference_pb2, inference_pb2_grpc
from swarm.codecs.base import PayloadError
from swarm.core.model import KVCache
from swarm.net.channel import server_options
from swarm.net.frames import activation_from_proto, activation_to_proto
from swarm.net.health import Health
from swarm.net.tls import INSECURE, Security
from swarm.ops.metrics import Metrics
from swarm.serve.inference import InferenceStage

SERVICE = inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name


class InferenceService(inference_pb2_grpc.InferenceServicer):
    def __init__(self, stage: InferenceStage, metrics: Metrics, session_timeout_s: float = 300.0):
        self.stage, self.metrics, self.session_timeout_s = stage, metrics, session_timeout_s

    async def Session(self, request_iterator, context: grpc.aio.ServicerContext):
        cache, session_id = KVCache(), None
        while True:
            try:
                request = await asyncio.wait_for(context.read(), self.session_timeout_s)
            except TimeoutError:
                await self._refuse(
                    context,
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    "session_timeout",
                    f"session idle for {self.session_timeout_s:.0f}s; its cache is dropped",
                )
            if request is grpc.aio.EOF:
                return
            session_id = session_id or request.session_id
            if request.stage != self.stage.index or request.session_id != session_id:
                await self._refuse(
                    context,
                    grpc.StatusCode.FAILED_PRECONDITION,
                    "wrong_stage",
                    f"this server hosts stage {self.stage.index} (session {session_id})",
                )
            try:
                frame = activation_from_proto(request.frame) if request.HasField("frame") else None
                out = await asyncio.to_thread(
                    self.stage.run, cache, request.position, list(request.token_ids) or None, frame
                )
            except PayloadError as e:
                await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, "bad_payload", str(e))
            await context.write(
                inference_pb2.InferenceReply(frame=activation_to_proto(out), cached=cache.length)
            )

    async def _refuse(self, context: grpc.aio.ServicerContext, code: grpc.StatusCode, label: str, why: str):
        self.metrics.rejected.labels(label).inc()
        await context.abort(code, why)


async def serve(
    stage: InferenceStage,
    listen: str,
    session_timeout_s: float,
    metrics: Metrics,
    security: Security = INSECURE,
) -> None:
    """Serve ``stage`` on ``listen`` until cancelled (prints one ready line)."""
    server = grpc.aio.server(options=server_options())
    inference_pb2_grpc.add_InferenceServicer_to_server(
        InferenceService(stage, metrics, session_timeout_s), server
    )
    health = Health(server, [SERVICE])
    port = security.add_port(server, listen)
    await server.start()
    await health.serving()
    host = listen.rpartition(":")[0]
    print(
        f"serving stage {stage.index} ({stage.boundary} {stage.tensor_format} boundaries) on {host}:{port}",
        flush=True,
    )
    try:
        await asyncio.Event().wait()
    finally:
        await health.stop()
        await server.stop(grace=1)
