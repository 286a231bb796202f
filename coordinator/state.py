"""The coordinator's durable state in SQLite: the run, its nodes, step reports and rotations.

Everything needed to resume after a restart lives here; the in-memory service is
rebuilt from it. Writes are small and infrequent (joins, one row per reported step,
one per rotation), so a single connection with WAL journaling is plenty.
"""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

from swarm.config import RunConfig, config_hash
from swarm.subspace import SubspaceRotation

SCHEMA = """
CREATE TABLE IF NOT EXISTS run (id TEXT PRIMARY KEY, config_json TEXT NOT NULL, config_hash TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS nodes (
    id TEXT PRIMARY KEY, name TEXT, address TEXT, stages TEXT NOT NULL, joined REAL, last_seen REAL,
    alive INTEGER NOT NULL DEFAULT 1
);
CREATE TABLE IF NOT EXISTS steps (
    step INTEGER NOT NULL, stage INTEGER NOT NULL, loss REAL, tokens INTEGER, bytes_forward INTEGER,
    bytes_backward INTEGER, at REAL, PRIMARY KEY (step, stage)
);
CREATE TABLE IF NOT EXISTS rotations (version INTEGER PRIMARY KEY, effective_step INTEGER, message BLOB);
"""


@dataclass
class NodeRecord:
    id: str
    name: str
    address: str
    stages: list[int]
    last_seen: float
    alive: bool


class CoordinatorState:
    """SQLite-backed run state. ``open`` creates the run or checks the stored one matches."""

    def __init__(self, path: str | Path):
        self.path = str(path)
        self.db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.executescript(SCHEMA)

    def open_run(self, run_id: str, config: RunConfig) -> str:
        """Store a new run, or resume the stored one; a stored run with another config is an error."""
        row = self.db.execute("SELECT id, config_hash FROM run").fetchone()
        digest = config_hash(config)
        if row is None:
            self.db.execute("INSERT INTO run VALUES (?, ?, ?)", (run_id, config.to_json(), digest))
            return run_id
        if row[1] != digest:
            raise ValueError(
                f"state file {self.path} holds run {row[0]} with config {row[1][:12]}, not {digest[:12]}; "
                "use another --state file to start a new run"
            )
        return row[0]

    def upsert_node(self, node: NodeRecord) -> None:
        self.db.execute(
            "INSERT INTO nodes VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT(id) DO UPDATE SET "
            "name=excluded.name, address=excluded.address, stages=excluded.stages, "
            "last_seen=excluded.last_seen, alive=excluded.alive",
            (
                node.id,
                node.name,
                node.address,
                json.dumps(node.stages),
                time.time(),
                node.last_seen,
                node.alive,
            ),
        )

    def nodes(self) -> list[NodeRecord]:
        rows = self.db.execute(
            "SELECT id, name, address, stages, last_seen, alive FROM nodes ORDER BY joined"
        )
        return [NodeRecord(r[0], r[1], r[2], json.loads(r[3]), r[4], bool(r[5])) for r in rows]

    def record_step(
        self, step: int, stage: int, loss: float | None, tokens: int, bytes_forward: int, bytes_backward: int
    ) -> None:
        self.db.execute(
            "INSERT OR REPLACE INTO steps VALUES (?, ?, ?, ?, ?, ?, ?)",
            (step, stage, loss, tokens, bytes_forward, bytes_backward, time.time()),
        )

    def completed_step(self, n_stages: int) -> int:
        """The last step every stage has reported (-1 if none)."""
        row = self.db.execute(
            "SELECT MAX(step) FROM (SELECT step FROM steps GROUP BY step HAVING COUNT(*) = ?)", (n_stages,)
        ).fetchone()
        return -1 if row[0] is None else int(row[0])

    def losses(self) -> dict[int, float]:
        rows = self.db.execute("SELECT step, loss FROM steps WHERE loss IS NOT NULL ORDER BY step")
        return {int(s): float(v) for s, v in rows}

    def add_rotation(self, rotation: SubspaceRotation) -> None:
        self.db.execute(
            "INSERT OR REPLACE INTO rotations VALUES (?, ?, ?)",
            (rotation.version, rotation.effective_step, rotation.to_bytes()),
        )

    def rotations(self) -> list[SubspaceRotation]:
        rows = self.db.execute("SELECT message FROM rotations ORDER BY version")
        return [SubspaceRotation.from_bytes(bytes(r[0])) for r in rows]

    def close(self) -> None:
        self.db.close()
