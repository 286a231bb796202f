"""Volunteers behind NAT: placement that keeps an accepting end on every link, and reachability
measured at Join (a real coordinator dialling real gRPC servers on loopback)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
import socket
import sqlite3
import time
from pathlib import Path

import grpc
from swarm.coordinator.assignment import Reach, add_replicas, assign, place, stages_of, unconnectable
from swarm.coordinator.roster import Roster
from swarm.coordinator.service import CoordinatorServer, CoordinatorService
from swarm.coordinator.settings import CoordinatorSettings
from swarm.coordinator.state import CoordinatorState, NodeRecord
from swarm.node.coordinator_client import CoordinatorClient
from swarm.node.settings import Timeouts
from swarm.node.stage_service import StageService

from swarm._proto.swarm.v1 import coordinator_pb2 as cpb
from swarm._proto.swarm.v1 import coordinator_pb2_grpc, stage_pb2_grpc
from swarm.net.credentials import session_metadata
from swarm.net.frames import PROTOCOL_VERSION
from swarm.net.relay import RelayServer
from swarm.ops.metrics import Metrics
from swarm.ops.status import render, status_document
from tests.helpers import tiny_config
from tests.procs import free_port

TOKEN = "reachability-test-token"
REACH_TIMEOUT_S = 1.5


# -- placement (pure functions) -----------------------------------------------------------------


def one_each(*names: str) -> list[tuple[str, int]]:
    """Nodes in join order that may host one stage each."""
    return [(n, 1) for n in names]


def feasible(n_stages: int, nodes: list[str], reach: Reach) -> bool:
    """Whether some one-stage-per-node placement hosts every stage with every link connectable."""
    return any(
        all(reach.connectable(a, b) for a, b in itertools.pairwise(order))
        for order in itertools.permutations(nodes, n_stages)
    )


def test_joins_one_at_a_time_never_plan_a_link_neither_end_accepts():
    """Random join orders of dial-only and open nodes (one stage each): every plan along the way has
    an accepting end on every link, and once the nodes that joined could host every stage that way,
    they do."""
    rng = random.Random(0)
    for _ in range(300):
        n_stages = rng.randint(2, 5)
        nodes = [f"n{i}" for i in range(rng.randint(1, 7))]
        reach = Reach(dial_only=frozenset(n for n in nodes if rng.random() < 0.6))
        owners: list[tuple[str, ...]] = [()] * n_stages
        for i in range(len(nodes)):
            owners = place(owners, one_each(*nodes[: i + 1]), reach)
            assert unconnectable(owners, reach) == [], (owners, reach)
            if feasible(n_stages, nodes[: i + 1], reach):
                assert all(owners), (nodes[: i + 1], reach.dial_only, owners)


def test_a_dial_only_node_goes_where_an_open_neighbour_is():
    reach = Reach(dial_only=frozenset({"d1", "d2"}))
    # d2 skips stage 1 (next to d1) for stage 2, next to a free stage: only an open node fits stage 1.
    assert assign([()] * 3, [("d1", 1), ("d2", 1)], reach) == [("d1",), (), ("d2",)]
    more = Reach(dial_only=frozenset({"d1", "d2", "d3"}))
    assert assign([("d1",), (), ("d2",)], [("d3", 1), ("o", 1)], more) == [
        ("d1",),
        ("o",),
        ("d2",),
    ]
    # A dial-only node with room for two stages takes both ends' neighbours into account.
    assert assign([("o",), (), (), ("d1",)], [("d2", 2)], reach) == [("o",), ("d2",), (), ("d1",)]
    # Without reachability (everyone accepts) the plain rule holds.
    assert assign([()] * 3, [("d1", 1), ("d2", 1)]) == [("d1",), ("d2",), ()]


def test_a_standby_that_fits_nowhere_swaps_with_a_host_instead_of_waiting():
    """Stage 1 is free between a dial-only node and an open one; the only standby is dial-only.
    One open host moves to stage 1 and the standby takes its place."""
    reach = Reach(dial_only=frozenset({"d1", "d2"}))
    owners = [("d1",), (), ("o2",), ("o3",)]
    placed = place(owners, one_each("d1", "o2", "o3", "d2"), reach)
    assert all(placed) and unconnectable(placed, reach) == []
    assert stages_of(placed, "d1") == [0]
    moved = [n for n in ("o2", "o3") if stages_of(placed, n) != stages_of(owners, n)]
    assert len(moved) == 1 and stages_of(placed, moved[0]) == [1]


def test_too_few_open_nodes_leave_a_stage_free_rather_than_plan_an_unconnectable_link():
    reach = Reach(dial_only=frozenset({"d1", "d2", "d3"}))
    placed = place([()] * 2, one_each("d1", "d2"), reach)
    assert placed == [("d1",), ()]  # d2 waits as a standby: no link planned that cannot open
    # Owners that already hold such a link (a state from before) are left as they are when no
    # placement avoids it, and the link is listed.
    stuck = [("d1",), ("d2",)]
    assert place(stuck, one_each("d1", "d2", "d3"), reach) == stuck
    assert unconnectable(stuck, reach) == [(0, "d1", "d2")]
    # With an open standby, the downstream end makes room for it.
    assert place(stuck, one_each("d1", "d2", "o"), reach) == [("d1",), ("o",)]


def test_a_pair_that_failed_to_connect_is_placed_apart():
    chain = [("a",), ("b",), ("c",), ("d",)]
    broken = Reach(broken=frozenset({frozenset({"a", "b"})}))
    # A standby takes the downstream end's stage.
    assert place(chain, one_each(*"abcds"), broken) == [("a",), ("s",), ("c",), ("d",)]
    # Without one, another stage's node swaps places with it.
    rerouted = place(chain, one_each(*"abcd"), broken)
    assert sorted(rerouted) == sorted(chain) and unconnectable(rerouted, broken) == []
    # No placement avoids it: the plan stays (and the link is listed).
    pair = [("a",), ("b",)]
    both = Reach(broken=frozenset({frozenset({"a", "b"})}))
    assert place(pair, one_each("a", "b"), both) == pair and unconnectable(pair, both) == [(0, "a", "b")]


def test_a_dial_only_replica_joins_only_a_stage_whose_neighbours_accept():
    reach = Reach(dial_only=frozenset({"d0", "dx", "dy"}))
    # Stage 1 has the least capacity, but it is next to dial-only d0: dx joins stage 0 instead.
    assert add_replicas([("d0",), ("o1",)], ["dx"], {"d0": 100.0, "o1": 1.0}, 2, reach=reach) == [
        ("d0", "dx"),
        ("o1",),
    ]
    # The same capacities with the open node first: the weakest stage is fine.
    assert add_replicas([("o0",), ("d0",)], ["dx"], {"o0": 100.0, "d0": 1.0}, 2, reach=reach) == [
        ("o0",),
        ("d0", "dx"),
    ]
    # Every stage is next to a dial-only host: dx stays a standby, an open node still joins.
    owners = [("d0",), ("dy",), ("o",)]
    assert add_replicas(owners, ["dx", "ox"], {}, 2, reach=reach) == [("d0", "ox"), ("dy",), ("o",)]


# -- reachability measured at Join ----------------------------------------------------------------


class StageServer:
    """A real Stage gRPC server on loopback (what a node serves from before it joins)."""

    async def __aenter__(self) -> str:
        self.server = grpc.aio.server()
        stage_pb2_grpc.add_StageServicer_to_server(StageService(Metrics("node")), self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        return f"127.0.0.1:{port}"

    async def __aexit__(self, *exc: object) -> None:
        await self.server.stop(None)


def join_request(name: str, address: str) -> cpb.JoinRequest:
    return cpb.JoinRequest(
        protocol_version=PROTOCOL_VERSION, token=TOKEN, node_name=name, announce_address=address
    )


def test_join_records_who_the_coordinator_can_reach_and_places_accordingly(tmp_path: Path, caplog):
    """Three nodes join a 3-stage run: one listening, one announcing a free port nobody listens on,
    one announcing a port that accepts TCP but never answers (a black hole). The last two are told
    (and log, naming the address) that they are dial-only, within the Join timeout; the placement
    keeps an accepting end on every link, and ``Status`` shows all of it."""
    silent = socket.socket()  # accepts connections in the kernel, never answers: like a dead NAT mapping
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    unbound = f"127.0.0.1:{free_port()}"
    hole = f"127.0.0.1:{silent.getsockname()[1]}"

    async def scenario() -> tuple[dict[str, cpb.JoinReply], dict[str, float], cpb.StatusReply, Metrics]:
        metrics = Metrics("coordinator")
        settings = CoordinatorSettings(reach_timeout_s=REACH_TIMEOUT_S)
        service = CoordinatorService(
            tiny_config(n_stages=3), TOKEN, tmp_path / "state.sqlite", None, metrics, [], settings
        )
        replies, seconds = {}, {}
        async with CoordinatorServer(service) as server, StageServer() as listening:
            address = f"127.0.0.1:{server.port}"
            for name, announced in (("refused", unbound), ("open", listening), ("silent", hole)):
                client = CoordinatorClient(address, Timeouts(rpc_s=10), Metrics("node"))
                t0 = time.monotonic()
                replies[name] = await client.join(join_request(name, announced))
                seconds[name] = time.monotonic() - t0
                await client.close()
            channel = grpc.aio.insecure_channel(address)
            status = await coordinator_pb2_grpc.CoordinatorStub(channel).Status(cpb.StatusRequest())
            await channel.close()
        return replies, seconds, status, metrics

    with caplog.at_level(logging.INFO):
        replies, seconds, status, metrics = asyncio.run(asyncio.wait_for(scenario(), 60))
    silent.close()
    assert {n: r.reachable for n, r in replies.items()} == {"refused": False, "open": True, "silent": False}
    assert seconds["refused"] < REACH_TIMEOUT_S and seconds["silent"] < REACH_TIMEOUT_S + 2, seconds
    for name, announced in (("refused", unbound), ("silent", hole)):
        assert f"could not reach {announced}" in replies[name].reachability
        warned = [r for r in caplog.records if r.levelno == logging.WARNING and announced in r.getMessage()]
        assert {r.name for r in warned} >= {"swarm.node.coordinator_client", "swarm.coordinator"}, warned
    samples = metrics.registry.get_sample_value
    assert samples("swarm_unreachable_joins_total", {"reason": "no_answer"}) == 2
    # "refused" took stage 0; "open" stage 1 (next to it: it accepts); "silent" stage 2, next to "open".
    assert {n: list(r.plan.stages) for n, r in replies.items()} == {
        "refused": [0],
        "open": [1],
        "silent": [2],
    }
    nodes = {n.node_name: n for n in status.nodes}
    assert {name: n.reachable for name, n in nodes.items()} == {
        "refused": False,
        "open": True,
        "silent": False,
    }
    assert nodes["silent"].address == hole  # what it announced, shown as such
    doc = status_document(status)
    assert {n["name"]: n["inbound"] for n in doc["nodes"]} == {
        "refused": "unreachable",
        "open": "open",
        "silent": "unreachable",
    }
    assert not doc["plan_problems"] and "plan problem" not in render(status, "here")


def test_a_dial_only_join_that_fits_nowhere_is_shown_as_a_plan_problem(tmp_path: Path):
    """Two nodes without an address on a 2-stage run: the second is not planned next to the first
    (neither could accept the stream) but waits, and ``Status`` says what is missing."""

    async def scenario() -> tuple[list[cpb.JoinReply], cpb.StatusReply]:
        service = CoordinatorService(
            tiny_config(n_stages=2), TOKEN, tmp_path / "state.sqlite", None, Metrics("coordinator"), []
        )
        async with CoordinatorServer(service) as server:
            channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            replies = [await stub.Join(join_request(name, ""), timeout=10) for name in ("a", "b")]
            status = await stub.Status(cpb.StatusRequest())
            await channel.close()
        return replies, status

    replies, status = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert [list(r.plan.stages) for r in replies] == [[0], []]
    assert not any(r.reachable for r in replies) and "no address announced" in replies[0].reachability
    (problem,) = status.plan_problems
    assert "free stages 1" in problem and "a node with an open port is needed" in problem
    assert f"plan problem: {problem}" in render(status, "here")
    assert [n["inbound"] for n in status_document(status)["nodes"]] == ["dial-only", "dial-only"]


async def serving_coordinator(
    stack: contextlib.AsyncExitStack,
    folder: Path,
    n_stages: int,
    settings: CoordinatorSettings | None = None,
    **train: int,
) -> tuple[CoordinatorService, coordinator_pb2_grpc.CoordinatorStub]:
    """A coordinator of a tiny run (``train``: its settings that differ) serving on loopback until
    ``stack`` closes, and a stub to it."""
    service = CoordinatorService(
        tiny_config(n_stages=n_stages, **train),
        TOKEN,
        folder / "state.sqlite",
        None,
        Metrics("coordinator"),
        [],
        settings,
    )
    server = await stack.enter_async_context(CoordinatorServer(service))
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    stack.push_async_callback(channel.close)
    return service, coordinator_pb2_grpc.CoordinatorStub(channel)


async def report_failure(stub, service: CoordinatorService, reporter: cpb.JoinReply, peer_id: str) -> None:
    """``reporter`` tells the coordinator its planned link to ``peer_id`` broke in the current epoch."""
    report = cpb.FailureReport(
        node_id=reporter.node_id,
        plan_epoch=service.ledger.plan_epoch,
        reason=f"the link to {peer_id[:8]} broke",
        peer_node_id=peer_id,
    )
    metadata = session_metadata(reporter.node_id, reporter.session)
    await stub.ReportFailure(report, timeout=10, metadata=metadata)


def test_a_link_that_fails_in_two_consecutive_epochs_is_placed_around(tmp_path: Path):
    """b reports its link to c broken in two epochs in a row while c answers Pings: the first
    restarts the same plan, the second gives c's stage to the standby instead."""

    async def scenario() -> tuple[list[dict[str, list[int]]], list[int]]:
        async with contextlib.AsyncExitStack() as stack:
            service, stub = await serving_coordinator(stack, tmp_path, 3)
            joined = {}
            for name in "abcs":
                address = await stack.enter_async_context(StageServer())
                joined[name] = await stub.Join(join_request(name, address), timeout=10)

            def stages() -> dict[str, list[int]]:
                return {n.name: n.stages for n in service.roster.nodes.values()}

            seen, epochs = [stages()], [service.ledger.plan_epoch]
            for _ in range(2):
                await report_failure(stub, service, joined["b"], joined["c"].node_id)
                seen.append(stages())
                epochs.append(service.ledger.plan_epoch)
        return seen, epochs

    seen, epochs = asyncio.run(asyncio.wait_for(scenario(), 30))
    start = {"a": [0], "b": [1], "c": [2], "s": []}
    assert seen == [start, start, {"a": [0], "b": [1], "c": [], "s": [2]}]
    assert epochs[1] == epochs[0] + 1 and epochs[2] == epochs[1] + 1


def test_reachability_and_broken_pairs_are_kept_in_the_state(tmp_path: Path):
    path = tmp_path / "state.sqlite"
    old = sqlite3.connect(path)  # the nodes table as it was before reachability was measured
    old.execute(
        "CREATE TABLE nodes (id TEXT PRIMARY KEY, name TEXT, address TEXT, device TEXT, max_stages "
        "INTEGER NOT NULL, stages TEXT NOT NULL, alive INTEGER NOT NULL, joined REAL, updated REAL)"
    )
    old.executemany(
        "INSERT INTO nodes VALUES (?, ?, ?, 'cpu', 1, '[]', 1, ?, 0)",
        [("a", "a", "127.0.0.1:7001", 1.0), ("b", "b", "", 2.0)],
    )
    old.commit()
    old.close()
    state = CoordinatorState(path)
    assert [(n.id, n.reachable) for n in state.nodes()] == [("a", True), ("b", False)]
    state.upsert_node(NodeRecord("c", "c", "127.0.0.1:7003", "cpu", 1, [], True, reachable=False))
    assert [(n.id, n.reachable) for n in state.nodes()] == [("a", True), ("b", False), ("c", False)]
    Roster(3, state, Metrics("coordinator"), CoordinatorSettings()).mark_broken(frozenset(("c", "a")))
    state.close()
    again = CoordinatorState(path)  # a restarted coordinator still places a and c apart
    assert Roster(3, again, Metrics("coordinator"), CoordinatorSettings()).broken == {frozenset(("a", "c"))}
    again.close()


def test_a_pair_that_cannot_be_placed_apart_runs_through_a_relay(tmp_path: Path):
    """Two reachable nodes, two stages, no standby: their link fails in two consecutive epochs and no
    placement avoids it, so the plan routes it through the relay that answers (a DIALs, b ACCEPTs),
    and Status lists it instead of a plan problem."""

    async def scenario() -> tuple[list[cpb.BoundaryLink], list[cpb.BoundaryLink], cpb.StatusReply, str]:
        async with RelayServer() as relay, contextlib.AsyncExitStack() as stack:
            relay_address = f"127.0.0.1:{await relay.start()}"
            settings = CoordinatorSettings(relays=(relay_address,))
            service, stub = await serving_coordinator(stack, tmp_path, 2, settings)
            joined = {}
            for name in "ab":
                address = await stack.enter_async_context(StageServer())
                joined[name] = await stub.Join(join_request(name, address), timeout=10)
            while not service.relays.alive:
                await asyncio.sleep(0.05)
            a, b = joined["a"], joined["b"]
            assert [
                link.relay_address for link in service.planner.plan_for(service.roster.nodes[a.node_id]).links
            ] == [""]
            for _ in range(2):
                await report_failure(stub, service, a, b.node_id)
            plans = [service.planner.plan_for(service.roster.nodes[n.node_id]).links for n in (a, b)]
            return plans[0], plans[1], service.status(), relay_address

    up, down, status, relay_address = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert [(link.role, link.relay_address, link.peer_address) for link in up] == [
        (cpb.LINK_ROLE_DIAL, relay_address, "")
    ]
    assert [(link.role, link.relay_address) for link in down] == [(cpb.LINK_ROLE_ACCEPT, relay_address)]
    assert up[0].link_secret == down[0].link_secret
    assert not status.plan_problems
    assert list(status.relayed_links) == [f"boundary 0: a -> b through relay {relay_address}"]
    assert f"relayed: boundary 0: a -> b through relay {relay_address}" in render(status, "here")


def test_a_relay_a_volunteer_offers_is_used_while_it_is_in_the_run(tmp_path: Path):
    """A node offering a relay that answers gets it planned with (a pair that failed twice runs
    through it); one offering a relay that does not answer is told so; the relay is dropped when
    its node leaves."""

    async def scenario() -> tuple[list[str], list[str], str, str, list[str]]:
        async with RelayServer() as relay, contextlib.AsyncExitStack() as stack:
            offered = f"127.0.0.1:{await relay.start()}"
            service, stub = await serving_coordinator(stack, tmp_path, 2)
            joined = {}
            for name, relay_address in (("x", ""), ("v", offered), ("w", f"127.0.0.1:{free_port()}")):
                request = join_request(name, await stack.enter_async_context(StageServer()))
                request.relay_address = relay_address
                joined[name] = await stub.Join(request, timeout=10)
            x, v = joined["x"], joined["v"]
            w = joined["w"].node_id  # the standby cannot take either end's place: its links fail too
            for pair in (frozenset((x.node_id, w)), frozenset((v.node_id, w))):
                service.roster.mark_broken(pair)
            for _ in range(2):  # x (stage 0) and v (stage 1) fail twice
                await report_failure(stub, service, x, v.node_id)
            links = service.planner.plan_for(service.roster.nodes[x.node_id]).links
            relayed = [link.relay_address for link in links]
            alive_before = list(service.relays.alive)
            leave = cpb.LeaveRequest(node_id=v.node_id, reason="done")
            await stub.Leave(leave, timeout=10, metadata=session_metadata(v.node_id, v.session))
            return alive_before, relayed, v.reachability, joined["w"].reachability, list(service.relays.alive)

    alive_before, relayed, offered_ok, offered_dead, alive_after = asyncio.run(
        asyncio.wait_for(scenario(), 30)
    )
    (offered,) = alive_before
    assert relayed == [offered]
    assert f"the relay offered at {offered} answers" in offered_ok
    assert "does not answer: not used" in offered_dead
    assert alive_after == []


def test_a_failure_reported_between_live_nodes_finds_the_host_that_died_elsewhere(tmp_path: Path, caplog):
    """Stage 0's host dies; stage 2 reports its link to stage 1 broken first (stage 1 failed the step
    because of stage 0 and closed its streams). Stage 1 answers, so instead of restarting the same
    plan (and restarting again once stage 0's death is noticed: two restarts for one kill), the
    coordinator pings the other hosts, finds stage 0's dead and starts one epoch without it."""

    async def scenario() -> tuple[bool, int, int]:
        async with contextlib.AsyncExitStack() as stack:
            service, stub = await serving_coordinator(stack, tmp_path, 3)
            joined, servers = {}, {}
            for name in "abc":
                servers[name] = StageServer()
                joined[name] = await stub.Join(
                    join_request(name, await servers[name].__aenter__()), timeout=10
                )
            for name in "bc":
                stack.push_async_callback(servers[name].__aexit__, None, None, None)
            await servers["a"].__aexit__(None, None, None)  # stage 0's host is gone
            before = service.ledger.plan_epoch
            with caplog.at_level(logging.INFO, logger="swarm.coordinator"):
                await report_failure(stub, service, joined["c"], joined["b"].node_id)
            return service.roster.nodes[joined["a"].node_id].alive, before, service.ledger.plan_epoch

    a_alive, before, after = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert not a_alive and after == before + 1
    assert "does not answer after a neighbour's failure: declared dead" in caplog.text
    assert "stage owners changed" in caplog.text


def test_a_port_that_refuses_is_a_dead_node_at_once_a_silent_one_is_waited_for(tmp_path: Path):
    """Two reachable nodes stop serving. Where nothing listens any more (a killed process) the
    connection is refused and the node counts as dead without waiting for its heartbeats; where the
    port still completes the TCP handshake but never answers (frozen, or a filter) the coordinator
    still waits two heartbeat intervals (a minute each here: longer than the test allows)."""

    async def scenario() -> tuple[bool, bool]:
        async with contextlib.AsyncExitStack() as stack:
            settings = CoordinatorSettings(heartbeat_interval_ms=60_000, probe_timeout_s=0.5)
            service, stub = await serving_coordinator(stack, tmp_path, 2, settings)
            joined, servers = {}, {}
            for name in ("killed", "frozen"):
                servers[name] = StageServer()
                joined[name] = await stub.Join(
                    join_request(name, await servers[name].__aenter__()), timeout=10
                )
                await servers[name].__aexit__(None, None, None)
            node = {name: service.roster.nodes[reply.node_id] for name, reply in joined.items()}
            assert all(n.reachable for n in node.values())
            frozen = socket.socket()  # the frozen node's port: the kernel accepts, nobody answers
            frozen.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            frozen.bind(("127.0.0.1", int(node["frozen"].address.rsplit(":", 1)[1])))
            frozen.listen(8)
            stack.callback(frozen.close)
            answers = service.roster.answers
            killed_answers = await asyncio.wait_for(answers(node["killed"], service.security), 5)
            try:
                await asyncio.wait_for(answers(node["frozen"], service.security), 3)
                waited = False
            except TimeoutError:
                waited = True
            return killed_answers, waited

    killed_answers, waited_for_frozen = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert not killed_answers and waited_for_frozen


def test_two_deaths_in_a_row_elsewhere_do_not_break_a_live_pair(tmp_path: Path):
    """Stage 0's host dies, then the standby that took its place: both times stage 2 reports its link
    to stage 1 broken (the step failed everywhere). The pair failed in two consecutive epochs, but
    both ends answer and a host elsewhere does not: the coordinator evicts the dead host each time
    (one epoch per death) and keeps the live pair together, not placed apart as a broken link."""

    async def scenario() -> tuple[list[int], dict[str, list[int]], set, list[bool]]:
        async with contextlib.AsyncExitStack() as stack:
            service, stub = await serving_coordinator(stack, tmp_path, 3)
            joined, servers = {}, {}
            for name in ("a", "b", "c", "s", "t"):
                servers[name] = StageServer()
                joined[name] = await stub.Join(
                    join_request(name, await servers[name].__aenter__()), timeout=10
                )
            for name in "bct":
                stack.push_async_callback(servers[name].__aexit__, None, None, None)
            epochs = [service.ledger.plan_epoch]
            for dying in "as":  # stage 0's host, then the standby that replaced it
                await servers[dying].__aexit__(None, None, None)
                await report_failure(stub, service, joined["c"], joined["b"].node_id)
                epochs.append(service.ledger.plan_epoch)
            nodes = service.roster.nodes
            stages = {n: nodes[joined[n].node_id].stages for n in joined}
            alive = [nodes[joined[n].node_id].alive for n in "as"]
            return epochs, stages, service.roster.broken, alive

    epochs, stages, broken, alive = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert epochs == [epochs[0], epochs[0] + 1, epochs[0] + 2]
    assert alive == [False, False] and not broken
    assert stages == {"a": [], "b": [1], "c": [2], "s": [], "t": [0]}


def test_a_relayed_link_that_fails_twice_moves_to_another_relay(tmp_path: Path):
    """Two dial-only nodes, two relays that both answer pings: the link fails through the first in
    two consecutive epochs (a relay that answers but does not splice), so the next plan routes it
    through the other one."""

    async def scenario() -> tuple[str, str, set[str]]:
        async with RelayServer() as r1, RelayServer() as r2, contextlib.AsyncExitStack() as stack:
            relays = {f"127.0.0.1:{await r.start()}" for r in (r1, r2)}
            service, stub = await serving_coordinator(
                stack, tmp_path, 2, CoordinatorSettings(relays=tuple(sorted(relays)))
            )
            a = await stub.Join(join_request("a", ""), timeout=10)
            b = await stub.Join(join_request("b", ""), timeout=10)
            while len(service.relays.alive) < 2:
                await asyncio.sleep(0.05)

            def relay() -> str:
                (link,) = service.planner.plan_for(service.roster.nodes[a.node_id]).links
                return link.relay_address

            first = relay()
            for _ in range(2):
                await report_failure(stub, service, a, b.node_id)
            return first, relay(), relays

    first, then, relays = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert first in relays and then in relays and then != first


async def replicated_second_stage(stack: contextlib.AsyncExitStack, folder: Path):
    """A 2-stage run's coordinator with node a on stage 0 and b (the lead) and r replicating stage 1;
    the service and the nodes' ids by name."""
    service, _ = await serving_coordinator(stack, folder, 2, replicas=2)
    ids = {}
    for name in ("a", "b", "r"):
        reply = await service.Join(join_request(name, await stack.enter_async_context(StageServer())), None)
        ids[name] = reply.node_id
    service.roster.host([(ids["a"],), (ids["b"], ids["r"])])
    service.planner.new_epoch("r replicates stage 1")
    return service, ids


def test_a_lost_replica_resumes_the_others_after_the_last_step_of_the_current_history(tmp_path: Path):
    """A 2-stage run with replicas b and r of stage 1 completes steps 0-5, rolls back (an epoch from
    step 0: no cut yet) and completes steps 0-2 again, then step 3 everywhere but on r (its
    averaging round failed where b's went through). When b is then lost, r goes on after step 2 of
    the history it is in: not after step 5 of the one abandoned, nor after step 3, which its stage
    reported but r never completed; from the hosts' own states (no snapshot named, no restart
    counted). A loss that leaves a stage without a host rolls back as before."""

    async def scenario() -> list[tuple[int, int, int]]:
        async with contextlib.AsyncExitStack() as stack:
            service, ids = await replicated_second_stage(stack, tmp_path)

            def steps(*numbers: int, hosts: tuple[str, ...] = ("a", "b", "r")) -> None:
                for step in numbers:
                    for name in hosts:
                        report = cpb.StepReport(
                            plan_epoch=service.ledger.plan_epoch,
                            node_id=ids[name],
                            stage=int(name != "a"),
                            step=step,
                            tokens=1,
                            progress_only=name == "r",
                        )
                        service.progress.record(report)

            def seen() -> tuple[int, int, int]:
                return (
                    service.ledger.resume_step,
                    service.ledger.restarts,
                    len(service.ledger.restore([0, 1])),
                )

            history = []
            steps(*range(6))
            service.planner.new_epoch("a broken link")  # rolls back to step 0
            history.append(seen())
            steps(0, 1, 2)
            steps(3, hosts=("a", "b"))
            service.planner.evict(service.roster.nodes[ids["b"]])
            history.append(seen())
            steps(3, hosts=("a", "r"))
            service.planner.evict(service.roster.nodes[ids["r"]])  # stage 1's last host
            history.append(seen())
            return history

    after_rollback, after_replica, after_last_host = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert after_rollback == (0, 1, 0)
    assert after_replica == (3, 1, 0)  # after step 2, from the hosts' own states, no restart counted
    assert after_last_host == (0, 2, 0)  # no cut: back to step 0, a restart


def test_a_replicas_progress_report_never_replaces_its_leads_totals(tmp_path: Path):
    """At the run's end the lead of a replicated stage may leave before its sibling's progress report
    for the last step arrives; the sibling then heads the roster, but its report still carries no
    totals: the step keeps the bytes and tokens the lead reported (it once recorded zeros)."""

    async def scenario() -> list[tuple]:
        async with contextlib.AsyncExitStack() as stack:
            service, ids = await replicated_second_stage(stack, tmp_path)
            epoch = service.ledger.plan_epoch
            record = service.progress.record
            record(
                cpb.StepReport(
                    plan_epoch=epoch, node_id=ids["a"], stage=0, step=0, tokens=8, bytes_sent_forward=100
                )
            )
            record(
                cpb.StepReport(
                    plan_epoch=epoch, node_id=ids["b"], stage=1, step=0, tokens=8, bytes_sent_backward=50
                )
            )
            service.planner.evict(service.roster.nodes[ids["b"]])  # the lead left: r heads the roster
            record(cpb.StepReport(plan_epoch=epoch, node_id=ids["r"], stage=1, step=0, progress_only=True))
            return service.state.step_summaries(2)

    [(step, _, tokens, forward, backward, _, _)] = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert (step, tokens, forward, backward) == (0, 8, 100, 50)


def test_with_replicas_a_failure_between_live_nodes_goes_on_from_own_states_once(tmp_path: Path):
    """In a run with replicas every node keeps its stages' last steps, so a broken link between two
    live nodes (nobody died) restarts after the last completed step from those states, not from
    the cut, and counts no restart; a second failure before that epoch completed a step (a host
    may lack the state) falls back to the latest cut."""

    async def scenario() -> list[tuple[int, int, bool]]:
        async with contextlib.AsyncExitStack() as stack:
            service, stub = await serving_coordinator(stack, tmp_path, 2, replicas=2)
            joined = {}
            for name in "ab":
                joined[name] = await stub.Join(
                    join_request(name, await stack.enter_async_context(StageServer())), timeout=10
                )
            for step in range(4):
                for stage, name in enumerate("ab"):
                    report = cpb.StepReport(
                        plan_epoch=service.ledger.plan_epoch,
                        node_id=joined[name].node_id,
                        stage=stage,
                        step=step,
                    )
                    service.progress.record(report)
            history = []
            for _ in range(2):
                await report_failure(stub, service, joined["b"], joined["a"].node_id)
                history.append(
                    (service.ledger.resume_step, service.ledger.restarts, service.ledger.from_own_states)
                )
            return history

    first, second = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert first == (4, 0, True)
    assert second == (0, 1, False)  # no cut yet: from the start
