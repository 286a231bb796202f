"""The built wheel installs one top-level package, ``swarm``, with the node and coordinator inside it."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = {"swarm": "swarm", "node": "swarm/node", "coordinator": "swarm/coordinator"}


def test_the_wheel_holds_swarm_only_and_every_module_of_its_three_folders(tmp_path):
    source = tmp_path / "src"
    for name in (*FOLDERS, "proto"):
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    build = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "-q",
        "-w",
        "dist",
        ".",
    ]
    subprocess.run([*build, "."], cwd=source, check=True, timeout=300, capture_output=True)
    (wheel,) = (source / "dist").glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"swarm"}
    expected = {
        f"{installed}/{path.relative_to(ROOT / folder).as_posix()}"
        for folder, installed in FOLDERS.items()
        for path in (ROOT / folder).rglob("*.py")
        if "__pycache__" not in path.parts
    }
    assert expected - set(names) == set()  # no module left behind, bench/ never shipped
    assert "swarm/profiles/h200-2b-8layer-mb512.json" in names
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    scripts = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "swarm-node = swarm.node.cli:main" in scripts
    assert "swarm-coordinator = swarm.coordinator.cli:main" in scripts
