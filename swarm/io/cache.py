"""The on-disk cache shared by the data modules: its root, atomic writes, and content keys."""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

CACHE_ENV = "SWARM_CACHE_DIR"
DEFAULT_CACHE_DIR = Path("~/.cache/subspace-swarm")
KEY_LEN = 24  # hex digits of a hash used in cache file names


def resolve_cache_dir(cache_dir: str | Path | None = None) -> Path:
    """Return the cache root: the argument, else ``$SWARM_CACHE_DIR``, else ``~/.cache/subspace-swarm``."""
    if cache_dir is None:
        cache_dir = os.environ.get(CACHE_ENV) or DEFAULT_CACHE_DIR
    return Path(cache_dir).expanduser()


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary file in the same folder and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600 files; a cache may be shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def corpus_hash(texts: Sequence[str]) -> str:
    """Return the sha256 hex digest of a list of documents (document boundaries included)."""
    h = hashlib.sha256()
    for text in texts:
        data = text.encode("utf-8")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()
