"""deploy/ agrees with itself and with the code: compose, Prometheus, Grafana, systemd."""

from __future__ import annotations

import configparser
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from swarm.coordinator import cli as coordinator_cli
from swarm.node import cli as node_cli

from swarm.ops.metrics import Metrics

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
NODES = [f"node{i}" for i in range(4)]
SWARM = ["coordinator", *NODES]
JOB_ROLES = {"swarm-coordinator": "coordinator", "swarm-nodes": "node"}
METRIC = re.compile(r"\bswarm_[a-z0-9_]+")
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created")}


def load_yaml(relative: str) -> Any:
    return yaml.safe_load((DEPLOY / relative).read_text())


@pytest.fixture(scope="module")
def services() -> dict[str, Any]:
    return load_yaml("docker-compose.yml")["services"]


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def bind_mounts(services: dict[str, Any]) -> set[tuple[str, Path, str]]:
    """(service, host path, container path) of every bind mount (sources relative to deploy/)."""
    mounts = set()
    for name, service in services.items():
        for volume in service.get("volumes", []):
            source, target = volume.split(":")[:2]
            if source.startswith((".", "/")):
                mounts.add((name, (DEPLOY / source).resolve(), target))
    return mounts


def dashboard_panels() -> list[dict[str, Any]]:
    panels = json.loads((DEPLOY / "grafana/dashboards/swarm.json").read_text())["panels"]
    return [p for panel in panels for p in [panel, *panel.get("panels", [])] if p["type"] != "row"]


def dashboard_exprs() -> list[str]:
    return [target["expr"] for panel in dashboard_panels() for target in panel["targets"]]


def exposition_names(role: str) -> set[str]:
    """Every sample name the role's registry can expose (``swarm_tokens`` -> ``swarm_tokens_total``)."""
    return {
        family.name + suffix
        for family in Metrics(role).registry.collect()
        for suffix in SUFFIXES.get(family.type, ("",))
    }


def test_compose_runs_a_coordinator_and_one_node_per_stage(services: dict[str, Any]) -> None:
    assert set(services) >= {*SWARM, "prometheus", "grafana"}
    for name in SWARM:
        assert services[name]["build"] == {"context": "..", "dockerfile": "deploy/Dockerfile"}
        assert services[name]["environment"]["SWARM_TOKEN"] == "${SWARM_TOKEN:?set SWARM_TOKEN}"
        assert any(volume.endswith(":/data") for volume in services[name]["volumes"])
    assert services["coordinator"]["command"][:2] == ["swarm-coordinator", "serve"]


def test_token_is_never_on_a_command_line() -> None:
    on_argv = re.compile(r"--token[ =]")  # the flag with a value (--token-file is the safe way)
    offenders = [str(p) for p in DEPLOY.rglob("*") if p.is_file() and on_argv.search(p.read_text())]
    assert not offenders, f"the join token belongs in SWARM_TOKEN, not on argv: {offenders}"


def test_every_node_announces_its_service_name(services: dict[str, Any]) -> None:
    for name in NODES:
        argv = services[name]["command"]
        assert argv[:2] == ["swarm-node", "join"]
        assert flag(argv, "--announce") == f"{name}:{flag(argv, '--listen').rsplit(':', 1)[1]}"
        assert (flag(argv, "--name"), flag(argv, "--coordinator")) == (name, "coordinator:7000")


def test_bind_mounted_files_exist(services: dict[str, Any]) -> None:
    mounts = bind_mounts(services)
    assert ("prometheus", DEPLOY / "prometheus.yml", "/etc/prometheus/prometheus.yml") in mounts
    assert [str(source) for _, source, _ in mounts if not source.exists()] == []


def test_prometheus_scrapes_every_swarm_service(services: dict[str, Any]) -> None:
    config = load_yaml("prometheus.yml")
    assert config["global"]["scrape_interval"] == "5s"
    targets = {
        job["job_name"]: sorted(t for static in job["static_configs"] for t in static["targets"])
        for job in config["scrape_configs"]
    }
    expected = {f"{name}:{flag(services[name]['command'], '--metrics-port')}" for name in SWARM}
    assert targets == {"swarm-coordinator": ["coordinator:9100"], "swarm-nodes": [f"{n}:9100" for n in NODES]}
    assert {t for ts in targets.values() for t in ts} == expected


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_promtool_accepts_the_config_and_the_dashboard_queries(tmp_path: Path) -> None:
    rules = [
        {"record": f"dashboard:expr{i}", "expr": expr.replace("$__rate_interval", "1m")}
        for i, expr in enumerate(dashboard_exprs())
    ]
    (tmp_path / "rules.yml").write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    for args in (["check", "config", str(DEPLOY / "prometheus.yml")], ["check", "rules", "rules.yml"]):
        done = subprocess.run(["promtool", *args], cwd=tmp_path, capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr


def test_grafana_is_provisioned_and_every_panel_uses_its_datasource(services: dict[str, Any]) -> None:
    [datasource] = load_yaml("grafana/provisioning/datasources/prometheus.yml")["datasources"]
    assert (datasource["uid"], datasource["url"]) == ("prometheus", "http://prometheus:9090")
    [provider] = load_yaml("grafana/provisioning/dashboards/swarm.yml")["providers"]
    assert ("grafana", DEPLOY / "grafana/dashboards", provider["options"]["path"]) in bind_mounts(services)
    board = json.loads((DEPLOY / "grafana/dashboards/swarm.json").read_text())
    assert (board["uid"], board["title"], board["refresh"]) == ("subspace-swarm", "subspace-swarm", "5s")
    for panel in dashboard_panels():
        assert panel["type"] in {"timeseries", "stat"} and panel["targets"], panel["title"]
        uids = {panel["datasource"]["uid"], *(t["datasource"]["uid"] for t in panel["targets"])}
        assert uids == {"prometheus"}, panel["title"]


def test_dashboard_queries_only_metrics_the_code_exports() -> None:
    exported = {role: exposition_names(role) for role in ("node", "coordinator")}
    missing: set[str] = set()
    for expr in dashboard_exprs():
        jobs = set(re.findall(r'job="([^"]+)"', expr)) or set(JOB_ROLES)
        roles = sorted(JOB_ROLES[job] for job in jobs)
        names = set().union(*(exported[role] for role in roles))
        missing |= {f"{m} ({'/'.join(roles)})" for m in METRIC.findall(expr) if m not in names}
    assert not missing, "metrics missing from swarm.ops.metrics.Metrics(role): " + ", ".join(sorted(missing))


@pytest.mark.parametrize(("role", "command"), [("coordinator", "serve"), ("node", "join")])
def test_systemd_unit(role: str, command: str, services: dict[str, Any]) -> None:
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # type: ignore[method-assign]  # keys keep their case
    unit.read(DEPLOY / f"systemd/swarm-{role}.service")
    service = unit["Service"]
    argv = service["ExecStart"].replace("\\\n", " ").split()
    assert argv[:2] == [f"/opt/swarm/.venv/bin/swarm-{role}", command]
    compose_argv = services["coordinator" if role == "coordinator" else "node0"]["command"]
    assert {a for a in argv if a.startswith("--")} == {a for a in compose_argv if a.startswith("--")}
    assert service["EnvironmentFile"] == f"/etc/swarm/{role}.env"
    assert "SWARM_TOKEN=" in (DEPLOY / f"systemd/{role}.env.example").read_text()
    expected = {"User": "swarm", "StateDirectory": "swarm", "Restart": "on-failure", "KillSignal": "SIGTERM"}
    assert {key: service[key] for key in expected} == expected
    assert (service["NoNewPrivileges"], service["ProtectSystem"]) == ("yes", "strict")
    assert "/var/lib/swarm" in service["ReadWritePaths"].split()
    if role == "node":
        assert service["TimeoutStopSec"] == "180"


def test_every_compose_command_parses_with_the_real_cli(services: dict[str, Any]) -> None:
    for name in SWARM:
        program, *argv = services[name]["command"]
        if program == "swarm-coordinator":
            args = coordinator_cli.build_parser().parse_args(argv)
            assert (args.host, args.port, args.metrics_host) == ("0.0.0.0", 7000, "0.0.0.0")
        else:
            args = node_cli.build_parser().parse_args(argv)
            assert (args.listen, args.announce) == ("0.0.0.0:7100", f"{name}:7100")
        assert (args.dht_listen, args.log_format) == (flag(argv, "--dht-listen"), "json")
