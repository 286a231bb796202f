"""The plan: who hosts which stage this epoch, and what each node is told.

Every change of stage owners goes through :meth:`Planner.replan`, the one place that reassigns
stages: free stages go to standbys (join order), then, when the run allows replicas, the remaining
standbys that can average become replicas of the weakest stages; every link is kept connectable
where some placement can (:func:`~swarm.coordinator.assignment.place`), and what cannot is in
:attr:`Planner.problems` (logged, and shown by ``Status``). A link that fails in two consecutive
epochs between two live nodes is placed around the same way (:meth:`Planner.link_failed`). A link
that no placement lets open directly runs through a relay when one answers (:mod:`.relays`), and the
free stages only such links could serve are then given to the standbys too. When
the owners change a new plan epoch starts (:meth:`Planner.new_epoch`, also started when a node
reports a broken boundary or a replica averages at a new address). Nothing here awaits: the
handlers share one event loop, so the in-memory plan needs no lock. Once the run is complete,
membership changes no longer replan it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from swarm.coordinator.assignment import (
    EVERYONE,
    Owners,
    Reach,
    add_replicas,
    link_ends,
    links_for,
    place,
    unconnectable,
)
from swarm.coordinator.ledger import Ledger
from swarm.coordinator.progress import Progress
from swarm.coordinator.relays import RelayPool
from swarm.coordinator.roster import Roster
from swarm.coordinator.state import NodeRecord

from swarm._proto.swarm.v1 import coordinator_pb2
from swarm.core.config import RunConfig

log = logging.getLogger("swarm.coordinator")


class Planner:
    """Plans the ``roster``'s stages into the ``ledger``'s epochs; ``ended(node_id)`` is told when a
    node leaves the run (its streams end)."""

    def __init__(
        self,
        config: RunConfig,
        roster: Roster,
        ledger: Ledger,
        progress: Progress,
        ended: Callable[[str], None],
        relays: RelayPool | None = None,
    ):
        self.config, self.roster, self.ledger, self.progress = config, roster, ledger, progress
        self.ended = ended
        self.relays = relays if relays is not None else RelayPool()
        self._relayed: list[str] = []  # the relayed links of the current epoch's plan
        self._failed: dict[frozenset[str], int] = {}  # a pair of nodes -> the last epoch their link failed
        self.problems: list[str] = self._problems(roster.owners())
        self._growth_pending = False  # standbys wait to join as replicas at the next cut
        self._growing = False
        # node id -> the first step it hosted a stage at (the lowest resume step of an epoch it
        # hosted in: after a rollback, at most the first in the run's current history)
        self.first_hosted = ledger.state.first_hosted()
        self._deal()
        self._note_hosts()

    def evict(self, node: NodeRecord, rollback: bool = False) -> None:
        """Take ``node`` out of the run (it left, died or was evicted) and replan without it.

        ``rollback``: it computed wrong (audits), so nothing built on its values may survive: the
        next epoch resumes from the newest cut before the first step it hosted a stage at (or from
        step 0), never from the hosts' own states."""
        self.ended(node.id)
        before = self.roster.owners()
        before_step = self.first_hosted.get(node.id, 0) if rollback else None
        self.relays.drop(node.id)  # its relay goes with it: plan without
        self.roster.retire(node)
        self.replan(before, lost=node.id, before_step=before_step)
        if self.relayed_links() != self._relayed and not self.progress.run_complete:
            reason = f"node {node.id[:8]} left with the relay links ran through"
            self.new_epoch(reason, before_step=before_step)

    def replan(self, before: Owners, lost: str | None = None, before_step: int | None = None) -> None:
        """Reassign stages (the one place that does); a new epoch when the owners differ from ``before``.

        ``lost``: the node just taken out. Where it was a replica (every stage it hosted keeps a live
        host) the others go on from their own states of the last completed step and nothing else
        changes now; standbys join stages as replicas at the next cut (requested), so an added
        replica does not roll the run back either. ``before_step``: the lost node computed wrong
        from that step on: a new epoch (owners changed or not) resumes from a cut before it
        (:meth:`new_epoch`)."""
        if not self.progress.run_complete:
            survivors = self._without(before, lost) if lost is not None and before_step is None else None
            if survivors is not None:
                self.roster.host(survivors)
                self._show_problems(self._problems(survivors))
                self.new_epoch(f"replica {lost[:8]} is gone, its siblings go on", own_states=True)
                self.roster.show_alive()
                return
            reach = self.roster.reach()
            owners = place(self.roster.owners(), self.roster.members(), reach)
            if self.relays.alive:  # free stages no direct link could serve: relayed links serve them
                owners = place(owners, self.roster.members(), EVERYONE)
            if self.config.train.replicas > 1:
                owners = self._add_replicas(owners, reach)
                if self._only_grows(before, owners):
                    self._await_cut_for_growth()
                    owners = before
            self.roster.host(owners)
            self._show_problems(self._problems(owners))
            if owners != before or before_step is not None:
                reason = "stage owners changed" if before_step is None else "a host computed wrong"
                self.new_epoch(reason, before_step=before_step)
        self.roster.show_alive()

    def _without(self, before: Owners, lost: str) -> Owners | None:
        """``before`` without ``lost`` when it was a replica wherever it hosted and the current epoch
        completed steps its other hosts can resume after (None otherwise)."""
        if self.config.train.replicas <= 1 or self.progress.timeline < 0:
            return None
        if not any(lost in hosts for hosts in before):
            return None
        survivors = [tuple(h for h in hosts if h != lost) for hosts in before]
        return survivors if all(survivors) else None

    def _only_grows(self, before: Owners, owners: Owners) -> bool:
        """Whether ``owners`` only adds replicas to stages that have hosts, once the run has begun
        (such a change waits for a cut; one that fills a free stage cannot wait)."""
        if self._growing or self.progress.completed < 0 or owners == before:
            return False
        return all(set(b) <= set(o) and (b or not o) for b, o in zip(before, owners, strict=True))

    def _await_cut_for_growth(self) -> None:
        if not self._growth_pending:
            self._growth_pending = True
            self.ledger.request_cut()
            log.info("standbys can join as replicas: a snapshot cut is requested, they join at it")

    def cut_completed(self, step: int) -> None:
        """A cut after ``step`` is complete: the standbys waiting to join as replicas join now, the run
        resuming right after it (its hosts from their own states, the newcomers from its snapshots)."""
        if not self._growth_pending or self.progress.run_complete:
            return
        self._growth_pending, self._growing = False, True
        try:
            self.replan(self.roster.owners())
        finally:
            self._growing = False

    def link_failed(self, node_id: str, peer_id: str, epoch: int) -> bool:
        """Note that the planned link between the live nodes ``node_id`` and ``peer_id`` broke or
        did not open in ``epoch``. The second epoch in a row, the pair counts as unable to connect
        and the stages are placed around it where some placement can (a standby, else another
        stage's node, takes one end's place); whether that started a new epoch."""
        link = next((x for x in self._links(node_id) if x.peer_node_id == peer_id), None)
        if link is None:
            return False  # not a link of this plan (replicas average over their P2P)
        pair = frozenset((node_id, peer_id))
        again, self._failed[pair] = self._failed.get(pair) == epoch - 1, epoch
        if not again:
            return False
        if link.relay_address:
            self.relays.avoid(*link_ends(node_id, link), link.relay_address)
            log.warning(
                "the relayed link failed twice through %s: another relay where one answers",
                link.relay_address,
            )
        log.warning(
            "the link between nodes %s and %s failed in two consecutive epochs: placing around it",
            node_id[:8],
            peer_id[:8],
        )
        self.roster.mark_broken(pair)
        before = self.ledger.plan_epoch
        self.replan(self.roster.owners())
        return self.ledger.plan_epoch != before

    def relays_changed(self) -> None:
        """The relays that answer changed: place again, and start a new epoch if that changes which
        links run through which relay."""
        self.replan(self.roster.owners())
        if self.relayed_links() != self._relayed and not self.progress.run_complete:
            self.new_epoch("the relays that answer changed")

    def new_epoch(self, reason: str, own_states: bool = False, before_step: int | None = None) -> None:
        """Start a plan epoch with the current owners (microbatches dealt anew), from the latest cut
        or (``own_states``, in runs with replicas) right after the last completed step, each host
        from the state it kept of it; from the cut after all when the epoch this one replaces did
        so and completed no step (a host may have lacked the state). ``before_step``: from the
        latest cut before that step (own states or not: they may hold an evicted node's values)."""
        self._deal()
        self._relayed = self.relayed_links()
        stuck = self.ledger.from_own_states and self.progress.timeline == self.ledger.resume_step - 1
        own_states = own_states and self.config.train.replicas > 1 and not stuck and before_step is None
        hosts = (n for stage_hosts in self.roster.owners() for n in stage_hosts)
        after = self.progress.resumable(hosts) if own_states else None
        progressed = self.progress.completed >= 0
        self.ledger.start_epoch(
            reason, progressed, after_own_step=after, planned=self._growing, before_step=before_step
        )
        self.progress.epoch_started(self.ledger.resume_step)
        self._note_hosts()
        if self._growth_pending:  # the cut asked for may have been lost with the epoch it was marked in
            self.ledger.request_cut()

    def _note_hosts(self) -> None:
        """Lower every host's first hosted step to this epoch's resume step (kept in the state)."""
        step = self.ledger.resume_step
        for node_id in {n for hosts in self.roster.owners() for n in hosts}:
            if self.first_hosted.get(node_id, step + 1) > step:
                self.first_hosted[node_id] = step
                self.ledger.state.set_first_hosted(node_id, step)

    def heard(self, node: NodeRecord, request: coordinator_pb2.HeartbeatRequest) -> None:
        """Note a heartbeat. Its capacity and averaging address matter to replicas: standbys that can
        average may now become replicas; a replica whose address changed (it restarted its P2P, or
        this coordinator restarted) needs a plan that carries the new one."""
        self.roster.heard(node, request)
        if self.config.train.replicas <= 1:
            return
        moved = self.roster.averages_at(node.id, request.averaging_address[:1024])
        owners = self.roster.owners()
        if moved and any(len(owners[s]) > 1 for s in node.stages):
            self.new_epoch(f"node {node.id[:8]} averages at a new address")
        elif self.roster.standby_can_average():
            self.replan(owners)

    def plan_for(self, node: NodeRecord) -> coordinator_pb2.Plan:
        """``node``'s plan this epoch: its stages, links, snapshots to restore and every stage's replicas."""
        return coordinator_pb2.Plan(
            epoch=self.ledger.plan_epoch,
            stages=node.stages,
            links=self._links(node.id),
            resume_step=self.ledger.resume_step,
            restore=self.ledger.restore(node.stages),
            rebuild=self.ledger.rebuilding(node.stages),
            replicas=self._replicas(),
            upload_snapshots=self.ledger.keepers.uploads(node),
            evidence_secret=self.ledger.evidence_secret(),
            rotation_lineage=self.progress.rotation.lineage,
        )

    def neighbours(self, node_id: str, other_id: str) -> bool:
        """Whether the current plan joins the two nodes across a boundary, or as replicas of a
        stage (which average with each other)."""
        shared = any(other_id in hosts and node_id in hosts for hosts in self.roster.owners())
        return shared or any(link.peer_node_id == other_id for link in self._links(node_id))

    def _deal(self) -> None:
        owners = self.roster.owners()
        self.ledger.deal(owners, self.roster.rates(owners))

    def _problems(self, owners: Owners) -> list[str]:
        """What keeps ``owners`` from connecting: links no end of which accepts, free stages that
        only dial-only standbys could take."""
        reach, nodes = self.roster.reach(), self.roster.nodes

        def who(node_id: str) -> str:
            name = nodes[node_id].name
            return f"{name} ({node_id[:8]})" if name else node_id[:8]

        if self.relays.alive:
            return []  # what no direct link can serve, a relayed one does (relayed_links)
        missing = "no relay answers" if self.relays.relays else "no relay: give the coordinator --relay-port"
        problems = [
            f"boundary {b}: {who(up)} and {who(down)} "
            + (
                "failed to connect in two consecutive epochs"
                if frozenset((up, down)) in reach.broken
                else "are both dial-only"
            )
            + f" and no placement avoids them: this link cannot open ({missing})"
            for b, up, down in unconnectable(owners, reach)
        ]
        standbys = [who(n) for n, _ in self.roster.standbys()]
        free = [str(s) for s, hosts in enumerate(owners) if not hosts]
        if standbys and free:
            problems.append(
                f"free stages {', '.join(free)}: no standby fits, {', '.join(standbys)} cannot link to "
                "their neighbours (dial-only next to dial-only); a node with an open port is needed"
            )
        return problems

    def relayed_links(self) -> list[str]:
        """The planned links that run through a relay, one line each (shown by ``Status``)."""
        nodes, reach = self.roster.nodes, self.roster.reach()
        return [
            f"boundary {b}: {nodes[up].name or up[:8]} -> {nodes[down].name or down[:8]} "
            f"through relay {relay}"
            for b, up, down in unconnectable(self.roster.owners(), reach)
            if (relay := self.relays.choose(up, down))
        ]

    def _show_problems(self, problems: list[str]) -> None:
        """Log what changed in the plan's problems."""
        for problem in problems:
            if problem not in self.problems:
                log.warning("plan problem: %s", problem)
        if self.problems and not problems:
            log.info("every planned link can connect again")
        self.problems = problems

    def _add_replicas(self, owners: list[tuple[str, ...]], reach: Reach) -> list[tuple[str, ...]]:
        """Standbys that can average (a P2P address) join the stages of least measured capacity,
        once every host has measured its own (placing blindly could feed a stage that is not the
        bottleneck); a stage whose hosts cannot all average takes none."""
        capacity, averaging = self.roster.capacity, self.roster.averaging
        hosting = {n for hosts in owners for n in hosts}
        if any(capacity.get(n, 0.0) <= 0 for n in hosting):
            return owners
        waiting = [
            n.id
            for n in self.roster.nodes.values()
            if n.alive and n.id not in hosting and averaging.get(n.id)
        ]
        closed = [s for s, hosts in enumerate(owners) if not all(averaging.get(n) for n in hosts)]
        measured = {n: capacity.get(n, 0.0) for hosts in owners for n in hosts}
        return add_replicas(owners, waiting, measured, self.config.train.replicas, closed, reach)

    def _links(self, node_id: str) -> list[coordinator_pb2.BoundaryLink]:
        """``node_id``'s dial plan, each boundary with its secret for this epoch (``link_secret``)."""
        reach = self.roster.reach()

        def relay_of(up: str, down: str) -> str:
            return "" if reach.connectable(up, down) else self.relays.choose(up, down)

        links = links_for(node_id, self.roster.owners(), self.roster.addresses(), relay_of)
        for link in links:
            if link.peer_node_id:
                link.link_secret = self.ledger.link_secret(link.boundary, *link_ends(node_id, link))
                link.peer_certificate = self.roster.certificate_of.get(link.peer_node_id, "")
        return links

    def _replicas(self) -> list[coordinator_pb2.StageReplicas]:
        """Every stage's replicas with their microbatches (as dealt at the epoch's start) and announce
        addresses (empty for a replica that only dials)."""
        stages, addresses = [], self.roster.addresses()
        for s, hosts in enumerate(self.roster.owners()):
            replicas = [
                coordinator_pb2.StageReplica(
                    node_id=n,
                    microbatches=self.ledger.microbatches(s, n),
                    averaging_address=self.roster.averaging.get(n, "") if len(hosts) > 1 else "",
                    address=addresses.get(n, ""),
                )
                for n in hosts
            ]
            stages.append(coordinator_pb2.StageReplicas(stage=s, replicas=replicas))
        return stages
