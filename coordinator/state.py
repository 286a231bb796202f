"""The coordinator's durable state in SQLite: the run, its nodes, step reports, statistics and rotations.

Everything needed to resume after a restart lives here; the in-memory service is
rebuilt from it. Writes are small and infrequent (membership changes, one row per
reported step, one per boundary statistic, rotation and stage snapshot), so a single connection
in autocommit mode with WAL journaling is plenty. Heartbeats are not written: a resumed
coordinator gives every node a fresh grace period anyway.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import sqlite3
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from swarm.core.config import RunConfig, config_hash
from swarm.core.subspace import SubspaceRotation

SCHEMA = """
CREATE TABLE IF NOT EXISTS run (
    id TEXT PRIMARY KEY, config_json TEXT NOT NULL, config_hash TEXT NOT NULL, auth_token TEXT NOT NULL,
    plan_epoch INTEGER NOT NULL DEFAULT 0, resume_step INTEGER NOT NULL DEFAULT 0,
    restarts INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS nodes (
    id TEXT PRIMARY KEY, name TEXT, address TEXT, device TEXT, max_stages INTEGER NOT NULL,
    stages TEXT NOT NULL, alive INTEGER NOT NULL, joined REAL, updated REAL, reachable INTEGER
);
CREATE TABLE IF NOT EXISTS steps (
    step INTEGER NOT NULL, stage INTEGER NOT NULL, loss REAL, tokens INTEGER, bytes_forward INTEGER,
    bytes_backward INTEGER, wall_seconds REAL, at REAL, PRIMARY KEY (step, stage)
);
CREATE TABLE IF NOT EXISTS statistics (
    step INTEGER NOT NULL, boundary INTEGER NOT NULL, version INTEGER NOT NULL, data BLOB NOT NULL,
    PRIMARY KEY (step, boundary)
);
CREATE TABLE IF NOT EXISTS node_identity (
    node_id TEXT PRIMARY KEY, party TEXT NOT NULL, certificate TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS broken_pairs (a TEXT NOT NULL, b TEXT NOT NULL, PRIMARY KEY (a, b));
CREATE TABLE IF NOT EXISTS rotations (version INTEGER PRIMARY KEY, effective_step INTEGER, message BLOB);
CREATE TABLE IF NOT EXISTS checkpoints (
    step INTEGER NOT NULL, stage INTEGER NOT NULL, digest TEXT NOT NULL, size INTEGER NOT NULL, at REAL,
    chunk_bytes INTEGER NOT NULL DEFAULT 0, chunks BLOB NOT NULL DEFAULT x'', PRIMARY KEY (step, stage)
);
CREATE TABLE IF NOT EXISTS holders (
    digest TEXT NOT NULL, node_id TEXT NOT NULL, PRIMARY KEY (digest, node_id)
);
CREATE TABLE IF NOT EXISTS first_hosted (node_id TEXT PRIMARY KEY, step INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS withdrawals (epoch INTEGER PRIMARY KEY, resume_step INTEGER NOT NULL);
"""


@dataclass
class RunRecord:
    id: str
    auth_token: str  # per-run secret (never sent): the key boundary link secrets derive from
    plan_epoch: int
    resume_step: int = 0  # first step of the current epoch
    restarts: int = 0  # epochs that rolled the run back to a cut


@dataclass(frozen=True)
class CheckpointRecord:
    step: int
    stage: int
    digest: str
    size: int
    chunk_bytes: int = 0  # the manifest (swarm.io.manifest): chunk size, and each chunk's raw sha256
    chunks: bytes = b""


@dataclass
class NodeRecord:
    id: str
    name: str
    address: str
    device: str
    max_stages: int
    stages: list[int]
    alive: bool
    reachable: bool = False  # the coordinator reached ``address`` at Join (else the node only dials)


@dataclass(frozen=True)
class SavedStatistic:
    step: int
    boundary: int
    version: int
    data: bytes  # d x k float64 little-endian, as reported


class CoordinatorState:
    """SQLite-backed run state. ``open_run`` creates the run or checks the stored one matches."""

    def __init__(self, path: str | Path):
        self.path = str(path)
        with contextlib.suppress(FileExistsError):  # it holds the run's secrets: owner only
            os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        self.db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.executescript(SCHEMA)
        columns = {row[1] for row in self.db.execute("PRAGMA table_info(nodes)")}
        if "reachable" not in columns:  # a state file from before reachability was measured
            self.db.execute("ALTER TABLE nodes ADD COLUMN reachable INTEGER")
        columns = {row[1] for row in self.db.execute("PRAGMA table_info(checkpoints)")}
        if "chunks" not in columns:  # a state file from before snapshots had manifests
            self.db.execute("ALTER TABLE checkpoints ADD COLUMN chunk_bytes INTEGER NOT NULL DEFAULT 0")
            self.db.execute("ALTER TABLE checkpoints ADD COLUMN chunks BLOB NOT NULL DEFAULT x''")

    def open_run(self, run_id: str | None, config: RunConfig) -> RunRecord:
        """Store a new run (``run_id`` or a fresh id, a fresh auth secret), or resume the stored one.

        A stored run with another config, or another id than a given ``run_id``, is an error.
        """
        row = self.db.execute(
            "SELECT id, config_hash, auth_token, plan_epoch, resume_step, restarts FROM run"
        ).fetchone()
        digest = config_hash(config)
        if row is None:
            record = RunRecord(run_id or f"run-{uuid.uuid4().hex[:12]}", secrets.token_hex(32), 0)
            self.db.execute(
                "INSERT INTO run VALUES (?, ?, ?, ?, ?, 0, 0)",
                (record.id, config.to_json(), digest, record.auth_token, record.plan_epoch),
            )
            return record
        if row[1] != digest:
            raise ValueError(
                f"state file {self.path} holds run {row[0]} with config {row[1][:12]}, not {digest[:12]}; "
                "use another --state file to start a new run (a run on the embedded defaults resumes "
                "only under the release that wrote it: pass its configuration with --config)"
            )
        if run_id is not None and run_id != row[0]:
            raise ValueError(f"state file {self.path} holds run {row[0]}, not {run_id}")
        return RunRecord(row[0], row[2], int(row[3]), int(row[4]), int(row[5]))

    def set_epoch(self, epoch: int, resume_step: int, restarts: int) -> None:
        self.db.execute(
            "UPDATE run SET plan_epoch = ?, resume_step = ?, restarts = ?", (epoch, resume_step, restarts)
        )

    def upsert_node(self, node: NodeRecord) -> None:
        now = time.time()
        self.db.execute(
            "INSERT INTO nodes VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT(id) DO UPDATE SET "
            "name=excluded.name, address=excluded.address, device=excluded.device, "
            "max_stages=excluded.max_stages, stages=excluded.stages, alive=excluded.alive, "
            "updated=excluded.updated, reachable=excluded.reachable",
            (
                node.id,
                node.name,
                node.address,
                node.device,
                node.max_stages,
                json.dumps(node.stages),
                node.alive,
                now,
                now,
                node.reachable,
            ),
        )

    def set_identity(self, node_id: str, party: str, certificate: str) -> None:
        """What a node is beyond its id: its party in accusations, its client certificate's name."""
        self.db.execute(
            "INSERT OR REPLACE INTO node_identity VALUES (?, ?, ?)", (node_id, party, certificate)
        )

    def add_broken_pair(self, pair: frozenset[str]) -> None:
        """Record that the planned link between two nodes failed in two consecutive epochs."""
        a, b = sorted(pair)
        self.db.execute("INSERT OR IGNORE INTO broken_pairs VALUES (?, ?)", (a, b))

    def broken_pairs(self) -> set[frozenset[str]]:
        """Every pair recorded by :meth:`add_broken_pair`."""
        return {frozenset(row) for row in self.db.execute("SELECT a, b FROM broken_pairs")}

    def identities(self) -> dict[str, tuple[str, str]]:
        """node id -> (party, certificate name), for every node that joined."""
        rows = self.db.execute("SELECT node_id, party, certificate FROM node_identity")
        return {node_id: (party, certificate) for node_id, party, certificate in rows}

    def set_first_hosted(self, node_id: str, step: int) -> None:
        """The first step ``node_id`` hosted a stage at (in the run's current history, at most)."""
        self.db.execute("INSERT OR REPLACE INTO first_hosted VALUES (?, ?)", (node_id, step))

    def first_hosted(self) -> dict[str, int]:
        """node id -> what :meth:`set_first_hosted` last recorded for it."""
        rows = self.db.execute("SELECT node_id, step FROM first_hosted")
        return {node_id: int(step) for node_id, step in rows}

    def nodes(self) -> list[NodeRecord]:
        """Every node ever admitted, in join order (one stored before reachability was measured
        counts as reachable when it announced an address)."""
        rows = self.db.execute(
            "SELECT id, name, address, device, max_stages, stages, alive, reachable FROM nodes "
            "ORDER BY joined, rowid"
        )
        return [
            NodeRecord(*r[:5], json.loads(r[5]), bool(r[6]), bool(r[2] if r[7] is None else r[7]))
            for r in rows
        ]

    def record_step(
        self,
        step: int,
        stage: int,
        loss: float | None,
        tokens: int,
        bytes_forward: int,
        bytes_backward: int,
        wall_seconds: float,
    ) -> None:
        self.db.execute(
            "INSERT OR REPLACE INTO steps VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (step, stage, loss, tokens, bytes_forward, bytes_backward, wall_seconds, time.time()),
        )

    def completed_step(self, n_stages: int) -> int:
        """The last step every stage has reported (-1 if none)."""
        row = self.db.execute(
            "SELECT MAX(step) FROM (SELECT step FROM steps GROUP BY step HAVING COUNT(*) = ?)", (n_stages,)
        ).fetchone()
        return -1 if row[0] is None else int(row[0])

    def step_summaries(self, n_stages: int, since: int = 0) -> list[tuple]:
        """(step, loss, tokens, bytes_forward, bytes_backward, wall_seconds, completed_at) of fully
        reported steps >= since.

        Loss comes from the last stage, tokens from stage 0, bytes are summed over stages
        (each stage reports what it sent), wall time is the slowest stage's, completed_at the
        unix time of the last report (a redone step keeps only its latest reports).
        """
        return self.db.execute(
            "SELECT step, MAX(loss), MAX(CASE WHEN stage = 0 THEN tokens END), SUM(bytes_forward), "
            "SUM(bytes_backward), MAX(wall_seconds), MAX(at) FROM steps WHERE step >= ? "
            "GROUP BY step HAVING COUNT(*) = ? ORDER BY step",
            (since, n_stages),
        ).fetchall()

    def losses(self) -> dict[int, float]:
        rows = self.db.execute("SELECT step, loss FROM steps WHERE loss IS NOT NULL ORDER BY step")
        return {int(s): float(v) for s, v in rows}

    def add_statistic(self, stat: SavedStatistic) -> None:
        """Keep a boundary statistic until the rotation it feeds is published."""
        self.db.execute(
            "INSERT OR REPLACE INTO statistics VALUES (?, ?, ?, ?)",
            (stat.step, stat.boundary, stat.version, stat.data),
        )

    def statistics(self) -> list[SavedStatistic]:
        rows = self.db.execute("SELECT step, boundary, version, data FROM statistics ORDER BY step, boundary")
        return [SavedStatistic(int(r[0]), int(r[1]), int(r[2]), bytes(r[3])) for r in rows]

    def add_rotation(self, rotation: SubspaceRotation) -> None:
        """Persist a published rotation; the statistics it consumed are dropped."""
        self.db.execute(
            "INSERT OR REPLACE INTO rotations VALUES (?, ?, ?)",
            (rotation.version, rotation.effective_step, rotation.to_bytes()),
        )
        self.db.execute("DELETE FROM statistics WHERE version < ?", (rotation.version,))

    def rotations(self, after_version: int = -1) -> list[SubspaceRotation]:
        """Persisted rotations with version > ``after_version``, ascending."""
        rows = self.db.execute(
            "SELECT message FROM rotations WHERE version > ? ORDER BY version", (after_version,)
        )
        return [SubspaceRotation.from_bytes(bytes(r[0])) for r in rows]

    def withdraw_rotations(self, resume_step: int, epoch: int) -> int:
        """Delete the rotations effective after ``resume_step`` and the statistics of the steps from it
        on: they were computed from a history that plan ``epoch`` discards. The number of rotations
        withdrawn; a withdrawal of any is recorded (it starts a new :meth:`rotation_lineage`)."""
        withdrawn = self.db.execute("DELETE FROM rotations WHERE effective_step > ?", (resume_step,)).rowcount
        self.db.execute("DELETE FROM statistics WHERE step >= ?", (resume_step,))
        if withdrawn:
            self.db.execute("INSERT OR REPLACE INTO withdrawals VALUES (?, ?)", (epoch, resume_step))
        return withdrawn

    def rotation_lineage(self) -> int:
        """The plan epoch that last withdrew rotations (0: none ever was): rotations a node holds
        from an earlier lineage may have been withdrawn."""
        row = self.db.execute("SELECT MAX(epoch) FROM withdrawals").fetchone()
        return int(row[0] or 0)

    def last_rotation(self) -> SubspaceRotation | None:
        row = self.db.execute("SELECT message FROM rotations ORDER BY version DESC LIMIT 1").fetchone()
        return None if row is None else SubspaceRotation.from_bytes(bytes(row[0]))

    def add_checkpoint(self, record: CheckpointRecord) -> None:
        self.db.execute(
            "INSERT OR REPLACE INTO checkpoints (step, stage, digest, size, at, chunk_bytes, chunks) "
            "VALUES (?, ?, ?, ?, ?, ?, ?)",
            (
                record.step,
                record.stage,
                record.digest,
                record.size,
                time.time(),
                record.chunk_bytes,
                record.chunks,
            ),
        )

    def checkpoints(self) -> list[CheckpointRecord]:
        rows = self.db.execute(
            "SELECT step, stage, digest, size, chunk_bytes, chunks FROM checkpoints ORDER BY step, stage"
        )
        return [CheckpointRecord(int(r[0]), int(r[1]), r[2], int(r[3]), int(r[4]), bytes(r[5])) for r in rows]

    def holders(self) -> dict[str, set[str]]:
        """Snapshot digest -> the nodes that reported holding it."""
        held: dict[str, set[str]] = {}
        for key, node_id in self.db.execute("SELECT digest, node_id FROM holders"):
            held.setdefault(key, set()).add(node_id)
        return held

    def set_holder(self, key: str, node_id: str, holds: bool) -> None:
        if holds:
            self.db.execute("INSERT OR IGNORE INTO holders VALUES (?, ?)", (key, node_id))
        else:
            self.db.execute("DELETE FROM holders WHERE digest = ? AND node_id = ?", (key, node_id))

    def forget_holders(self, keys: list[str]) -> None:
        self.db.executemany("DELETE FROM holders WHERE digest = ?", [(k,) for k in keys])

    def remove_checkpoints(self, records: list[CheckpointRecord]) -> None:
        self.db.executemany(
            "DELETE FROM checkpoints WHERE step = ? AND stage = ?", [(r.step, r.stage) for r in records]
        )

    def close(self) -> None:
        self.db.close()
