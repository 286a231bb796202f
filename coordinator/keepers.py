"""Who holds each stage snapshot, and the keep orders that give every snapshot ``count`` keepers.

A snapshot's bytes stay with the node that took it; the coordinator keeps its manifest and orders
``count`` other nodes to fetch it from its holders and keep it, so that it outlives its host.
Keepers are picked among the alive nodes others can reach: first replicas of the same stage (they
host it already, and take it over when its host dies), then standbys (idle, and the likeliest to be
placed on a lost stage, where their copy saves the fetch), then the hosts of other stages; among
those, the node holding the fewest snapshots, so the bytes spread. :meth:`Keepers.reconcile` runs
periodically and orders new keepers wherever a holder died or an order went to a dead node.
With ``count`` 0, or no node to keep a node's snapshots, that node uploads them to the
coordinator (the path of old; :meth:`Keepers.uploads`).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Iterable

from swarm.coordinator.roster import Roster
from swarm.coordinator.state import CheckpointRecord, CoordinatorState, NodeRecord

from swarm._proto.swarm.v1 import coordinator_pb2
from swarm.ops.metrics import Metrics

log = logging.getLogger("swarm.coordinator")
MAX_BAD_SHOWN = 20  # bad-holder lines kept for Status


class Keepers:
    """Holders and keep orders of the run's snapshots; ``key`` derives the holders' access secrets."""

    def __init__(self, count: int, key: bytes, state: CoordinatorState, roster: Roster, metrics: Metrics):
        self.count, self.key, self.state, self.roster, self.metrics = count, key, state, roster, metrics
        self.holders: dict[str, set[str]] = state.holders()  # digest -> nodes that reported holding it
        self.orders: dict[str, set[str]] = {}  # node id -> digests it is to fetch and keep
        self.issued = 0  # keep orders so far: a heartbeat that heard fewer gets this node's orders
        self.bad: list[str] = []  # holders reported for serving a bad chunk, for Status

    def access(self, node_id: str) -> str:
        """The secret node ``node_id`` requires of peers fetching the snapshots it holds."""
        return hmac.new(self.key, f"snapshot-access/{node_id}".encode(), hashlib.sha256).hexdigest()

    def _servers(self) -> list[NodeRecord]:
        """Alive nodes others can fetch from (reachable, with an address)."""
        return [n for n in self.roster.nodes.values() if n.alive and n.reachable and n.address]

    def alive_holders(self, key: str) -> list[NodeRecord]:
        return [n for n in self._servers() if n.id in self.holders.get(key, ())]

    def can_hold(self, node: NodeRecord) -> bool:
        """Whether ``node`` may hold snapshots for the run: keepers are on and others can fetch from it."""
        return self.count > 0 and node.reachable and bool(node.address)

    def uploads(self, node: NodeRecord) -> bool:
        """Whether ``node`` uploads its snapshots to the coordinator: nobody could fetch them from it,
        or nobody else could keep them."""
        return not self.can_hold(node) or not any(n.id != node.id for n in self._servers())

    def describe(self, record: CheckpointRecord, at_coordinator: bool) -> coordinator_pb2.StageCheckpoint:
        """``record`` as nodes are told of it: manifest, alive holders and their access secrets."""
        return coordinator_pb2.StageCheckpoint(
            stage=record.stage,
            step=record.step,
            digest=record.digest,
            size=record.size,
            chunk_bytes=record.chunk_bytes,
            chunk_sha256=record.chunks,
            holders=[
                coordinator_pb2.SnapshotHolder(
                    node_id=n.id,
                    address=n.address,
                    certificate=self.roster.certificate_of.get(n.id, ""),
                    access=self.access(n.id),
                )
                for n in self.alive_holders(record.digest)
            ],
            at_coordinator=at_coordinator,
        )

    def holding(self) -> str:
        """Where snapshot bytes live, for Status."""
        if self.count == 0:
            return "snapshots are uploaded to the coordinator (--snapshot-keepers 0)"
        servers = self._servers()
        if len(servers) < 2:
            return "snapshots are uploaded to the coordinator: no second node others can reach to keep them"
        return (
            f"snapshots stay with their hosts and {self.count} keeper(s) each; the coordinator keeps "
            "manifests (and the final cut, uploaded for the trained model)"
        )

    def took(self, key: str, node: NodeRecord) -> None:
        """``node`` took snapshot ``key`` and keeps it on disk: a holder, when others can fetch from it."""
        if self.can_hold(node):
            self.hold(key, node.id)

    def hold(self, key: str, node_id: str) -> None:
        """``node_id`` holds snapshot ``key`` (it took it, or fetched and verified it)."""
        self.holders.setdefault(key, set()).add(node_id)
        self.state.set_holder(key, node_id, True)
        self.orders.get(node_id, set()).discard(key)

    def refuse(self, key: str, node_id: str, reporter: str, why: str) -> None:
        """A fetcher found ``node_id`` serving a bad chunk of ``key``: it no longer counts as a holder."""
        self.metrics.rejected.labels(reason="bad_snapshot_chunk").inc()
        line = f"node {node_id[:8]} served a bad chunk of snapshot {key[:12]} to {reporter[:8]}: {why}"
        log.warning("%s", line)
        self.bad = [*self.bad, line][-MAX_BAD_SHOWN:]
        self.holders.get(key, set()).discard(node_id)
        self.state.set_holder(key, node_id, False)

    def forget(self, keys: Iterable[str]) -> None:
        """The snapshots ``keys`` are no longer part of the run."""
        keys = list(keys)
        for key in keys:
            self.holders.pop(key, None)
            for ordered in self.orders.values():
                ordered.discard(key)
        self.state.forget_holders(keys)

    def orders_for(self, node_id: str, records: Iterable[CheckpointRecord]) -> list[CheckpointRecord]:
        """The snapshots ``node_id`` is still to fetch and keep."""
        ordered = self.orders.get(node_id, set())
        return [r for r in records if r.digest in ordered]

    def reconcile(self, records: Iterable[CheckpointRecord], stage_hosts: list[tuple[str, ...]]) -> bool:
        """Order keepers for every snapshot held by fewer than ``1 + count`` alive nodes (held or
        ordered); whether any order was issued. ``stage_hosts``: each stage's hosts (replicas first)."""
        if self.count == 0:
            return False
        servers = self._servers()
        alive = {n.id for n in servers}
        issued = False
        for r in records:
            holding = self.holders.get(r.digest, set()) & alive
            if not holding:
                continue  # nothing to fetch from: the coordinator's copy, or lost
            ordered = {n for n, keys in self.orders.items() if r.digest in keys and n in alive}
            wanted = 1 + self.count - len(holding | ordered)
            if wanted <= 0:
                continue
            hosts = stage_hosts[r.stage] if r.stage < len(stage_hosts) else ()
            for keeper in self._pick(servers, holding | ordered, hosts)[:wanted]:
                self.orders.setdefault(keeper.id, set()).add(r.digest)
                log.info(
                    "node %s keeps the snapshot of stage %d after step %d", keeper.id[:8], r.stage, r.step
                )
                issued = True
        if issued:
            self.issued += 1
        return issued

    def _pick(self, servers: list[NodeRecord], taken: set[str], hosts: tuple[str, ...]) -> list[NodeRecord]:
        """Candidate keepers, best first: the stage's replicas, standbys, other stages' hosts; fewest held."""
        load = {n.id: sum(n.id in h for h in self.holders.values()) for n in servers}
        for node_id, keys in self.orders.items():
            load[node_id] = load.get(node_id, 0) + len(keys)

        def rank(n: NodeRecord) -> tuple[int, int, str]:
            kind = 0 if n.id in hosts else 1 if not n.stages else 2
            return kind, load[n.id], n.id

        return sorted((n for n in servers if n.id not in taken), key=rank)
