"""Join tokens the operator creates, lists and revokes (``swarm-coordinator token ...``).

Tokens live in the run's state file as SHA-256 digests only: a created token is 256 random
bits, for which a plain digest is as strong as a slow hash (one the operator chooses, through
``SWARM_TOKEN`` or ``--token-file``, should be as random: it is refused below 16 characters,
not checked for entropy). A token's id is the head of its digest, enough to
name it in ``list`` and ``revoke`` and in session credentials. A revoked token stays in the
table, so neither ``--token-file`` nor ``$SWARM_TOKEN`` can bring it back, and the
coordinator refuses at once every session credential issued under it (the CLI writes the same
SQLite file the coordinator reads). A token whose node was evicted for computing wrong (audits) is
banned: it stays valid for its party's other nodes, but no new Join with it is admitted.
"""

from __future__ import annotations

import hashlib
import secrets
import sqlite3
import time
from dataclasses import dataclass

SCHEMA = """
CREATE TABLE IF NOT EXISTS join_tokens (
    id TEXT PRIMARY KEY, digest TEXT NOT NULL UNIQUE, label TEXT NOT NULL, created REAL NOT NULL,
    revoked REAL
);
CREATE TABLE IF NOT EXISTS banned_tokens (id TEXT PRIMARY KEY, reason TEXT NOT NULL, at REAL NOT NULL);
"""
ID_CHARS = 12
PREFIX = "swt_"


@dataclass(frozen=True)
class TokenRecord:
    id: str
    label: str
    created: float
    revoked: float | None = None


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def token_id(token: str) -> str:
    """What names ``token`` in listings and in the session credentials issued under it."""
    return token_digest(token)[:ID_CHARS]


class JoinTokens:
    """The join tokens of the run whose state is ``db``."""

    def __init__(self, db: sqlite3.Connection):
        self.db = db
        self.db.executescript(SCHEMA)

    def create(self, label: str) -> tuple[str, TokenRecord]:
        """A new random token (shown once, to the caller) and its record."""
        token = PREFIX + secrets.token_urlsafe(32)
        return token, self.add(token, label)

    def add(self, token: str, label: str) -> TokenRecord:
        """Record ``token`` (from the operator's file or environment) unless it is known already;
        a known token keeps its record, revoked or not."""
        if len(token) < 16:
            raise ValueError("a join token must be at least 16 characters")
        digest = token_digest(token)
        self.db.execute(
            "INSERT OR IGNORE INTO join_tokens VALUES (?, ?, ?, ?, NULL)",
            (token_id(token), digest, label, time.time()),
        )
        return self._record("digest = ?", digest)

    def check(self, token: str) -> TokenRecord | None:
        """The record of ``token`` if it is valid (known, not revoked), else None."""
        record = self._record("digest = ?", token_digest(token))
        return record if record is not None and record.revoked is None else None

    def revoked(self, token_id: str) -> bool:
        """Whether ``token_id`` is unknown or revoked."""
        record = self._record("id = ?", token_id)
        return record is None or record.revoked is not None

    def revoke(self, id_prefix: str) -> TokenRecord:
        """Revoke the one token whose id starts with ``id_prefix`` (ValueError if none or several)."""
        matches = [r for r in self.list() if r.id.startswith(id_prefix)] if id_prefix else []
        if len(matches) != 1:
            raise ValueError(f"{len(matches)} tokens have an id starting with {id_prefix!r}")
        self.db.execute(
            "UPDATE join_tokens SET revoked = ? WHERE id = ? AND revoked IS NULL",
            (time.time(), matches[0].id),
        )
        return self._record("id = ?", matches[0].id)

    def ban(self, token_id: str, reason: str) -> None:
        """Refuse every later Join with the token ``token_id`` (its node was evicted for ``reason``);
        the first reason stays."""
        row = (token_id, reason, time.time())
        self.db.execute("INSERT OR IGNORE INTO banned_tokens VALUES (?, ?, ?)", row)

    def banned(self, token_id: str) -> str | None:
        """Why ``token_id`` may not join again, or None when it may."""
        row = self.db.execute("SELECT reason FROM banned_tokens WHERE id = ?", (token_id,)).fetchone()
        return row[0] if row is not None else None

    def list(self) -> list[TokenRecord]:
        rows = self.db.execute(
            "SELECT id, label, created, revoked FROM join_tokens ORDER BY created"
        ).fetchall()
        return [TokenRecord(*row) for row in rows]

    def _record(self, where: str, value: str) -> TokenRecord | None:
        row = self.db.execute(f"SELECT id, label, created, revoked FROM join_tokens WHERE {where}", (value,))
        found = row.fetchone()
        return TokenRecord(*found) if found is not None else None
