"""Who is in the run: its nodes, their liveness, reachability, identities, capacity and averaging addresses.

Every change here is synchronous (the coordinator's handlers share one event loop, so a change
that never awaits needs no lock) and nodes are written through to the state file. What a change
of membership means for the plan is :class:`~swarm.coordinator.planner.Planner`'s to decide.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time

from swarm.coordinator.assignment import Owners, Reach, stages_of
from swarm.coordinator.reachability import ping, refused
from swarm.coordinator.settings import CoordinatorSettings
from swarm.coordinator.state import CoordinatorState, NodeRecord

from swarm._proto.swarm.v1 import coordinator_pb2
from swarm.net.tls import Security
from swarm.ops.metrics import Metrics
from swarm.runtime.replicas import unmeasured_rate

log = logging.getLogger("swarm.coordinator")


class Roster:
    """The run's nodes (resumed from ``state``) and what their heartbeats said."""

    def __init__(
        self, n_stages: int, state: CoordinatorState, metrics: Metrics, settings: CoordinatorSettings
    ):
        self.n_stages, self.state, self.metrics, self.settings = n_stages, state, metrics, settings
        self.nodes = {node.id: node for node in state.nodes()}
        # Resumed nodes that were alive get at least resume_grace_s to heartbeat again
        # (their channels are reconnecting).
        now = time.monotonic() + max(0.0, settings.resume_grace_s - settings.dead_after_s)
        self.last_seen = dict.fromkeys(self.nodes, now)
        self.heartbeats: dict[str, coordinator_pb2.HeartbeatRequest] = {}  # the last one of each node
        self.left: set[str] = set()  # nodes that said Leave (since this process started)
        self.leaving: set[str] = set()  # nodes that asked for a final cut and will Leave after it
        self.last_stages: dict[str, list[int]] = {}  # what each node hosted last
        self.averaging: dict[str, str] = {}  # node id -> its P2P multiaddr for replica averaging
        self.capacity: dict[str, float] = {}  # node id -> tokens/s of busy time, as it last reported
        # node id -> activation frames it sent that a downstream screen flagged (swarm.runtime.screen)
        self.drifted: collections.Counter[str] = collections.Counter()
        # node id -> the party it is in accusations: its join token when that token is its own
        # (`token create`), else itself (nodes sharing the operator's token cannot be linked)
        self.party: dict[str, str] = {}
        self.certificate_of: dict[str, str] = {}  # node id -> its client certificate's name (mutual TLS)
        # pairs of nodes whose planned link failed to connect in two consecutive epochs
        self.broken: set[frozenset[str]] = state.broken_pairs()
        for node_id, (party, certificate) in state.identities().items():
            self.party[node_id] = party
            if certificate:
                self.certificate_of[node_id] = certificate

    def mark_broken(self, pair: frozenset[str]) -> None:
        """The two nodes of ``pair`` cannot link directly (kept in the state: a restart remembers)."""
        self.broken.add(pair)
        self.state.add_broken_pair(pair)

    def alive_node(self, node_id: str) -> NodeRecord | None:
        node = self.nodes.get(node_id)
        return node if node is not None and node.alive else None

    def party_of(self, node_id: str) -> str:
        return self.party.get(node_id, node_id)

    def owners(self) -> list[tuple[str, ...]]:
        """Each stage's hosts (its replicas) in join order; the first is the stage's lead."""
        owners: list[tuple[str, ...]] = [()] * self.n_stages
        for node in self.nodes.values():
            for s in node.stages:
                owners[s] = (*owners[s], node.id)
        return owners

    def members(self) -> list[tuple[str, int]]:
        """The alive nodes with how many stages each may host (join order)."""
        return [(n.id, n.max_stages) for n in self.nodes.values() if n.alive]

    def standbys(self) -> list[tuple[str, int]]:
        """The alive nodes hosting nothing, with how many stages each may host (join order)."""
        return [(n.id, n.max_stages) for n in self.nodes.values() if n.alive and not n.stages]

    def standby_can_average(self) -> bool:
        """Whether some alive node hosting nothing has an averaging address (it could be a replica)."""
        return any(n.alive and not n.stages and self.averaging.get(n.id) for n in self.nodes.values())

    def addresses(self) -> dict[str, str]:
        """Each alive node's announced address, if the coordinator reached it (others only dial)."""
        return {n.id: n.address for n in self.nodes.values() if n.alive and n.reachable}

    def reach(self) -> Reach:
        """Who accepts inbound streams (the alive nodes the coordinator reached), which pairs cannot
        connect."""
        dial_only = frozenset(n.id for n in self.nodes.values() if n.alive and not n.reachable)
        return Reach(dial_only, frozenset(self.broken))

    def silent(self) -> list[NodeRecord]:
        """The alive nodes silent for longer than ``dead_after_s``: to be declared dead."""
        now = time.monotonic()
        return [
            n
            for n in self.nodes.values()
            if n.alive and now - self.last_seen[n.id] > self.settings.dead_after_s
        ]

    def add(self, node: NodeRecord, party: str, certificate: str) -> None:
        """A node that just joined (hosting nothing yet), in the party ``party``."""
        self.nodes[node.id] = node
        self.party[node.id] = party
        if certificate:
            self.certificate_of[node.id] = certificate
        self.state.set_identity(node.id, party, certificate)
        self.last_seen[node.id] = time.monotonic()
        self.state.upsert_node(node)

    def heard(self, node: NodeRecord, request: coordinator_pb2.HeartbeatRequest) -> None:
        """Note ``node``'s heartbeat and the capacity it measured."""
        self.last_seen[node.id] = time.monotonic()
        self.heartbeats[node.id] = request
        if request.capacity_tokens_per_second > 0:
            self.capacity[node.id] = request.capacity_tokens_per_second

    def averages_at(self, node_id: str, address: str) -> bool:
        """Record ``node_id``'s averaging address; whether it changed."""
        moved = address != self.averaging.get(node_id, "")
        self.averaging[node_id] = address
        return moved

    def retire(self, node: NodeRecord) -> None:
        """``node`` is out of the run (left, dead or evicted): it hosts nothing and stays out."""
        self.last_stages[node.id] = list(node.stages)
        node.alive, node.stages = False, []
        self.state.upsert_node(node)

    def host(self, owners: Owners) -> None:
        """Give every node its stages in ``owners``; persist the nodes whose stages changed."""
        for node in self.nodes.values():
            stages = stages_of(owners, node.id)
            if stages != node.stages:
                node.stages = stages
                self.state.upsert_node(node)

    def rates(self, owners: Owners) -> list[list[float]]:
        """Each stage's hosts' capacities; a host not measured yet counts at the mean of the live
        nodes measured."""
        unknown = unmeasured_rate(c for n, c in self.capacity.items() if self.alive_node(n) is not None)
        return [[self.capacity.get(n) or unknown for n in hosts] for hosts in owners]

    def show_alive(self) -> None:
        """Set the gauges of alive nodes, in all and per stage."""
        alive = [n for n in self.nodes.values() if n.alive]
        self.metrics.nodes_alive.set(len(alive))
        for stage in range(self.n_stages):
            self.metrics.stage_nodes.labels(str(stage)).set(sum(stage in n.stages for n in alive))

    def statuses(self) -> list[coordinator_pb2.NodeStatus]:
        """Every node as ``Status`` shows it, with what its last heartbeat said."""
        now = time.monotonic()
        nodes = []
        for n in self.nodes.values():
            beat = self.heartbeats.get(n.id, coordinator_pb2.HeartbeatRequest())
            nodes.append(
                coordinator_pb2.NodeStatus(
                    node_id=n.id,
                    node_name=n.name,
                    address=n.address,
                    stages=n.stages,
                    last_heartbeat_age_s=now - self.last_seen[n.id],
                    alive=n.alive,
                    device=n.device,
                    phase=beat.phase,
                    plan_epoch=beat.plan_epoch,
                    step=beat.step,
                    tokens_per_second=beat.tokens_per_second,
                    subspace_version=beat.subspace_version,
                    left=n.id in self.left,
                    last_stages=n.stages or self.last_stages.get(n.id, []),
                    reachable=n.reachable,
                    drifted_frames=self.drifted[n.id],
                )
            )
        return nodes

    async def dial_back(self, name: str, address: str, security: Security) -> tuple[bool, str]:
        """Whether the joining node ``name`` accepts streams at its announced ``address`` (a Stage
        Ping answered within ``reach_timeout_s``), and a line for its log saying what was tried.
        Dial-only joins are counted in ``swarm_unreachable_joins``."""
        if not address:
            self.metrics.unreachable_joins.labels(reason="no_address").inc()
            return False, "no address announced: placed as dial-only (this node dials its neighbours)"
        timeout = self.settings.reach_timeout_s
        if timeout <= 0:
            return True, f"{address} taken on trust (the coordinator does not check reachability)"
        error = await ping(address, security, timeout)
        if not error:
            return True, f"the coordinator reached {address}"
        self.metrics.unreachable_joins.labels(reason="no_answer").inc()
        log.warning("node %r announced %s, which does not answer (%s): dial-only", name, address, error)
        return False, (
            f"the coordinator could not reach {address} within {timeout:g}s ({error}): placed as "
            "dial-only; open that port to it (and to the other nodes), or --announce an address that is"
        )

    async def answers(self, node: NodeRecord, security: Security) -> bool:
        """Whether a node is alive after all: it answers a Ping within ``probe_timeout_s``, or, failing
        that, still heartbeats for two more intervals (its port may just be out of our reach). A port
        that refuses the connection is a dead process's: no wait (a killed node costs its stage two
        heartbeat intervals less)."""
        if not await ping(node.address, security, self.settings.probe_timeout_s):
            return True
        if await refused(node.address, self.settings.probe_timeout_s):
            return False
        silent_for = 2 * self.settings.heartbeat_interval_ms / 1000
        seen = self.last_seen[node.id]
        await asyncio.sleep(max(0.0, seen + silent_for - time.monotonic()))
        return self.last_seen[node.id] > seen
