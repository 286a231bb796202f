"""Join tokens the operator creates and revokes, and session credentials that expire, renew and
die with their token: the store, the coordinator's answers, the CLI, and a live swarm whose
revoked volunteer is evicted and replaced while the run completes."""

from __future__ import annotations

import os
import sqlite3
import stat
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from swarm.coordinator.cli import build_parser
from swarm.coordinator.gate import new_operator_token
from swarm.coordinator.sessions import SessionRefused, Sessions
from swarm.coordinator.state import CoordinatorState
from swarm.coordinator.tokens import JoinTokens, token_id
from swarm.node import cli as node_cli

from swarm._proto.swarm.v1 import coordinator_pb2
from swarm.net.credentials import session_metadata
from tests import procs
from tests.test_coordinator import RPC_TIMEOUT, coordinator, refused, run


def test_tokens_are_stored_as_digests_and_stay_revoked():
    tokens = JoinTokens(sqlite3.connect(":memory:", isolation_level=None))
    alice, record = tokens.create("alice")
    bob, _ = tokens.create("bob")
    assert alice.startswith("swt_") and len(alice) > 40
    assert tokens.check(alice) == record and record.id == token_id(alice)
    dump = "\n".join(tokens.db.iterdump())
    assert alice not in dump and bob not in dump  # only digests are kept
    assert tokens.revoke(record.id[:6]).revoked is not None
    assert tokens.check(alice) is None and tokens.revoked(record.id)
    assert tokens.add(alice, "again").revoked is not None  # a file or $SWARM_TOKEN cannot revive it
    assert tokens.check(bob) is not None
    with pytest.raises(ValueError, match="0 tokens"):
        tokens.revoke("zz")
    with pytest.raises(ValueError, match="0 tokens"):
        tokens.revoke("")
    with pytest.raises(ValueError, match="at least 16"):
        tokens.add("short", "weak")
    assert [r.label for r in tokens.list()] == ["alice", "bob"]


def test_credentials_expire_renew_and_refuse_tampering(tmp_path: Path):
    now = [1000.0]
    revoked: set[str] = set()
    sessions = Sessions(tmp_path / "key", revoked.__contains__, ttl_s=100, clock=lambda: now[0])
    credential = sessions.issue("node-a", "0123456789ab")

    def verdict(node_id: str, session: str) -> str:
        try:
            return sessions.verify(session_metadata(node_id, session)).node_id
        except SessionRefused as e:
            return f"refused: {e}"

    assert verdict("node-a", credential) == "node-a"
    assert verdict("node-b", credential) == "refused: forged"
    token, expires, mac = credential.split(".")
    assert verdict("node-a", f"{token}.{int(expires) + 1000}.{mac}") == "refused: forged"  # longer life
    assert verdict("node-a", f"ba9876543210.{expires}.{mac}") == "refused: forged"
    assert verdict("node-a", "garbage") == "refused: forged"
    with pytest.raises(SessionRefused, match="missing"):
        sessions.verify(())
    assert sessions.renewal(sessions.verify(session_metadata("node-a", credential))) is None
    now[0] += 60  # less than half the lifetime left: a heartbeat hands out the next one
    renewed = sessions.renewal(sessions.verify(session_metadata("node-a", credential)))
    assert renewed is not None and verdict("node-a", renewed) == "node-a"
    now[0] += 41
    assert verdict("node-a", credential) == "refused: expired"
    assert verdict("node-a", renewed) == "node-a"
    revoked.add("0123456789ab")
    assert verdict("node-a", renewed) == "refused: revoked"


def test_a_revoked_token_refuses_join_and_evicts_its_nodes(tmp_path: Path):
    async def scenario() -> None:
        async with coordinator(tmp_path / "state.sqlite") as h:
            guest_token, record = h.service.gate.tokens.create("guest")
            host = await h.join("host")
            guest = await h.join("guest", token=guest_token)
            assert (await h.heartbeat(guest.node_id)).known
            h.service.gate.tokens.revoke(record.id)  # what `swarm-coordinator token revoke` writes
            assert await refused(h.heartbeat(guest.node_id)) == grpc.StatusCode.UNAUTHENTICATED
            assert h.sample("swarm_evictions_total", {"reason": "revoked"}) == 1
            nodes = {n.node_name: n for n in (await h.status()).nodes}
            assert not nodes["guest"].alive and nodes["host"].alive
            assert await refused(h.join("guest-again", token=guest_token)) == grpc.StatusCode.UNAUTHENTICATED
            assert (await h.heartbeat(host.node_id)).known  # the operator's token still admits

    run(scenario())


def test_heartbeats_renew_the_credential(tmp_path: Path):
    async def scenario() -> None:
        async with coordinator(tmp_path / "state.sqlite") as h:
            a = await h.join("a")
            assert (await h.heartbeat(a.node_id)).session == ""  # fresh: nothing to renew
            now = h.service.gate.sessions.clock()
            h.service.gate.sessions.clock = lambda: now + 0.75 * h.service.gate.sessions.ttl_s
            renewed = (await h.heartbeat(a.node_id)).session
            assert renewed and renewed != a.session
            h.service.gate.sessions.clock = lambda: now + 1.5 * h.service.gate.sessions.ttl_s
            assert await refused(h.heartbeat(a.node_id)) == grpc.StatusCode.UNAUTHENTICATED  # expired
            request = coordinator_pb2.HeartbeatRequest(node_id=a.node_id)
            metadata = session_metadata(a.node_id, renewed)
            assert (await h.stub.Heartbeat(request, timeout=RPC_TIMEOUT, metadata=metadata)).known

    run(scenario())


def token_cli(state: Path, *args: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "swarm.coordinator.cli", "token", *args, "--state", str(state)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=procs.ROOT)


def test_token_cli_and_a_private_state_file(tmp_path: Path):
    state = tmp_path / "run.sqlite"
    created = token_cli(state, "create", "--label", "alice")
    assert created.returncode == 0, created.stderr
    secret = created.stdout.strip()
    assert stat.S_IMODE(os.stat(state).st_mode) == 0o600  # it holds the run's secrets
    assert secret not in state.read_bytes().decode(errors="replace")
    listed = token_cli(state, "list").stdout
    assert token_id(secret) in listed and "alice" in listed and secret not in listed
    assert token_cli(state, "revoke", token_id(secret)[:5]).returncode == 0
    assert "revoked -" not in token_cli(state, "list").stdout
    missing = token_cli(state, "revoke", "nothing")
    assert missing.returncode == 2 and "0 tokens" in missing.stderr
    db = CoordinatorState(state)
    try:
        assert JoinTokens(db.db).check(secret) is None
    finally:
        db.close()


def revoke(state: Path, token: str) -> None:
    db = CoordinatorState(state)
    try:
        JoinTokens(db.db).revoke(token)
    finally:
        db.close()


@pytest.mark.timeout(240)
def test_revoking_a_live_volunteers_token_evicts_it_and_the_run_completes(tmp_path: Path):
    steps = 30
    config = procs.tiny_run(tmp_path, steps, n_stages=2, checkpoint_interval=5)
    with procs.processes() as running:
        address = procs.coordinator(running, tmp_path, config, "--dead-after", "4")
        state = tmp_path / "state.sqlite"
        guest_token = token_cli(state, "create", "--label", "guest").stdout.strip()  # before any step
        token_file = tmp_path / "guest.token"
        token_file.write_text(guest_token)
        n0 = procs.node(running, tmp_path, "n0", address, "--link-latency-ms", "5")
        procs.wait_for_nodes(address, 1)
        guest = procs.node(
            running, tmp_path, "guest", address, "--token-file", str(token_file), "--link-latency-ms", "5"
        )
        procs.wait_for_nodes(address, 2)
        standby = procs.node(running, tmp_path, "standby", address)
        procs.wait_for_nodes(address, 3)
        procs.wait_status(address, lambda r: len(r.steps) >= 8, "eight steps", 120)
        revoke(state, token_id(guest_token))  # what the CLI does, without its start-up time
        final = procs.wait_status(address, lambda r: r.run_complete, "the run to complete", 180)
        assert guest.wait(30) == 3  # fenced
        assert "revoked" in guest.output()
        for p in (n0, standby):
            assert p.wait(60) == 0, p.output()
        again = procs.node(running, tmp_path, "guest-again", address, "--token-file", str(token_file))
        assert again.wait(60) == 5 and "unknown or revoked join token" in again.output()
        coordinator_log = running[0].stderr()
    assert [s.step for s in final.steps] == list(range(steps))
    assert "its join token was revoked" in coordinator_log
    assert "hosts stages [1]" in standby.stdout()  # the standby took the guest's stage
    assert procs.TOKEN not in coordinator_log and guest_token not in coordinator_log


def test_a_token_of_another_run_is_refused(tmp_path: Path):
    async def scenario() -> None:
        async with coordinator(tmp_path / "a.sqlite") as run_a, coordinator(tmp_path / "b.sqlite") as run_b:
            token_a, _ = run_a.service.gate.tokens.create("volunteer of run a")
            assert (await run_a.join("x", token=token_a)).node_id
            assert await refused(run_b.join("x", token=token_a)) == grpc.StatusCode.UNAUTHENTICATED
            assert not (await run_b.status()).nodes

    run(scenario())


def test_token_options_may_come_before_the_id():
    parser = build_parser()
    args = parser.parse_args(["token", "revoke", "--state", "run.sqlite", "3f9c2a"])
    assert (args.action, args.id, args.state) == ("revoke", "3f9c2a", "run.sqlite")
    with pytest.raises(SystemExit):
        parser.parse_args(["token", "revoke", "--state", "run.sqlite"])  # no id: refused, not "revoke ''"


def test_a_generated_operator_token_is_never_read_as_a_flag():
    """``swarm-node join --token T`` with a T that starts with ``-`` fails to parse (a shared token
    once did, one run in 64): generated tokens are hex."""
    parser = node_cli.build_parser()
    for _ in range(300):
        token = new_operator_token()
        assert len(token) == 64 and not token.startswith("-")
        assert parser.parse_args(["join", "--coordinator", "127.0.0.1:1", "--token", token]).token == token
