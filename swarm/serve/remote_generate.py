"""Generation through a swarm of stage servers (``swarm-node serve``), routed by the client.

The client keeps one session per stage (a gRPC stream to one server of that stage),
sends each step's new tokens to stage 0 and relays every stage's output frame, unchanged,
to the next stage; the last stage's frame goes through the client's own final norm and
LM head (:class:`~swarm.serve.inference.ClientHead`), and sampling happens here
(:func:`swarm.serve.generate.sample`, so local and swarm generation pick tokens identically).
Each stage's inputs are kept: when a server fails (a dead process, a broken stream), the
client opens a session on the next server of that stage, replays the inputs so its KV
cache is rebuilt exactly, and goes on (Petals' history replay).
"""

from __future__ import annotations

import queue
import time
import uuid
from dataclasses import dataclass, field

import grpc
import torch

from swarm._proto.swarm.v1 import inference_pb2, inference_pb2_grpc
from swarm.io.model_io import TrainedModel
from swarm.net.channel import channel_options
from swarm.net.frames import activation_from_proto
from swarm.net.tls import INSECURE, NODE_SERVER_NAME, Security
from swarm.serve.generate import Sampling, check_prompt, sample
from swarm.serve.inference import ClientHead

REFUSED = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)  # our request is wrong


def parse_servers(specs: list[str]) -> dict[int, list[str]]:
    """``["0=HOST:PORT", "1=HOST:PORT,HOST:PORT", ...]`` -> servers of each stage, in preference order."""
    servers: dict[int, list[str]] = {}
    for spec in specs:
        stage, sep, addresses = spec.partition("=")
        if not sep or not stage.isdigit() or not addresses:
            raise ValueError(f"{spec!r} is not STAGE=HOST:PORT[,HOST:PORT...]")
        servers.setdefault(int(stage), []).extend(a for a in addresses.split(",") if a)
    return servers


class StageSession:
    """One session on one server: a bidirectional stream driven one request at a time."""

    def __init__(self, address: str, timeout_s: float, security: Security = INSECURE):
        self.address = address
        self.channel = security.channel(address, channel_options(), NODE_SERVER_NAME)
        self._requests: queue.Queue = queue.Queue()
        stub = inference_pb2_grpc.InferenceStub(self.channel)
        self._replies = stub.Session(iter(self._requests.get, None), timeout=timeout_s)

    def call(self, request: inference_pb2.InferenceRequest) -> inference_pb2.InferenceReply:
        self._requests.put(request)
        return next(self._replies)

    def close(self) -> None:
        self._requests.put(None)
        self.channel.close()


@dataclass
class GenerationStats:
    # Serialized frames each stage sent on the decode steps (stage b's go to stage b+1, the last
    # stage's to the client), and the same for the prompt.
    boundary_bytes: list[int]
    prefill_boundary_bytes: list[int]
    decode_steps: int = 0
    failovers: list[str] = field(default_factory=list)  # "stage S: ADDRESS -> ADDRESS"
    replayed: int = 0  # requests replayed to replacement servers
    decode_seconds: float = 0.0  # time in the decode steps (the prompt's step excluded)

    @property
    def tokens_per_second(self) -> float:
        return self.decode_steps / self.decode_seconds if self.decode_seconds else 0.0

    @property
    def bytes_per_token(self) -> list[float]:
        """Serialized frame bytes per generated token, per boundary (one hop stage b -> b+1)."""
        return [b / max(1, self.decode_steps) for b in self.boundary_bytes]


class SwarmGenerator:
    """Sessions on one server per stage, failing over to the next listed; ``head`` turns the last
    stage's frame into logits (it must match the servers' ``--boundary`` and ``--format``)."""

    def __init__(
        self,
        servers: dict[int, list[str]],
        head: ClientHead,
        timeout_s: float = 600.0,
        security: Security = INSECURE,
    ):
        n_stages = max(servers, default=-1) + 1
        missing = [s for s in range(n_stages) if not servers.get(s)]
        if missing:
            raise ValueError(f"no server given for stages {missing}")
        self.servers, self.n_stages, self.head, self.timeout_s = servers, n_stages, head, timeout_s
        self.security = security
        self.session_id = uuid.uuid4().hex
        self.dead: set[str] = set()
        self.sessions: dict[int, StageSession] = {}
        self.history: dict[int, list[inference_pb2.InferenceRequest]] = {s: [] for s in range(n_stages)}
        self.position = 0
        self.stats = GenerationStats([0] * n_stages, [0] * n_stages)

    def _session(self, stage: int) -> StageSession:
        if stage not in self.sessions:
            alive = [a for a in self.servers[stage] if a not in self.dead]
            if not alive:
                raise RuntimeError(f"every server of stage {stage} failed: {self.servers[stage]}")
            self.sessions[stage] = StageSession(alive[0], self.timeout_s, self.security)
        return self.sessions[stage]

    def _call(self, stage: int, request: inference_pb2.InferenceRequest) -> inference_pb2.InferenceReply:
        while True:
            session = self._session(stage)
            try:
                reply = session.call(request)
                self.history[stage].append(request)
                return reply
            except grpc.RpcError as e:
                if e.code() in REFUSED:
                    raise RuntimeError(f"stage {stage} at {session.address} refused: {e.details()}") from None
                self._fail_over(stage, session)

    def _fail_over(self, stage: int, failed: StageSession) -> None:
        """Open a session on the next server of ``stage`` and replay everything the failed one had."""
        self.dead.add(failed.address)
        failed.close()
        del self.sessions[stage]
        replacement = self._session(stage)
        self.stats.failovers.append(f"stage {stage}: {failed.address} -> {replacement.address}")
        for old in self.history[stage]:
            try:
                replacement.call(old)
            except grpc.RpcError as e:
                if e.code() in REFUSED:
                    raise RuntimeError(f"replay refused by {replacement.address}: {e.details()}") from None
                return self._fail_over(stage, replacement)
            self.stats.replayed += 1

    def logits_after(self, new_ids: list[int]) -> torch.Tensor:
        """Run ``new_ids`` through every stage; the last position's logits."""
        start = time.perf_counter()
        prefill = self.position == 0
        request = inference_pb2.InferenceRequest(
            session_id=self.session_id, stage=0, position=self.position, token_ids=new_ids
        )
        counts = self.stats.prefill_boundary_bytes if prefill else self.stats.boundary_bytes
        for stage in range(self.n_stages):
            reply = self._call(stage, request)
            counts[stage] += reply.frame.ByteSize()
            request = inference_pb2.InferenceRequest(
                session_id=self.session_id, stage=stage + 1, position=self.position, frame=reply.frame
            )
        self.position += len(new_ids)
        if not prefill:
            self.stats.decode_steps += 1
            self.stats.decode_seconds += time.perf_counter() - start
        return self.head.logits(activation_from_proto(reply.frame))

    def close(self) -> None:
        for session in self.sessions.values():
            session.close()
        self.sessions.clear()


def generate_remote(
    trained: TrainedModel,
    prompt: str,
    sampling: Sampling,
    servers: dict[int, list[str]],
    boundary: str = "subspace",
    tensor_format: str = "bf16",
    security: Security = INSECURE,
) -> tuple[str, GenerationStats]:
    """``prompt`` and its continuation generated through ``servers``, and what it cost."""
    m, tokenizer = trained.config.model, trained.tokenizer()
    prompt_ids = tokenizer.encode(prompt)
    check_prompt(prompt_ids, m.vocab_size, m.max_seq_len)
    if sorted(servers) != list(range(trained.config.n_stages)):
        raise ValueError(f"give servers for each of the model's {trained.config.n_stages} stages")
    swarm = SwarmGenerator(servers, ClientHead(trained, boundary, tensor_format), security=security)
    try:
        ids = sample(prompt_ids, sampling, m.max_seq_len, swarm.logits_after)
    finally:
        swarm.close()
    return prompt + tokenizer.decode(ids), swarm.stats
