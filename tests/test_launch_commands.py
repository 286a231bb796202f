"""The command lines ``swarm up`` builds parse with the real node and coordinator parsers, and the
run configuration the ``swarm`` flags give."""

from __future__ import annotations

from pathlib import Path

import pytest
from swarm.coordinator.cli import build_parser as coordinator_parser
from swarm.coordinator.cli import serve_command
from swarm.node.cli import build_parser as node_parser
from swarm.node.cli import join_command

from swarm.cli import build_parser as swarm_parser
from swarm.cli import main, run_config_from_args
from swarm.core.config import MODEL_PRESETS, RunConfig
from swarm.net.tls import cli_flags

PKI = Path("/run/pki")


def tls_values(name: str) -> dict:
    return {
        "tls_ca": str(PKI / "ca.pem"),
        "tls_cert": str(PKI / f"{name}.pem"),
        "tls_key": str(PKI / f"{name}.key"),
        "mutual_tls": True,
        "insecure": False,
    }


def parsed(args, expected: dict) -> None:
    assert {key: getattr(args, key) for key in expected} == expected


def test_a_node_command_with_every_option_up_uses_round_trips():
    argv = join_command(
        "10.0.0.1:7000",
        listen="10.0.1.2:0",
        stages=2,
        data_dir=Path("/run/node3"),
        device="cuda:1",
        link_mbps=12.5,
        link_latency_ms=40.0,
        name="node3",
        use_dht=False,
        metrics_port=9104,
        security=cli_flags(PKI, "node3"),
    )
    args = node_parser().parse_args(argv)
    expected = {"command": "join", "coordinator": "10.0.0.1:7000", "listen": "10.0.1.2:0", "stages": 2}
    expected |= {"data_dir": "/run/node3", "device": "cuda:1", "link_mbps": 12.5, "link_latency_ms": 40.0}
    expected |= {"name": "node3", "no_dht": True, "metrics_port": 9104, "token": None}
    parsed(args, expected | tls_values("node3"))


def test_a_node_command_leaves_unset_options_at_the_parser_defaults():
    argv = join_command("127.0.0.1:7000", security=["--insecure"])
    assert argv == ["join", "--coordinator", "127.0.0.1:7000", "--insecure"]
    defaults = node_parser().parse_args(["join", "--coordinator", "127.0.0.1:7000"])
    args = node_parser().parse_args(argv)
    assert vars(args) == vars(defaults) | {"insecure": True}
    assert args.listen == "127.0.0.1:0" and not args.no_dht and args.metrics_port == -1


def test_a_coordinator_command_with_every_option_up_uses_round_trips():
    argv = serve_command(
        config=Path("/run/run.toml"),
        host="10.0.0.1",
        port=0,
        state=Path("/run/coordinator.sqlite"),
        metrics_port=9100,
        dead_after=45.0,
        use_dht=False,
        security=cli_flags(PKI, "coordinator"),
    )
    args = coordinator_parser().parse_args(argv)
    expected = {"command": "serve", "config": "/run/run.toml", "host": "10.0.0.1", "port": 0}
    expected |= {"state": "/run/coordinator.sqlite", "metrics_port": 9100, "dead_after": 45.0, "no_dht": True}
    parsed(args, expected | tls_values("coordinator"))


def test_a_coordinator_command_without_metrics_keeps_the_parser_defaults_otherwise():
    argv = serve_command(metrics_port=-1)
    assert argv == ["serve", "--metrics-port", "-1"]
    args = coordinator_parser().parse_args(argv)
    defaults = coordinator_parser().parse_args(["serve"])
    assert vars(args) == vars(defaults) | {"metrics_port": -1}


def run_config(*flags: str) -> RunConfig:
    return run_config_from_args(swarm_parser().parse_args(["train", *flags]))


def test_the_default_run_is_the_run_configuration_defaults():
    config = run_config()
    assert config == RunConfig()
    assert config.n_stages == 4 and config.model == MODEL_PRESETS["small"]
    assert (config.codec.kind, config.codec.forward_format, config.codec.backward_format) == (
        "subspace",
        "bf16",
        "bf16",
    )
    t = config.train
    assert (t.steps, t.batch_size, t.seq_len, t.microbatches) == (200, 8, 128, 2)


def test_a_preset_shortens_the_default_sequence_to_its_context():
    config = run_config("--preset", "tiny")
    assert config.model == MODEL_PRESETS["tiny"] and config.train.seq_len == 64
    assert run_config("--preset", "tiny", "--seq-len", "32").train.seq_len == 32
    assert run_config("--preset", "150m").train.seq_len == 128  # it fits: kept


def test_an_explicit_sequence_longer_than_the_preset_context_is_refused(capsys):
    with pytest.raises(ValueError, match=r"train\.seq_len=128 exceeds model\.max_seq_len=64"):
        run_config("--preset", "tiny", "--seq-len", "128")
    assert main(["train", "--preset", "tiny", "--seq-len", "128"]) == 2
    assert "train.seq_len=128 exceeds model.max_seq_len=64" in capsys.readouterr().err
