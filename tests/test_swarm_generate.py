"""Generation through a swarm of ``swarm-node serve`` processes: equal to local generation token for
token, frame bytes as the codec accounts them, and a ``kill -9`` survived by history replay."""

from __future__ import annotations

import dataclasses
import os
import queue
import signal
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from swarm._proto.swarm.v1 import inference_pb2, inference_pb2_grpc
from swarm.core.config import MODEL_PRESETS, CodecConfig, DataConfig, RunConfig, TrainConfig
from swarm.core.model import KVCache
from swarm.io import model_io
from swarm.net import certs, tls
from swarm.net.tls import Security
from swarm.runtime.train import train
from swarm.serve.generate import Sampling, generate_ids, sample
from swarm.serve.inference import ClientHead, InferenceStage
from swarm.serve.remote_generate import SwarmGenerator
from tests.procs import Proc, processes

PROMPT = list(b"To be, or not to be")
GREEDY = Sampling(max_new_tokens=24, temperature=0)


@dataclasses.dataclass
class Servers:
    model: model_io.TrainedModel
    procs: dict[str, Proc]
    addresses: dict[str, str]
    pki: Path  # the CA and the certificates of the mutual-TLS servers and their client

    def of(self, *names: str) -> dict[int, list[str]]:
        """Servers by stage, in the order given (later ones are spares)."""
        out: dict[int, list[str]] = {}
        for name in names:
            out.setdefault(int(name[1]), []).append(self.addresses[name])
        return out


def serve(procs: list[Proc], folder: Path, model: Path, name: str, stage: int, *flags: str) -> Proc:
    args = [sys.executable, "-m", "swarm.node.cli", "serve", "--model", str(model), "--stage", str(stage)]
    args += ["--device", "cpu", *flags]
    procs.append(Proc(args, folder / f"{name}.err"))
    return procs[-1]


@pytest.fixture(scope="module")
def servers(tmp_path_factory) -> Iterator[Servers]:
    folder = tmp_path_factory.mktemp("generate")
    config = RunConfig(
        model=dataclasses.replace(MODEL_PRESETS["tiny"]),
        codec=CodecConfig(kind="subspace"),
        train=TrainConfig(steps=20, batch_size=4, seq_len=32, microbatches=2, lr=1e-2, warmup_steps=2),
        data=DataConfig(tokenizer="byte"),
        n_stages=3,
    )
    train(config, device="cpu", progress=False, out_dir=folder)
    model = folder / "model"
    certs.init(folder / "pki")
    for name in ("server", "client"):
        certs.issue_node(folder / "pki", name)
    mutual = tls.cli_flags(folder / "pki", "server")
    with processes() as procs:
        # s<stage><copy>: fp32 frames (exact), and a bf16 and a dense set for the byte counts.
        started = {
            "s0a": serve(procs, folder, model, "s0a", 0, "--format", "fp32"),
            "s1a": serve(procs, folder, model, "s1a", 1, "--format", "fp32"),
            "s1b": serve(procs, folder, model, "s1b", 1, "--format", "fp32"),
            "s2a": serve(procs, folder, model, "s2a", 2, "--format", "fp32"),
            "s0c": serve(procs, folder, model, "s0c", 0, "--format", "bf16"),
            "s1c": serve(procs, folder, model, "s1c", 1, "--format", "bf16"),
            "s2c": serve(procs, folder, model, "s2c", 2, "--format", "bf16"),
            "s0t": serve(procs, folder, model, "s0t", 0, "--session-timeout", "1", "--metrics-port", "0"),
            # mutual TLS: only a client with a certificate from the CA gets a session
            "s0m": serve(procs, folder, model, "s0m", 0, "--format", "fp32", *mutual),
            "s1m": serve(procs, folder, model, "s1m", 1, "--format", "fp32", *mutual),
            "s2m": serve(procs, folder, model, "s2m", 2, "--format", "fp32", *mutual),
        }
        addresses = {n: p.wait_for(r"serving stage \d .* on (\S+)", 120).group(1) for n, p in started.items()}
        yield Servers(model_io.load(model), started, addresses, folder / "pki")


def test_greedy_generation_through_the_swarm_equals_local(servers):
    local = generate_ids(servers.model.build(), PROMPT, GREEDY)
    swarm = SwarmGenerator(servers.of("s0a", "s1a", "s2a"), ClientHead(servers.model, "subspace", "fp32"))
    try:
        remote = sample(PROMPT, GREEDY, servers.model.config.model.max_seq_len, swarm.logits_after)
    finally:
        swarm.close()
    assert remote == local
    assert swarm.stats.decode_steps == GREEDY.max_new_tokens - 1 and not swarm.stats.failovers


def test_generation_over_mutual_tls_needs_a_certificate_from_the_ca(servers):
    pki = servers.pki
    client = Security.from_files(pki / "ca.pem", pki / "client.pem", pki / "client.key", mutual=True)
    head = ClientHead(servers.model, "subspace", "fp32")
    swarm = SwarmGenerator(servers.of("s0m", "s1m", "s2m"), head, security=client)
    try:
        remote = sample(PROMPT, GREEDY, servers.model.config.model.max_seq_len, swarm.logits_after)
    finally:
        swarm.close()
    assert remote == generate_ids(servers.model.build(), PROMPT, GREEDY)
    anonymous = SwarmGenerator(
        servers.of("s0m", "s1m", "s2m"), head, timeout_s=10, security=Security.from_files(pki / "ca.pem")
    )
    try:
        with pytest.raises(RuntimeError, match="every server of stage 0 failed"):
            sample(PROMPT, GREEDY, servers.model.config.model.max_seq_len, anonymous.logits_after)
    finally:
        anonymous.close()


def test_frame_bytes_per_token_match_the_codec_accounting(servers):
    """One token's k=16 bf16 coordinates (32 B) and its id leave each stage, plus protobuf framing."""
    swarm = SwarmGenerator(servers.of("s0c", "s1c", "s2c"), ClientHead(servers.model, "subspace", "bf16"))
    try:
        sample(PROMPT, GREEDY, servers.model.config.model.max_seq_len, swarm.logits_after)
    finally:
        swarm.close()
    stage = InferenceStage(servers.model, 0, "subspace", "bf16")
    frame = stage.run(KVCache(), 0, [65], None)
    accounted = stage.frame_accounting(frame)
    k = servers.model.config.model.subspace_rank
    assert len(frame.payload.data) == 2 * k
    assert len(swarm.stats.bytes_per_token) == 3  # two boundaries and the last stage's frame to the client
    for per_token in swarm.stats.bytes_per_token:
        assert accounted <= per_token <= accounted + 24, (per_token, accounted)
    dense = InferenceStage(servers.model, 0, "dense", "bf16").run(KVCache(), 0, [65], None)
    assert len(dense.payload.data) == 2 * servers.model.config.model.d_model  # what subspace saves


def test_a_killed_stage_server_is_replaced_by_replaying_the_session(servers):
    local = generate_ids(servers.model.build(), PROMPT, GREEDY)
    swarm = SwarmGenerator(
        servers.of("s0a", "s1a", "s1b", "s2a"), ClientHead(servers.model, "subspace", "fp32")
    )
    victim = servers.procs["s1a"].p
    calls = 0

    def logits_after(new_ids: list[int]):
        nonlocal calls
        calls += 1
        if calls == 10:
            os.kill(victim.pid, signal.SIGKILL)
            victim.wait(10)
        return swarm.logits_after(new_ids)

    try:
        remote = sample(PROMPT, GREEDY, servers.model.config.model.max_seq_len, logits_after)
    finally:
        swarm.close()
    assert remote == local
    assert swarm.stats.failovers == [f"stage 1: {servers.addresses['s1a']} -> {servers.addresses['s1b']}"]
    assert swarm.stats.replayed == 9  # the prompt and the 8 tokens before the kill


def session(address: str) -> tuple[queue.Queue, Iterator[inference_pb2.InferenceReply], grpc.Channel]:
    channel = grpc.insecure_channel(address)
    requests: queue.Queue = queue.Queue()
    replies = inference_pb2_grpc.InferenceStub(channel).Session(iter(requests.get, None), timeout=30)
    return requests, replies, channel


def request(stage: int, position: int, tokens: list[int]) -> inference_pb2.InferenceRequest:
    return inference_pb2.InferenceRequest(session_id="s", stage=stage, position=position, token_ids=tokens)


@pytest.mark.parametrize(
    ("bad", "code", "says"),
    [
        (request(1, 0, [65]), grpc.StatusCode.FAILED_PRECONDITION, "hosts stage 0"),
        (request(0, 5, [65]), grpc.StatusCode.INVALID_ARGUMENT, "position 5"),
        (request(0, 0, [1 << 20]), grpc.StatusCode.INVALID_ARGUMENT, "vocabulary"),
        (request(0, 0, [65] * 100), grpc.StatusCode.INVALID_ARGUMENT, "context"),
    ],
)
def test_bad_requests_end_the_session_with_a_clear_error(servers, bad, code, says):
    requests, replies, channel = session(servers.addresses["s0a"])
    with channel:
        requests.put(bad)
        with pytest.raises(grpc.RpcError) as e:
            next(replies)
        assert e.value.code() == code and says in e.value.details()
    # The server lives on: a good session still works.
    requests, replies, channel = session(servers.addresses["s0a"])
    with channel:
        requests.put(request(0, 0, [65, 66]))
        assert next(replies).cached == 2
        requests.put(None)


def test_an_idle_session_times_out_and_is_counted(servers):
    requests, replies, channel = session(servers.addresses["s0t"])
    with channel:
        requests.put(request(0, 0, [65]))
        assert next(replies).cached == 1
        time.sleep(1.5)  # past --session-timeout 1
        requests.put(request(0, 1, [66]))
        with pytest.raises(grpc.RpcError) as e:
            next(replies)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "idle" in e.value.details()
    port = int(servers.procs["s0t"].wait_for(r"node metrics on [\d.]+:(\d+)", 5).group(1))
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        assert 'swarm_rejected_messages_total{reason="session_timeout"} 1.0' in r.read().decode()
