"""Stage assignment and the dial plan: pure functions of who hosts which stage.

``owners[s]`` lists the nodes hosting pipeline stage ``s`` (its replicas, in the order they
took it; the first is the lead), empty while the stage is unassigned.

Assignment. A node takes the lowest-indexed run of *unassigned* stages, contiguous, at
most ``max_stages`` long. A node that finds every stage taken is a standby; when stages
are released (a node leaves or is declared dead) the standbys, in join order, take them
by the same rule. When the run allows several replicas per stage, a standby instead joins
the stage with the least capacity (the sum of its replicas' measured tokens per second of
busy time: the pipeline's bottleneck, as Petals chooses blocks), one stage per replica.

Dial plan. For each boundary ``b`` (stages ``b`` and ``b + 1``) and each pair of an
upstream and a downstream replica on two different nodes, exactly one side opens the
``Stage.Exchange`` stream:

* if the downstream node (hosting ``b + 1``) has an announce address, the upstream node
  DIALs it and the downstream node ACCEPTs;
* else, if the upstream node has one, the downstream node DIALs it and the upstream
  node ACCEPTs;
* else neither can reach the other and both get ``LINK_ROLE_UNSPECIFIED``: such a
  boundary would need a relay, which is not implemented.

The fallback is what lets a node with no open inbound port (empty announce address)
host a stage: it dials both of its neighbours, as long as they are reachable. A
boundary between two stages of one node has no link (it stays in-process). While the
stage across a boundary is unassigned the link is listed with an empty ``peer_node_id``
and role UNSPECIFIED; it fills in once some node hosts that stage.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from swarm._proto.swarm.v1 import coordinator_pb2
from swarm.runtime.replicas import unmeasured_rate

Owners = Sequence[Sequence[str]]


def take_stages(owners: Owners, max_stages: int) -> list[int]:
    """The lowest-indexed contiguous run of unassigned stages, at most ``max(1, max_stages)`` long."""
    free = [s for s, hosts in enumerate(owners) if not hosts]
    if not free:
        return []
    run = [free[0]]
    while len(run) < max(1, max_stages) and run[-1] + 1 < len(owners) and not owners[run[-1] + 1]:
        run.append(run[-1] + 1)
    return run


def assign(owners: Owners, candidates: Sequence[tuple[str, int]]) -> list[tuple[str, ...]]:
    """New owners after each ``(node_id, max_stages)`` candidate, in order, takes free stages."""
    result = [tuple(hosts) for hosts in owners]
    for node_id, max_stages in candidates:
        for s in take_stages(result, max_stages):
            result[s] = (node_id,)
    return result


def add_replicas(
    owners: Owners,
    candidates: Sequence[str],
    capacity: Mapping[str, float],
    most: int,
    closed: Collection[int] = (),
) -> list[tuple[str, ...]]:
    """New owners after each candidate, in order, joins the stage of least capacity among those
    with fewer than ``most`` replicas and not ``closed`` (ties: fewer replicas, then the lower index).

    A stage's capacity is the sum of its replicas' ``capacity`` (tokens/s of busy time); a node
    not measured yet counts as the mean of those measured (1.0 when none is).
    """
    result = [tuple(hosts) for hosts in owners]
    default = unmeasured_rate(capacity.values())

    def stage_capacity(s: int) -> tuple[float, int, int]:
        hosts = result[s]
        return sum(capacity.get(n, 0.0) or default for n in hosts), len(hosts), s

    for node_id in candidates:
        open_stages = [s for s, hosts in enumerate(result) if 0 < len(hosts) < most and s not in closed]
        if not open_stages:
            break
        s = min(open_stages, key=stage_capacity)
        result[s] = (*result[s], node_id)
    return result


def stages_of(owners: Owners, node_id: str) -> list[int]:
    """The stages ``node_id`` hosts, ascending."""
    return [s for s, hosts in enumerate(owners) if node_id in hosts]


def links_for(
    node_id: str, owners: Owners, addresses: Mapping[str, str]
) -> list[coordinator_pb2.BoundaryLink]:
    """The dial plan of ``node_id``: one link per boundary and other (or no) node across it.

    ``addresses`` maps node ids to announce addresses (empty: the node only dials).
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
                if up and down:
                    dialer, listener = (up, down) if addresses.get(down) else (down, up)
                    if addresses.get(listener) and node_id == dialer:
                        link.role, link.peer_address = coordinator_pb2.LINK_ROLE_DIAL, addresses[listener]
                    elif addresses.get(listener):
                        link.role = coordinator_pb2.LINK_ROLE_ACCEPT
                links.append(link)
    return links
