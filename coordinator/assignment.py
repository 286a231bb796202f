"""Stage assignment and the dial plan: pure functions of who hosts which stage.

``owners[s]`` lists the nodes hosting pipeline stage ``s`` (its replicas, in the order they
took it; the first is the lead), empty while the stage is unassigned.

Assignment. A node takes the lowest-indexed run of *unassigned* stages, contiguous, at
most ``max_stages`` long, that keeps every link it makes connectable (below). A node that
finds no such run is a standby; when stages are released (a node leaves or is declared
dead) the standbys, in join order, take them by the same rule. When the run allows several
replicas per stage, a standby instead joins the stage with the least capacity (the sum of
its replicas' measured tokens per second of busy time: the pipeline's bottleneck, as Petals
chooses blocks) among those it can connect to, one stage per replica.

Reachability (:class:`Reach`). A link can open when at least one of its two nodes accepts
inbound streams (the coordinator reached its announced address at Join) and the pair was
not seen failing to connect in two consecutive epochs. A dial-only node therefore takes
stages only next to nodes that accept, or next to free stages (which then only a node that
accepts can take). When a free stage is left and a standby fits nowhere, a host swaps with
it: the standby takes over that host's stages and the host moves to the free ones, if both
fit. :func:`place` also routes around links of the current owners that cannot connect,
releasing one end and placing again, as long as no stage is left free by it; what is still
unconnectable afterwards :func:`unconnectable` lists (the coordinator logs it and ``Status``
shows it; with a relay such a link runs through it).

Dial plan. For each boundary ``b`` (stages ``b`` and ``b + 1``) and each pair of an
upstream and a downstream replica on two different nodes, exactly one side opens the
``Stage.Exchange`` stream:

* if the downstream node (hosting ``b + 1``) has an announce address, the upstream node
  DIALs it and the downstream node ACCEPTs;
* else, if the upstream node has one, the downstream node DIALs it and the upstream
  node ACCEPTs;
* else neither can reach the other: if ``relay_of(up, down)`` names a relay both dial it, the
  upstream node as the DIAL end and the downstream one as the ACCEPT end (``relay_address``);
  without one both get ``LINK_ROLE_UNSPECIFIED`` and the link cannot open.

A pair that is reachable but was seen failing (:class:`Reach`) is relayed the same way when
``relay_of`` names a relay for it.

The fallback is what lets a node with no open inbound port (empty announce address)
host a stage: it dials both of its neighbours, as long as they are reachable. A
boundary between two stages of one node has no link (it stays in-process). While the
stage across a boundary is unassigned the link is listed with an empty ``peer_node_id``
and role UNSPECIFIED; it fills in once some node hosts that stage.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from functools import partial

from swarm._proto.swarm.v1 import coordinator_pb2
from swarm.runtime.replicas import unmeasured_rate

Owners = Sequence[Sequence[str]]


@dataclass(frozen=True)
class Reach:
    """Who can open a stream to whom: every node accepts inbound streams but those ``dial_only``,
    and no pair in ``broken`` (their planned link failed to connect in two consecutive epochs)."""

    dial_only: frozenset[str] = frozenset()
    broken: frozenset[frozenset[str]] = frozenset()

    def connectable(self, a: str, b: str) -> bool:
        """Whether a link between nodes ``a`` and ``b`` can open (a node links to itself in-process)."""
        if a == b:
            return True
        return (a not in self.dial_only or b not in self.dial_only) and frozenset((a, b)) not in self.broken


EVERYONE = Reach()  # every node accepts: the plain rules


def fits(owners: Owners, node_id: str, run: Sequence[int], reach: Reach) -> bool:
    """Whether ``node_id`` hosting the contiguous stages ``run`` could link to every host across
    the run's two ends (a free stage across an end is no link yet)."""
    ends = [s for s in (run[0] - 1, run[-1] + 1) if 0 <= s < len(owners)]
    return all(reach.connectable(node_id, other) for s in ends for other in owners[s])


def take_stages(
    owners: Owners, max_stages: int, fit: Callable[[list[int]], bool] = lambda run: True
) -> list[int]:
    """The lowest-indexed contiguous run of unassigned stages that ``fit`` accepts, the longest such
    (at most ``max(1, max_stages)`` stages) from its first stage; [] when there is none."""
    for start, hosts in enumerate(owners):
        if hosts:
            continue
        run = [start]
        while len(run) < max(1, max_stages) and run[-1] + 1 < len(owners) and not owners[run[-1] + 1]:
            run.append(run[-1] + 1)
        while run and not fit(run):
            run.pop()
        if run:
            return run
    return []


def assign(
    owners: Owners, candidates: Sequence[tuple[str, int]], reach: Reach = EVERYONE
) -> list[tuple[str, ...]]:
    """New owners after each ``(node_id, max_stages)`` candidate, in order, takes free stages it fits
    (:func:`take_stages`); then, while a stage is free, each candidate that fitted nowhere swaps
    with a host (:func:`_swap_in`)."""
    result = [tuple(hosts) for hosts in owners]

    def take(node_id: str, max_stages: int) -> bool:
        run = take_stages(result, max_stages, partial(fits, result, node_id, reach=reach))
        for s in run:
            result[s] = (node_id,)
        return bool(run)

    waiting = [(node_id, max_stages) for node_id, max_stages in candidates if not take(node_id, max_stages)]
    hopeless: set[tuple[bool, int]] = set()  # kinds of node no swap helped (all alike but for broken pairs)
    for node_id, max_stages in waiting:
        kind = (node_id in reach.dial_only, max_stages)
        if all(result) or (kind in hopeless and not reach.broken) or take(node_id, max_stages):
            continue
        swapped = _swap_in(result, node_id, max_stages, reach)
        if swapped is None:
            hopeless.add(kind)
        else:
            result[:] = swapped
    return result


def _swap_in(
    owners: list[tuple[str, ...]], node_id: str, max_stages: int, reach: Reach
) -> list[tuple[str, ...]] | None:
    """Owners where ``node_id`` took over the stages of a host (the first, by stage, for which this
    works) and that host moved to free stages, both fitting; None if no host can swap."""
    for host in dict.fromkeys(hosts[0] for hosts in owners if len(hosts) == 1):
        run = stages_of(owners, host)
        if len(run) > max(1, max_stages) or any(len(owners[s]) > 1 for s in run):
            continue  # too many stages for node_id, or a replica (they average with the others)
        swapped = [(node_id,) if s in run else hosts for s, hosts in enumerate(owners)]
        if not fits(swapped, node_id, run, reach):
            continue
        moved = take_stages(swapped, len(run), partial(fits, swapped, host, reach=reach))
        if moved:
            return [(host,) if s in moved else hosts for s, hosts in enumerate(swapped)]
    return None


def unconnectable(owners: Owners, reach: Reach) -> list[tuple[int, str, str]]:
    """The planned links that cannot open: ``(boundary, upstream node, downstream node)``."""
    return [
        (b, up, down)
        for b in range(len(owners) - 1)
        for up in owners[b]
        for down in owners[b + 1]
        if not reach.connectable(up, down)
    ]


def place(owners: Owners, nodes: Sequence[tuple[str, int]], reach: Reach = EVERYONE) -> list[tuple[str, ...]]:
    """New owners for the alive ``nodes`` ``(node_id, max_stages)``, in join order: those hosting
    nothing are assigned (:func:`assign`); then every link that cannot open is routed around where
    releasing one of its ends (the downstream one first) and placing it again after the standbys
    gives fewer such links without freeing a hosted stage (:func:`_route_around`); if stages are
    still free while standbys wait, or links still cannot open, a complete placement of everyone
    that keeps current hosts where it can (:func:`_arrange`) is taken when one is found."""
    standbys = [(n, m) for n, m in nodes if not stages_of(owners, n)]
    result = assign(owners, standbys, reach)
    while True:
        bad = unconnectable(result, reach)
        rerouted = (_route_around(result, standbys, link, reach) for link in bad)
        better = next((owners for owners in rerouted if owners is not None), None)
        if better is None:
            break
        result = better
    waiting = any(not stages_of(result, n) for n, _ in nodes)
    stuck = (waiting and not all(result)) or unconnectable(result, reach)
    if stuck and all(len(h) <= 1 for h in result) and _most_stages(nodes, reach) >= len(owners):
        result = _arrange(result, nodes, reach) or result
    return result


def _most_stages(nodes: Sequence[tuple[str, int]], reach: Reach) -> int:
    """The most stages ``nodes`` could host in a chain where no two dial-only nodes are neighbours:
    every open node's, and as many dial-only runs as fit between and around them (exact when no
    pair is broken, an upper bound otherwise)."""
    opened = [max(1, m) for n, m in nodes if n not in reach.dial_only]
    dial_only = sorted((max(1, m) for n, m in nodes if n in reach.dial_only), reverse=True)
    return sum(opened) + sum(dial_only[: len(opened) + 1])


def _arrange(
    owners: list[tuple[str, ...]], nodes: Sequence[tuple[str, int]], reach: Reach, budget: int = 2000
) -> list[tuple[str, ...]] | None:
    """Every stage hosted by one of ``nodes`` ``(node_id, max_stages)``, each a contiguous run, with
    every link connectable: a depth-first search over the stages in order that tries first the node
    hosting a stage in ``owners`` (then the others in join order) and gives up after ``budget``
    steps; None if it found none."""
    most = dict(nodes)
    chosen: list[str] = []
    used: set[str] = set()
    steps = 0

    def extend(s: int) -> bool:
        nonlocal steps
        steps += 1
        if s == len(owners):
            return True
        if steps > budget:
            return False
        prev = chosen[-1] if chosen else None
        current = owners[s][0] if owners[s] else None
        for node in sorted(most, key=lambda n: n != current):
            if node in used or (prev is not None and not reach.connectable(prev, node)):
                continue
            kept = len(stages_of(owners, node)) if node == current else 0
            for length in dict.fromkeys([kept, *range(min(most[node], len(owners) - s), 0, -1)]):
                if length and s + length <= len(owners):
                    chosen.extend([node] * length)
                    used.add(node)
                    if extend(s + length):
                        return True
                    del chosen[-length:]
                    used.discard(node)
        return False

    return [(node,) for node in chosen] if extend(0) else None


def _route_around(
    owners: list[tuple[str, ...]],
    standbys: Sequence[tuple[str, int]],
    link: tuple[int, str, str],
    reach: Reach,
) -> list[tuple[str, ...]] | None:
    """Owners where ``link`` (boundary, up, down) is gone, and fewer links cannot open, with every
    stage still hosted; None if releasing neither end and placing again gives that."""
    waiting = [(n, m) for n, m in standbys if not stages_of(owners, n)]
    before = len(unconnectable(owners, reach))
    for end in (link[2], link[1]):
        released = [tuple(h for h in hosts if h != end) for hosts in owners]
        again = assign(released, [*waiting, (end, len(stages_of(owners, end)))], reach)
        still_hosted = all(again[s] for s, hosts in enumerate(owners) if hosts)
        if still_hosted and len(unconnectable(again, reach)) < before:
            return again
    return None


def add_replicas(
    owners: Owners,
    candidates: Sequence[str],
    capacity: Mapping[str, float],
    most: int,
    closed: Collection[int] = (),
    reach: Reach = EVERYONE,
) -> list[tuple[str, ...]]:
    """New owners after each candidate, in order, joins the stage of least capacity among those
    with fewer than ``most`` replicas, not ``closed`` and whose neighbouring stages' hosts it can
    link to (ties: fewer replicas, then the lower index).

    A stage's capacity is the sum of its replicas' ``capacity`` (tokens/s of busy time); a node
    not measured yet counts as the mean of those measured (1.0 when none is).
    """
    result = [tuple(hosts) for hosts in owners]
    default = unmeasured_rate(capacity.values())

    def stage_capacity(s: int) -> tuple[float, int, int]:
        hosts = result[s]
        return sum(capacity.get(n, 0.0) or default for n in hosts), len(hosts), s

    for node_id in candidates:
        open_stages = [
            s
            for s, hosts in enumerate(result)
            if 0 < len(hosts) < most and s not in closed and fits(result, node_id, [s], reach)
        ]
        if not open_stages:
            continue
        s = min(open_stages, key=stage_capacity)
        result[s] = (*result[s], node_id)
    return result


def stages_of(owners: Owners, node_id: str) -> list[int]:
    """The stages ``node_id`` hosts, ascending."""
    return [s for s, hosts in enumerate(owners) if node_id in hosts]


def link_ends(node_id: str, link: coordinator_pb2.BoundaryLink) -> tuple[str, str]:
    """The (upstream, downstream) nodes of ``link`` in ``node_id``'s dial plan."""
    if link.local_stage == link.boundary:
        return node_id, link.peer_node_id
    return link.peer_node_id, node_id


def links_for(
    node_id: str,
    owners: Owners,
    addresses: Mapping[str, str],
    relay_of: Callable[[str, str], str] = lambda up, down: "",
) -> list[coordinator_pb2.BoundaryLink]:
    """The dial plan of ``node_id``: one link per boundary and other (or no) node across it.

    ``addresses`` maps node ids to the addresses they accept streams at (absent or empty: the
    node only dials); ``relay_of(up, down)`` the relay a pair's link runs through ("" for none).
    """
    links = []
    for b in range(len(owners) - 1):
        ups, downs = owners[b] or ("",), owners[b + 1] or ("",)
        for up in ups:
            for down in downs:
                if node_id not in (up, down) or up == down:
                    continue
                local, peer = (b, down) if node_id == up else (b + 1, up)
                link = coordinator_pb2.BoundaryLink(boundary=b, local_stage=local, peer_node_id=peer)
                relay = relay_of(up, down) if up and down else ""
                if relay:
                    link.relay_address = relay
                    link.role = (
                        coordinator_pb2.LINK_ROLE_DIAL if node_id == up else coordinator_pb2.LINK_ROLE_ACCEPT
                    )
                elif up and down:
                    dialer, listener = (up, down) if addresses.get(down) else (down, up)
                    if addresses.get(listener) and node_id == dialer:
                        link.role, link.peer_address = coordinator_pb2.LINK_ROLE_DIAL, addresses[listener]
                    elif addresses.get(listener):
                        link.role = coordinator_pb2.LINK_ROLE_ACCEPT
                links.append(link)
    return links
