"""How the package is laid out: what stays torch-free, and what needs a source checkout."""

from __future__ import annotations

import subprocess
import sys

from swarm.cli import NO_BENCH, main

TORCH_FREE = """
import sys
import swarm.core.config, swarm.cli
assert "torch" not in sys.modules, "importing"
from swarm.cli import main
assert main(["certs", "init", "--dir", sys.argv[1]]) == 0
assert main(["certs", "issue", "--dir", sys.argv[1], "--name", "n0"]) == 0
assert "torch" not in sys.modules, "swarm certs"
assert main(["status", "--coordinator", "127.0.0.1:1", "--timeout", "0.5"]) == 1  # nobody there
assert "torch" not in sys.modules, "swarm status"
"""


def test_the_configuration_the_cli_status_and_certs_do_not_import_torch(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", TORCH_FREE, str(tmp_path / "certs")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]


def test_swarm_bench_without_the_bench_tree_says_it_needs_a_source_checkout(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "bench", None)  # as in an installed wheel: no bench/ package
    monkeypatch.setitem(sys.modules, "bench.run", None)
    assert main(["bench", "--quick"]) == 2
    assert NO_BENCH in capsys.readouterr().err
