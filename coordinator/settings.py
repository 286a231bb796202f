"""The coordinator's tunables and their defaults, in one place.

The command lines that start a coordinator (``swarm-coordinator serve``, ``swarm up``) read their
defaults from :class:`CoordinatorSettings`, so a default is written once.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CoordinatorSettings:
    """How one coordinator judges liveness, credentials and uploads.

    ``dead_after_s``: silence before a node is declared dead (short reassigns a dead node's stages
    sooner, but declares a node on a congested link dead); ``heartbeat_interval_ms``: how often nodes
    are told to heartbeat; ``session_ttl_s``: lifetime of a session credential (heartbeats renew it
    at half); ``resume_grace_s``: a restarted coordinator gives the nodes that were alive at least this
    long to heartbeat again; ``probe_timeout_s``: a node that does not answer a Ping this fast after a
    failure report is dead; ``reach_timeout_s``: how long the Ping that checks a joining node's
    announced address may take (unanswered: the node is placed as dial-only; 0: no check, every
    announced address is taken on trust); ``max_snapshot_bytes``: the largest stage snapshot accepted;
    ``export_wait_s``: how long a stopping coordinator waits for the final model to be written;
    ``relays``: relays (``HOST:PORT`` of ``swarm-coordinator relay`` processes) that links neither of
    whose ends accepts run through; ``snapshot_keepers``: how many nodes besides its host keep each
    stage snapshot (fetched from its holders; the coordinator keeps the manifest only), 0: snapshots
    are uploaded to the coordinator.
    """

    dead_after_s: float = 15.0
    heartbeat_interval_ms: int = 1000
    session_ttl_s: float = 3600.0
    resume_grace_s: float = 10.0
    probe_timeout_s: float = 2.0
    reach_timeout_s: float = 4.0
    max_snapshot_bytes: int = 16 << 30
    export_wait_s: float = 120.0
    relays: tuple[str, ...] = ()
    snapshot_keepers: int = 1
