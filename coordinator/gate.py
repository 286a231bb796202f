"""Who may call: join tokens at ``Join``, session credentials after it, and the refusal of the rest.

Calls after ``Join`` carry the node's session credential (:mod:`swarm.coordinator.sessions`): a call
naming a node id without its credential is refused, and only credentialed nodes may follow
rotations or fetch artifacts (snapshots are model weights). A genuine credential under a revoked
join token evicts its node. Reports must come from an alive node following the current epoch
(and, for a stage's reports, hosting that stage). A refusal is counted under its label in
``swarm_rejected_messages`` and aborts the call with the status code the label maps to. A node's
own join token is banned when its node is evicted for computing wrong (audits): no later Join with it.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import grpc
from swarm.coordinator.errors import Rejected
from swarm.coordinator.ledger import Ledger
from swarm.coordinator.roster import Roster
from swarm.coordinator.sessions import Session, SessionRefused, Sessions, kept_secret
from swarm.coordinator.state import NodeRecord
from swarm.coordinator.tokens import JoinTokens, TokenRecord

from swarm._proto.swarm.v1 import coordinator_pb2
from swarm.net.frames import PROTOCOL_VERSION
from swarm.net.tls import Security
from swarm.ops.metrics import Metrics

log = logging.getLogger("swarm.coordinator")

SHARED_TOKEN_LABEL = "operator"  # the label of the token given to `serve` (shared by many nodes)
# Rejection label -> gRPC status: a fenced node must stop, a stale epoch only drops the call.
REJECTION_STATUS = {
    "auth": grpc.StatusCode.UNAUTHENTICATED,
    "unknown_node": grpc.StatusCode.PERMISSION_DENIED,
    "stale_epoch": grpc.StatusCode.ABORTED,
    "not_hosting": grpc.StatusCode.ABORTED,
}


def new_operator_token() -> str:
    """A fresh shared join token: hex, so it never starts with ``-`` (``--token -x...`` would be
    read as a flag; one urlsafe token in 64 did)."""
    return secrets.token_hex(32)


def admit_operator_token(tokens: JoinTokens, token: str | None, state_file: Path) -> None:
    """Record the operator's ``token``; with none and no valid token in the state, one kept in
    ``STATE.token`` (mode 0600, created once)."""
    if token is None and any(t.revoked is None for t in tokens.list()):
        return
    if token is None:
        path = state_file.with_name(state_file.name + ".token")
        token = kept_secret(path, new_operator_token)
        log.warning("no join token given: nodes join with the one in %s (mode 0600)", path)
    if tokens.add(token, SHARED_TOKEN_LABEL).revoked is not None:
        log.warning(
            "the join token given is revoked: no node can join until `swarm-coordinator token create`"
        )


class Gate:
    """Checks calls against ``tokens`` and ``sessions``, the ``roster`` and the ``ledger``'s epoch;
    ``evict`` takes a node out of the run (its join token was revoked)."""

    def __init__(
        self,
        tokens: JoinTokens,
        sessions: Sessions,
        roster: Roster,
        ledger: Ledger,
        metrics: Metrics,
        security: Security,
        evict: Callable[[NodeRecord], None],
    ):
        self.tokens, self.sessions, self.roster, self.ledger = tokens, sessions, roster, ledger
        self.metrics, self.security, self.evict = metrics, security, evict

    async def admit(
        self, request: coordinator_pb2.JoinRequest, context: grpc.aio.ServicerContext
    ) -> TokenRecord:
        """The join token a ``Join`` presents; the call is aborted for another protocol or a token
        unknown or revoked."""
        if request.protocol_version != PROTOCOL_VERSION:
            await self.reject(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                "protocol_version",
                f"protocol version {request.protocol_version}, coordinator speaks {PROTOCOL_VERSION}",
            )
        admitted = self.tokens.check(request.token)
        if admitted is None:
            await self.reject(
                context, grpc.StatusCode.UNAUTHENTICATED, "auth", "unknown or revoked join token"
            )
        banned = self.tokens.banned(admitted.id)
        if banned is not None:
            await self.reject(
                context,
                grpc.StatusCode.PERMISSION_DENIED,
                "banned",
                f"a node that joined with this token was evicted ({banned}): the token may not join again",
            )
        return admitted

    def ban(self, node_id: str, reason: str) -> bool:
        """Refuse every later Join with ``node_id``'s own join token (its party), evicted for
        ``reason``; whether it had one (a node that joined with the operator's shared token is a
        party of its own: nothing tells it apart when it rejoins)."""
        party = self.roster.party_of(node_id)
        if party == node_id:
            log.warning(
                "node %s joined with the shared token: nothing keeps it from joining again "
                "(give volunteers their own: `swarm-coordinator token create`)",
                node_id[:8],
            )
            return False
        self.tokens.ban(party, reason)
        log.warning("join token %s is banned: %s", party, reason)
        return True

    def identity(
        self, node_id: str, admitted: TokenRecord, context: grpc.aio.ServicerContext
    ) -> tuple[str, str]:
        """A joining node's party in accusations (its join token when that is its own, else itself)
        and, under mutual TLS, the name its client certificate gives it (the plan pins its streams
        to it; else empty)."""
        party = admitted.id if admitted.label != SHARED_TOKEN_LABEL else node_id
        if not self.security.mutual:
            return party, ""
        names = context.auth_context().get("x509_common_name", [])
        return party, names[0].decode(errors="replace") if len(names) == 1 else ""

    def session(self, context: grpc.aio.ServicerContext) -> Session:
        """The session the call's credential proves, else :class:`Rejected`. A genuine credential
        under a revoked join token evicts its node (fenced and replaced like a dead one)."""
        try:
            return self.sessions.verify(context.invocation_metadata())
        except SessionRefused as e:
            node = self.roster.alive_node(e.node_id or "")
            if e.reason == "revoked" and node is not None:
                log.warning("node %s evicted: its join token was revoked", node.id[:8])
                self.metrics.evictions.labels(reason="revoked").inc()
                self.evict(node)
            raise Rejected("auth", f"no valid session credential ({e.reason})") from None

    def authenticated(self, node_id: str, context: grpc.aio.ServicerContext) -> Session:
        """``node_id``'s session, else :class:`Rejected` (also for another node's credential)."""
        session = self.session(context)
        if session.node_id != node_id:
            raise Rejected("auth", f"no valid session credential for node {node_id[:8]!r}")
        return session

    async def require_session(self, node_id: str, context: grpc.aio.ServicerContext) -> Session:
        """``node_id``'s session; otherwise the call is aborted (UNAUTHENTICATED, counted)."""
        try:
            return self.authenticated(node_id, context)
        except Rejected as e:
            await self.refuse(context, e)

    async def require_any_session(self, context: grpc.aio.ServicerContext) -> str:
        """The calling node's id; the call is aborted unless it carries the credential of a node
        alive in the run (an evicted or dead node's credential opens nothing)."""
        try:
            node_id = self.session(context).node_id
            if self.roster.alive_node(node_id) is not None:
                return node_id
        except Rejected:
            pass
        await self.refuse(context, Rejected("auth", "this call needs a live node's session credential"))

    def require_member(self, node_id: str, epoch: int, context: grpc.aio.ServicerContext) -> NodeRecord:
        """The alive, authenticated node ``node_id`` following the current epoch, else :class:`Rejected`."""
        self.authenticated(node_id, context)
        node = self.roster.alive_node(node_id)
        if node is None:
            raise Rejected("unknown_node", f"node {node_id!r} is not in the run (declared dead or replaced)")
        if epoch != self.ledger.plan_epoch:
            raise Rejected(
                "stale_epoch", f"plan epoch {epoch} is stale; the current epoch is {self.ledger.plan_epoch}"
            )
        return node

    def require_host(self, node_id: str, stage: int, epoch: int, context: grpc.aio.ServicerContext) -> None:
        """As :meth:`require_member`, and the node hosts ``stage``."""
        if stage not in self.require_member(node_id, epoch, context).stages:
            raise Rejected("not_hosting", f"node {node_id} does not host stage {stage}")

    async def refuse(self, context: grpc.aio.ServicerContext, e: Rejected) -> NoReturn:
        """Abort the call with the status code ``e``'s label maps to (counted)."""
        code = REJECTION_STATUS.get(e.label, grpc.StatusCode.INVALID_ARGUMENT)
        await self.reject(context, code, e.label, str(e))

    async def reject(
        self, context: grpc.aio.ServicerContext, code: grpc.StatusCode, label: str, msg: str
    ) -> NoReturn:
        """Count a rejected message under ``label`` and abort the call."""
        self.metrics.rejected.labels(reason=label).inc()
        await context.abort(code, msg)
