"""Which nodes the coordinator makes keep each snapshot, and how it reacts when holders die or lie."""

from __future__ import annotations

import asyncio

import pytest
from swarm.coordinator.export import artifact_store
from swarm.coordinator.keepers import Keepers
from swarm.coordinator.ledger import Ledger
from swarm.coordinator.roster import Roster
from swarm.coordinator.settings import CoordinatorSettings
from swarm.coordinator.state import CheckpointRecord, CoordinatorState, NodeRecord

from swarm._proto.swarm.v1 import coordinator_pb2
from swarm.io.manifest import Manifest
from swarm.ops.metrics import Metrics
from tests.helpers import tiny_config
from tests.test_coordinator import RPC_TIMEOUT, coordinator

SNAPSHOT = CheckpointRecord(9, 1, "ab" * 32, 100, 64, b"\0" * 64)


@pytest.fixture
def state(tmp_path):
    state = CoordinatorState(tmp_path / "state.sqlite")
    yield state
    state.close()


def roster_of(state: CoordinatorState, *nodes: tuple[str, list[int], bool]) -> Roster:
    """Nodes named by id, with their stages and whether others can reach them."""
    roster = Roster(3, state, Metrics("coordinator"), CoordinatorSettings())
    for node_id, stages, reachable in nodes:
        address = f"127.0.0.1:{len(roster.nodes) + 1}" if reachable else ""
        roster.add(NodeRecord(node_id, node_id, address, "cpu", 1, stages, True, reachable), node_id, "")
    return roster


def keepers_of(state: CoordinatorState, roster: Roster, count: int = 1) -> Keepers:
    return Keepers(count, b"run secret", state, roster, Metrics("coordinator"))


def ordered(keepers: Keepers) -> list[str]:
    return sorted(n for n, keys in keepers.orders.items() if SNAPSHOT.digest in keys)


def test_keepers_are_replicas_of_the_stage_then_standbys_then_other_hosts(state):
    roster = roster_of(
        state, ("host", [1], True), ("replica", [1], True), ("standby", [], True), ("other", [0], True)
    )
    hosts = [("other",), ("host", "replica"), ()]
    for dead, expected in [(None, "replica"), ("replica", "standby"), ("standby", "other")]:
        if dead is not None:
            roster.nodes[dead].alive = False
        keepers = keepers_of(state, roster)
        keepers.hold(SNAPSHOT.digest, "host")
        assert keepers.reconcile([SNAPSHOT], hosts)
        assert ordered(keepers) == [expected]
        assert keepers.orders_for(expected, [SNAPSHOT]) == [SNAPSHOT]


def test_a_keeper_that_dies_is_replaced_and_nobody_unreachable_keeps(state):
    roster = roster_of(state, ("host", [1], True), ("a", [], True), ("b", [0], True), ("hidden", [], False))
    keepers = keepers_of(state, roster)
    keepers.hold(SNAPSHOT.digest, "host")
    keepers.reconcile([SNAPSHOT], [("b",), ("host",), ()])
    assert ordered(keepers) == ["a"]
    keepers.hold(SNAPSHOT.digest, "a")  # it fetched and reported
    assert not keepers.reconcile([SNAPSHOT], [("b",), ("host",), ()])  # host + 1 keeper: enough
    roster.nodes["a"].alive = False
    issued = keepers.issued
    assert keepers.reconcile([SNAPSHOT], [("b",), ("host",), ()]) and keepers.issued == issued + 1
    assert ordered(keepers) == ["b"]  # never "hidden": nobody could fetch from it
    assert [n.id for n in keepers.alive_holders(SNAPSHOT.digest)] == ["host"]
    # The coordinator restarted: holders come back from the state file.
    assert keepers_of(state, roster).holders[SNAPSHOT.digest] == {"host", "a"}


def test_a_lying_holder_stops_counting_and_is_shown(state):
    roster = roster_of(state, ("host", [1], True), ("keeper", [], True))
    keepers = keepers_of(state, roster)
    for node_id in ("host", "keeper"):
        keepers.hold(SNAPSHOT.digest, node_id)
    keepers.refuse(SNAPSHOT.digest, "keeper", "newcomer", "hash mismatch")
    assert [n.id for n in keepers.alive_holders(SNAPSHOT.digest)] == ["host"]
    assert keepers.bad and "keeper" in keepers.bad[0]
    assert keepers.metrics.rejected.labels(reason="bad_snapshot_chunk")._value.get() == 1
    described = keepers.describe(SNAPSHOT, at_coordinator=False)
    assert [h.node_id for h in described.holders] == ["host"]
    assert described.holders[0].access == keepers.access("host") != keepers.access("keeper")


def test_who_uploads_to_the_coordinator(state):
    roster = roster_of(state, ("host", [0], True), ("hidden", [1], False))
    keepers = keepers_of(state, roster)
    assert keepers.uploads(roster.nodes["host"])  # nobody else others can reach to keep its snapshots
    assert keepers.uploads(roster.nodes["hidden"])  # nobody can fetch from it
    assert not keepers.can_hold(roster.nodes["hidden"])  # so a report without an upload is refused
    assert "uploaded to the coordinator" in keepers.holding()
    roster.add(NodeRecord("spare", "spare", "127.0.0.1:9", "cpu", 1, [], True, True), "spare", "")
    assert not keepers.uploads(roster.nodes["host"])
    assert "stay with their hosts" in keepers.holding()
    assert keepers_of(state, roster, count=0).uploads(roster.nodes["host"])


def test_a_cut_is_complete_once_every_snapshot_is_kept_by_a_second_node(state, tmp_path):
    config = tiny_config(n_stages=2)
    run = state.open_run(None, config)
    roster = roster_of(state, ("n0", [0], True), ("n1", [1], True), ("spare", [], True))
    keepers = keepers_of(state, roster)
    ledger = Ledger(
        config,
        run,
        state,
        artifact_store(tmp_path / "state.sqlite", 1 << 20),
        keepers,
        Metrics("coordinator"),
    )
    records = [CheckpointRecord(4, s, f"{s}" * 64, 100, 64, b"\0" * 64) for s in (0, 1)]
    for record, host in zip(records, ("n0", "n1"), strict=True):
        keepers.hold(record.digest, host)
        assert ledger.add_checkpoint(record) is None  # held by its host only: not durable yet
    keepers.hold(records[0].digest, "spare")
    assert ledger.cut_news() is None and ledger.latest_cut() == -1
    keepers.hold(records[1].digest, "n0")
    assert ledger.cut_news() == 4 and ledger.latest_cut() == 4
    assert ledger.cut_news() is None  # shown once


def test_over_grpc_snapshots_stay_with_nodes_keepers_complete_the_cut_and_liars_show(tmp_path):
    """The coordinator's side of the whole flow, with nodes played by the test: a host reports a
    manifest without uploading, a keeper hears its order in a heartbeat, reports it holds the
    snapshot, and only then the cut is complete; a fetcher's report of a liar reaches Status."""

    async def scenario() -> None:
        async with coordinator(tmp_path / "state.sqlite", tiny_config(n_stages=2), keepers=1) as h:
            a, b = await h.join("a"), await h.join("b")
            standby = await h.join("standby")
            hidden = await h.join("hidden", address="")
            epoch = b.plan.epoch
            plans = {n.node_id: (await h.heartbeat(n.node_id)).plan for n in (a, b, standby, hidden)}
            assert not plans[a.node_id].upload_snapshots and plans[hidden.node_id].upload_snapshots
            refs = {}
            for stage, host in enumerate((a, b)):
                data = f"stage {stage}".encode() * 100
                m = Manifest.of(stage, 4, data, 256)
                ref = coordinator_pb2.StageCheckpoint(
                    stage=stage, step=4, digest=m.digest, size=m.size, chunk_bytes=256, chunk_sha256=m.packed
                )
                report = coordinator_pb2.CheckpointReport(
                    node_id=host.node_id, plan_epoch=epoch, checkpoint=ref
                )
                assert (await h.stub.ReportCheckpoint(report, timeout=RPC_TIMEOUT)).latest_cut == 0
                refs[stage] = ref
            assert (await h.status()).latest_cut == 0  # held by their hosts only: not durable yet
            assert not list((tmp_path / "state.sqlite.artifacts").glob("*.bin"))  # no bytes came here
            beat = await h.heartbeat(standby.node_id, epoch)
            assert sorted(k.stage for k in beat.keep) == [0, 1]  # the standby keeps both
            (order0,) = [k for k in beat.keep if k.stage == 0]
            assert [x.node_id for x in order0.holders] == [a.node_id] and order0.chunk_sha256
            assert order0.holders[0].access == a.snapshot_access and not order0.at_coordinator
            for ref in refs.values():
                kept = coordinator_pb2.CheckpointReport(node_id=standby.node_id, checkpoint=ref, kept=True)
                ack = await h.stub.ReportCheckpoint(kept, timeout=RPC_TIMEOUT)
            assert ack.latest_cut == 5
            bad = coordinator_pb2.CheckpointReport(
                node_id=b.node_id, checkpoint=refs[0], bad_holder=standby.node_id
            )
            await h.stub.ReportCheckpoint(bad, timeout=RPC_TIMEOUT)
            status = await h.status()
            assert status.bad_holders and status.bad_holders[0].startswith(f"node {standby.node_id[:8]}")
            assert "stay with their hosts and 1 keeper(s)" in status.snapshot_holding

    asyncio.run(asyncio.wait_for(scenario(), 60))
