"""Snapshots fetched from peers: every holder at once, each chunk verified, liars refused, resumable.

Holders are real gRPC ``Stage`` servers on 127.0.0.1 (in this process) serving snapshot files from
their own stores; the fetcher is the node's.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from swarm.node import keeper as keeper_module
from swarm.node.keeper import Keeper
from swarm.node.snapshot_fetch import FetchFailed, SnapshotFetcher
from swarm.node.snapshot_server import SnapshotServer
from swarm.node.stage_service import StageService

from swarm._proto.swarm.v1 import coordinator_pb2 as cpb
from swarm._proto.swarm.v1 import stage_pb2, stage_pb2_grpc
from swarm.io.checkpoint import SnapshotStore
from swarm.io.manifest import Manifest
from swarm.net.channel import open_channel
from swarm.ops.metrics import Metrics

CHUNK = 64 << 10
DATA = os.urandom(20 * CHUNK + 123)  # 21 chunks


class Holder:
    """A node's Stage server holding ``DATA`` as the snapshot of stage 1 after step 9."""

    def __init__(self, folder: Path, name: str, mbps: float = 0.0, corrupt: bool = False):
        self.name, self.metrics = name, Metrics("node")
        self.store = SnapshotStore(folder / name)
        saved = self.store.write(1, 9, DATA)
        if corrupt:  # a liar: one byte of every chunk differs (the file still carries the digest's name)
            bad = bytearray(DATA)
            for offset in range(7, len(bad), CHUNK):
                bad[offset] ^= 0xFF
            saved.path.write_bytes(bytes(bad))
        self.service = StageService(self.metrics)
        self.service.snapshots = SnapshotServer(self.store, self.metrics, mbps)
        self.service.snapshots.access = f"secret-{name}"

    @property
    def served(self) -> float:
        return self.metrics.snapshot_served_bytes._value.get()

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[cpb.SnapshotHolder]:
        server = grpc.aio.server()
        stage_pb2_grpc.add_StageServicer_to_server(self.service, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            yield cpb.SnapshotHolder(
                node_id=self.name, address=f"127.0.0.1:{port}", access=f"secret-{self.name}"
            )
        finally:
            await server.stop(0)


def reference(holders: list[cpb.SnapshotHolder], at_coordinator: bool = False) -> cpb.StageCheckpoint:
    m = Manifest.of(1, 9, DATA, CHUNK)
    return cpb.StageCheckpoint(
        stage=1,
        step=9,
        digest=m.digest,
        size=m.size,
        chunk_bytes=CHUNK,
        chunk_sha256=m.packed,
        holders=holders,
        at_coordinator=at_coordinator,
    )


class Fetching:
    """A fetcher into ``folder`` and what it reported."""

    def __init__(self, folder: Path):
        self.metrics = Metrics("node")
        self.bad: list[str] = []
        self.from_coordinator: list[str] = []

        async def coordinator_copy(key: str, size: int) -> bytes:
            self.from_coordinator.append(key)
            return DATA

        self.fetcher = SnapshotFetcher(
            folder, lambda: "me", self.metrics, lambda ref, holder: self.bad.append(holder), coordinator_copy
        )


def run(coro, timeout: float = 60):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def test_a_restore_from_two_holders_takes_chunks_from_both_and_equals_the_snapshot(tmp_path):
    a, b = Holder(tmp_path, "a"), Holder(tmp_path, "b")
    fetching = Fetching(tmp_path / "me")

    async def scenario() -> bytes:
        async with a.serving() as ha, b.serving() as hb:
            return await fetching.fetcher.fetch(reference([ha, hb]))

    assert run(scenario()) == DATA
    assert a.served > 0 and b.served > 0 and a.served + b.served == len(DATA)
    assert not fetching.bad and not fetching.from_coordinator
    assert not list((tmp_path / "me").iterdir())  # the partial fetch is gone once assembled


def test_a_lying_holder_is_refused_reported_and_its_chunks_come_from_the_other(tmp_path):
    liar, honest = Holder(tmp_path, "liar", corrupt=True), Holder(tmp_path, "honest")
    fetching = Fetching(tmp_path / "me")

    async def scenario() -> bytes:
        async with liar.serving() as hl, honest.serving() as hh:
            return await fetching.fetcher.fetch(reference([hl, hh]))

    assert run(scenario()) == DATA
    assert fetching.bad == ["liar"]
    assert fetching.metrics.snapshot_bad_chunks._value.get() == 1
    assert honest.served == len(DATA)  # the liar delivered nothing that was kept


def test_only_liars_fail_the_fetch_unless_the_coordinator_has_a_copy(tmp_path):
    liar = Holder(tmp_path, "liar", corrupt=True)
    fetching = Fetching(tmp_path / "me")

    async def scenario(at_coordinator: bool) -> bytes:
        async with liar.serving() as hl:
            return await fetching.fetcher.fetch(reference([hl], at_coordinator))

    with pytest.raises(FetchFailed, match="no holder left"):
        run(scenario(False))
    assert run(scenario(True)) == DATA and len(fetching.from_coordinator) == 1


def test_an_interrupted_fetch_resumes_without_refetching_verified_chunks(tmp_path):
    slow = Holder(tmp_path, "slow", mbps=8 * 4 * CHUNK / 1e6)  # about 4 chunks a second
    fetching = Fetching(tmp_path / "me")
    partial = tmp_path / "me" / f".fetch-{reference([]).digest}"

    async def interrupted() -> None:
        async with slow.serving() as hs:
            task = asyncio.create_task(fetching.fetcher.fetch(reference([hs])))
            while len(list(partial.glob("*.chunk"))) < 5:
                await asyncio.sleep(0.05)
            task.cancel()  # the node restarted, or its epoch was abandoned
            with contextlib.suppress(asyncio.CancelledError):
                await task

    run(interrupted())
    kept = len(list(partial.glob("*.chunk")))
    assert 5 <= kept < 21
    fresh = Holder(tmp_path, "fresh")

    async def resumed() -> bytes:
        async with fresh.serving() as hf:
            return await Fetching(tmp_path / "me").fetcher.fetch(reference([hf]))

    assert run(resumed()) == DATA
    assert fresh.served == len(DATA) - kept * CHUNK  # only what was missing


def test_bad_requests_get_a_clear_refusal_and_a_counter(tmp_path):
    holder = Holder(tmp_path, "h")
    key = reference([]).digest

    async def ask(request: stage_pb2.SnapshotRequest) -> grpc.StatusCode:
        async with holder.serving() as h, open_channel(h.address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stage_pb2_grpc.StageStub(channel).FetchSnapshot(request, timeout=10):
                    pass
            return err.value.code()

    cases = [
        (
            stage_pb2.SnapshotRequest(digest=key, chunk_bytes=CHUNK, chunks=[0], access="guess"),
            "snapshot_access",
        ),
        (
            stage_pb2.SnapshotRequest(digest="0" * 64, chunk_bytes=CHUNK, access="secret-h"),
            "snapshot_unknown",
        ),
        (stage_pb2.SnapshotRequest(digest="../x", chunk_bytes=CHUNK, access="secret-h"), "snapshot_unknown"),
        (
            stage_pb2.SnapshotRequest(digest=key, chunk_bytes=CHUNK, chunks=[21], access="secret-h"),
            "snapshot_request",
        ),
        (
            stage_pb2.SnapshotRequest(digest=key, chunk_bytes=0, chunks=[0], access="secret-h"),
            "snapshot_request",
        ),
    ]
    codes = [run(ask(request)) for request, _ in cases]
    assert codes == [
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.INVALID_ARGUMENT,
    ]
    for label in {label for _, label in cases}:
        expected = sum(1 for _, lbl in cases if lbl == label)
        assert holder.metrics.rejected.labels(reason=label)._value.get() == expected


def test_a_holder_that_lost_its_own_copy_reports_itself_and_fetches_from_the_others(tmp_path):
    other = Holder(tmp_path, "other")
    fetching = Fetching(tmp_path / "me")

    async def scenario() -> bytes:
        async with other.serving() as ho:
            me = cpb.SnapshotHolder(node_id="me", address="127.0.0.1:1", access="x")
            return await fetching.fetcher.fetch(reference([me, ho]))

    assert run(scenario()) == DATA
    assert fetching.bad == ["me"]  # the coordinator stops naming it: no epoch waits on a copy that is gone


def test_a_keeper_retries_an_order_whose_holder_was_down_and_reports_it_holds_it(tmp_path, monkeypatch):
    monkeypatch.setattr(keeper_module, "KEEP_RETRY_S", 0.2)
    holder = Holder(tmp_path, "h")
    fetching = Fetching(tmp_path / "k")
    store = SnapshotStore(tmp_path / "k")

    class Client:
        node_id, keep, reports = "k", [], []

        def report(self, method: str, request) -> None:
            self.reports.append(request)

    async def scenario() -> None:
        client = Client()
        async with holder.serving() as h:
            address = h.address
        order = reference([cpb.SnapshotHolder(node_id="h", address=address, access="secret-h")])
        client.keep = [order]
        keeper = Keeper(fetching.fetcher, store, client)
        keeper.take([order])  # its holder is down: the first fetch fails
        await asyncio.sleep(0.1)
        assert not client.reports
        async with holder.serving() as h:  # back, at another port: the order lists it anew
            client.keep = [reference([h])]
            for _ in range(100):
                if client.reports:
                    break
                await asyncio.sleep(0.1)
        await keeper.close()
        (report,) = client.reports
        assert report.kept and report.checkpoint.digest == order.digest

    run(scenario())
    assert store.find(reference([]).digest) is not None
