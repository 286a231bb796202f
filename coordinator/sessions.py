"""Per-node session credentials: what proves, on every call after Join, which node is calling.

A node's credential is ``HMAC-SHA256(key, node_id)`` with a key only the coordinator holds
(a 0600 file next to its state, :func:`kept_secret`, so a restarted coordinator accepts the
credentials it issued). Nodes send it as gRPC metadata (:mod:`swarm.transport.session`); the coordinator
checks it in constant time. Node ids are not secrets: ``Status`` may show them.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Callable, Iterable
from pathlib import Path

from swarm.transport.session import NODE_KEY, SESSION_KEY


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


class Sessions:
    """Issues and checks credentials with the key at ``key_path`` (created on first use)."""

    def __init__(self, key_path: str | Path):
        path = Path(key_path)
        text = kept_secret(path, lambda: secrets.token_hex(32))
        try:
            self._key = bytes.fromhex(text)
        except ValueError:
            self._key = b""
        if len(self._key) < 32:
            raise ValueError(f"session key file {path} is damaged ({len(self._key)} bytes)")

    def issue(self, node_id: str) -> str:
        return hmac.new(self._key, node_id.encode(), hashlib.sha256).hexdigest()

    def caller(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
        """The node id the call's metadata proves, or None."""
        fields = dict(metadata or ())
        node_id, session = fields.get(NODE_KEY), fields.get(SESSION_KEY)
        if not isinstance(node_id, str) or not isinstance(session, str):
            return None
        return node_id if hmac.compare_digest(self.issue(node_id), session) else None
