"""The trained model of a run, from its latest complete checkpoint cut, as a model folder.

Used by the coordinator when the final cut of a run is stored (it writes
``<state>.model/`` next to its state file) and by ``swarm-coordinator export --state
FILE --out DIR`` on demand, while the run goes on or after it ended (the state file is
only read). The format is :mod:`swarm.io.model_io`'s, the same ``swarm train --out`` writes.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable
from pathlib import Path

from swarm.coordinator.state import CheckpointRecord
from swarm.coordinator.store import ArtifactStore

from swarm.core.config import RunConfig
from swarm.core.subspace import initial_artifacts
from swarm.io import checkpoint, model_io


class NoCheckpoint(RuntimeError):
    """The run has no complete checkpoint cut whose snapshots all verify."""


def default_model_dir(state_path: str | Path) -> Path:
    state = Path(state_path)
    return state.with_name(state.name + ".model")


def artifact_store(state_path: str | Path, max_bytes: int) -> ArtifactStore:
    state = Path(state_path)
    return ArtifactStore(state.with_name(state.name + ".artifacts"), max_bytes)


def trained_model(
    config: RunConfig, records: Iterable[CheckpointRecord], store: ArtifactStore
) -> model_io.TrainedModel:
    """The model at the newest complete cut whose snapshots all read back (hash-checked)."""
    by_step: dict[int, dict[int, CheckpointRecord]] = {}
    for r in records:
        by_step.setdefault(r.step, {})[r.stage] = r
    for step in sorted(by_step, reverse=True):
        cut = by_step[step]
        if len(cut) != config.n_stages:
            continue
        blobs = [store.read(cut[s].digest) for s in range(config.n_stages)]
        if any(b is None for b in blobs):
            continue
        states = [checkpoint.from_bytes(b) for b in blobs]
        fixed, _ = initial_artifacts(config)
        tensors = model_io.consolidate([s["model"] for s in states], [s["mapl"] for s in states], fixed)
        return model_io.TrainedModel(
            config, tensors, step, states[0]["version"], model_io.tokenizer_json(config)
        )
    raise NoCheckpoint("the run has no complete checkpoint cut to export yet")


def export_from_state(state_path: str | Path, out_dir: str | Path, max_bytes: int) -> dict:
    """Read a coordinator's state file (never written) and export its latest cut to ``out_dir``."""
    if not Path(state_path).is_file():
        raise FileNotFoundError(f"no coordinator state file {state_path}")
    db = sqlite3.connect(f"file:{state_path}?mode=ro", uri=True)
    try:
        (config_json,) = db.execute("SELECT config_json FROM run").fetchone()
        rows = db.execute("SELECT step, stage, digest, size FROM checkpoints").fetchall()
    finally:
        db.close()
    config = RunConfig.from_dict(json.loads(config_json))
    records = [CheckpointRecord(int(a), int(b), c, int(d)) for a, b, c, d in rows]
    return model_io.save(trained_model(config, records, artifact_store(state_path, max_bytes)), out_dir)
