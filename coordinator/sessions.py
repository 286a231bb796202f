"""Per-node session credentials: what proves, on every call after Join, which node is calling.

A credential is ``TOKEN_ID.EXPIRES.MAC`` with ``MAC = HMAC-SHA256(key, node_id|TOKEN_ID|EXPIRES)``
under a key only the coordinator holds (a 0600 file next to its state, :func:`kept_secret`, so a
restarted coordinator accepts the credentials it issued). It names the join token the node was
admitted with, so revoking that token ends the node's session at once, and it expires
(``ttl_s``); heartbeats hand out a fresh one when less than half its lifetime is left. Nodes send
it as gRPC metadata (:mod:`swarm.net.credentials`); the coordinator checks it in constant time.
Node ids are not secrets: ``Status`` may show them.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from swarm.coordinator.settings import CoordinatorSettings

from swarm.net.credentials import NODE_KEY, SESSION_KEY

CREDENTIAL = re.compile(
    r"(?P<token>[0-9a-f]{12})\.(?P<expires>[1-9][0-9]{0,11})\.(?P<mac>[0-9a-f]{64})", re.ASCII
)


def kept_secret(path: Path, create: Callable[[], str]) -> str:
    """The secret kept in ``path`` (mode 0600), created with ``create()`` on first use: what a
    restarted coordinator must keep (its join token, its session key)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path.read_text().strip()
    secret = create()
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
    return secret


class SessionRefused(Exception):
    """A call's credential does not hold; ``reason``: missing, forged, expired or revoked.

    ``node_id`` is set when the credential itself is genuine (expired or revoked).
    """

    def __init__(self, reason: str, node_id: str | None = None):
        super().__init__(reason)
        self.reason, self.node_id = reason, node_id


@dataclass(frozen=True)
class Session:
    node_id: str
    token_id: str
    expires: float


class Sessions:
    """Issues and checks credentials with the key at ``key_path`` (created on first use);
    ``revoked(token_id)`` says whether a join token no longer admits anyone."""

    def __init__(
        self,
        key_path: str | Path,
        revoked: Callable[[str], bool],
        ttl_s: float = CoordinatorSettings.session_ttl_s,
        clock: Callable[[], float] = time.time,
    ):
        path = Path(key_path)
        text = kept_secret(path, lambda: secrets.token_hex(32))
        try:
            self._key = bytes.fromhex(text)
        except ValueError:
            self._key = b""
        if len(self._key) < 32:
            raise ValueError(f"session key file {path} is damaged ({len(self._key)} bytes)")
        self.revoked, self.ttl_s, self.clock = revoked, ttl_s, clock

    def _mac(self, node_id: str, token_id: str, expires: int) -> str:
        message = f"{node_id}|{token_id}|{expires}".encode()
        return hmac.new(self._key, message, hashlib.sha256).hexdigest()

    def issue(self, node_id: str, token_id: str) -> str:
        """A fresh credential for ``node_id``, admitted with the join token ``token_id``."""
        expires = int(self.clock() + self.ttl_s)
        return f"{token_id}.{expires}.{self._mac(node_id, token_id, expires)}"

    def verify(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> Session:
        """The session the call's metadata proves, or :class:`SessionRefused`."""
        fields = dict(metadata or ())
        node_id, credential = fields.get(NODE_KEY), fields.get(SESSION_KEY)
        if not isinstance(node_id, str) or not isinstance(credential, str):
            raise SessionRefused("missing")
        shape = CREDENTIAL.fullmatch(credential)
        if shape is None or not node_id.isascii():
            raise SessionRefused("forged")
        token_id, expires = shape["token"], int(shape["expires"])
        if not hmac.compare_digest(self._mac(node_id, token_id, expires).encode(), shape["mac"].encode()):
            raise SessionRefused("forged")
        if expires <= self.clock():
            raise SessionRefused("expired", node_id)
        if self.revoked(token_id):
            raise SessionRefused("revoked", node_id)
        return Session(node_id, token_id, expires)

    def renewal(self, session: Session) -> str | None:
        """A fresh credential when less than half of ``session``'s lifetime is left, else None."""
        if session.expires - self.clock() >= self.ttl_s / 2:
            return None
        return self.issue(session.node_id, session.token_id)
