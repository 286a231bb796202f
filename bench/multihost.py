"""The README's multi-host recipe, run as written on emulated hosts.

One network namespace per host on a shared bridge (:class:`bench.netns.EmulatedNetwork`),
each host behind a ``tbf`` access link, nothing reachable through 127.0.0.1 across hosts::

    ctl  10.213.0.1   swarm-coordinator serve (gRPC :7000, DHT :7001, HTTP :9100) [+ Prometheus :9090]
    h0   10.213.0.2   swarm-node join, inbound :7100              -> stage 0
    h1   10.213.0.3   swarm-node join --listen '' (dial-only)     -> stage 1
    h2   10.213.0.4   swarm-node join, inbound :7100              -> stage 2
    h3   10.213.0.5   swarm-node join, inbound, cannot reach TCP :7001 (no DHT) -> stage 3

The commands are :data:`CERTS`, :data:`ISSUE`, :data:`COORDINATOR`, :data:`INBOUND_NODE` /
:data:`DIAL_ONLY_NODE` and :data:`STATUS` with the coordinator's address in place of ``COORD``
(the README quotes the same templates; a test checks it does); the join token travels in
``SWARM_TOKEN``. Every channel is TLS from the recipe's CA: inbound nodes get a certificate
of their own, the dial-only node only the CA. Nodes
join one by one, so the stage of each is known, and linger after the run so their
metrics can still be read. Used by ``tests/test_multihost.py`` and the ``multihost``
benchmark section.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import secrets
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from bench.netns import EmulatedNetwork
from swarm.core.config import (
    CodecConfig,
    EmulationConfig,
    ModelConfig,
    ReplicaSyncConfig,
    RunConfig,
    TrainConfig,
)
from swarm.launch.local_swarm import RELAYING, ProcessGroup, StatusPoller, tee, wait_for_line
from swarm.net.tls import NODE_SERVER_NAME, Security

CERTS = "swarm certs init --dir certs --host COORD"
ISSUE = "swarm certs issue --dir certs --name NAME"
COORDINATOR = (
    "swarm-coordinator serve --config run.toml --host 0.0.0.0 --port 7000 --dht-listen /ip4/0.0.0.0/tcp/7001 "
    "--metrics-host 0.0.0.0 --metrics-port 9100 --state run.sqlite "
    "--tls-ca certs/ca.pem --tls-cert certs/coordinator.pem --tls-key certs/coordinator.key"
)
INBOUND_NODE = (
    "swarm-node join --coordinator COORD:7000 --listen 0.0.0.0:7100 --dht-listen /ip4/0.0.0.0/tcp/7101 "
    "--metrics-host 0.0.0.0 --metrics-port 9100 --tls-ca ca.pem --tls-cert node.pem --tls-key node.key"
)
DIAL_ONLY_NODE = (
    "swarm-node join --coordinator COORD:7000 --listen '' --metrics-host 0.0.0.0 --metrics-port 9100 "
    "--tls-ca ca.pem"
)
STATUS = "swarm status --coordinator COORD:7000 --tls-ca ca.pem"
GRPC_PORT, DHT_PORT, METRICS_PORT, NODE_PORT, PROMETHEUS_PORT = 7000, 7001, 9100, 7100, 9090
ROLES = ("inbound", "dial-only", "inbound", "no-dht")  # host i's node, hosting stage i
LINGER_S = 120.0

FETCH = """
import sys, urllib.request
sys.stdout.buffer.write(urllib.request.urlopen(sys.argv[1], timeout=10).read())
"""
HEALTH = """
import sys, grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
credentials = grpc.ssl_channel_credentials(open(sys.argv[3], "rb").read())
options = [("grpc.ssl_target_name_override", sys.argv[4])] if sys.argv[4:] else []
with grpc.secure_channel(sys.argv[1], credentials, options=options) as channel:
    request = health_pb2.HealthCheckRequest(service=sys.argv[2])
    reply = health_pb2_grpc.HealthStub(channel).Check(request, timeout=10)
print(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
"""


@dataclasses.dataclass(frozen=True)
class MultiHostPlan:
    model: ModelConfig
    train: TrainConfig  # train.replicas > 1: the hosts past the stages join as replicas
    mbps: float = 100.0
    prometheus: bool = False
    codec: CodecConfig = dataclasses.field(default_factory=CodecConfig)  # the run's boundary codec
    roles: tuple[str, ...] = ROLES  # host i's node; the first n_stages host stage i
    n_stages: int = len(ROLES)
    replica_sync: ReplicaSyncConfig = dataclasses.field(default_factory=ReplicaSyncConfig)
    emulation: EmulationConfig = dataclasses.field(default_factory=EmulationConfig)

    @property
    def config(self) -> RunConfig:
        constrained = self.codec.kind == "subspace"
        model = dataclasses.replace(self.model, constrain_writes=constrained)
        return RunConfig(
            model=model,
            codec=self.codec,
            train=self.train,
            n_stages=self.n_stages,
            replica_sync=self.replica_sync,
            emulation=self.emulation,
        )


def command(template: str, coordinator_ip: str = "") -> list[str]:
    """A recipe line as argv, with ``COORD`` replaced and the console script from this environment."""
    argv = shlex.split(template.replace("COORD", coordinator_ip))
    return [str(Path(sys.executable).with_name(argv[0])), *argv[1:]]


class MultiHostSwarm:
    """The topology above, started by :meth:`start` and torn down (processes, namespaces) on exit."""

    def __init__(self, plan: MultiHostPlan, folder: Path):
        self.plan, self.folder = plan, folder
        self.config = plan.config
        self.roles = plan.roles
        self.net = EmulatedNetwork(len(self.roles), plan.mbps, prefix="swsmh", control=True)
        self.group = ProcessGroup()
        self.token = secrets.token_hex(16)
        self.nodes: list[subprocess.Popen] = []
        self.socket = Path(tempfile.gettempdir()) / f"swarm-mh-{self.token[:12]}.sock"
        self.poller: StatusPoller | None = None

    def __enter__(self) -> MultiHostSwarm:
        self.net.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.poller is not None:
            self.poller.close()
        self.group.stop()
        self.net.__exit__(*exc)
        self.socket.unlink(missing_ok=True)

    @property
    def coordinator_ip(self) -> str:
        return self.net.control_ip

    def host_ip(self, i: int) -> str:
        return self.net.host_ip(i)

    def _start(self, prefix: list[str], argv: list[str], name: str, cwd: Path) -> subprocess.Popen:
        env = {"SWARM_TOKEN": self.token}
        proc = self.group.start([*prefix, *argv], self.folder / f"{name}.err", cwd=cwd, env=env)
        tee(proc, self.folder / f"{name}.log", [])
        return proc

    def _recipe(self, template: str, cwd: Path, **names: str) -> None:
        """Run a certificate line of the recipe (``COORD``, ``NAME`` filled in) in ``cwd``."""
        argv = command(template.replace("NAME", names.get("name", "")), self.coordinator_ip)
        subprocess.run(argv, cwd=cwd, check=True, capture_output=True, timeout=60)

    def _hand_certificate(self, i: int, folder: Path) -> None:
        """What the operator gives volunteer ``i``: the CA, and for an inbound node its own pair."""
        certs = self.folder / "certs"
        shutil.copy(certs / "ca.pem", folder / "ca.pem")
        if self.roles[i] != "dial-only":
            self._recipe(ISSUE, self.folder, name=f"node{i}")
            shutil.copy(certs / f"node{i}.pem", folder / "node.pem")
            shutil.copy(certs / f"node{i}.key", folder / "node.key")

    def start(self) -> None:
        """Coordinator (and Prometheus), then each node once the one before it has joined."""
        ctl = self.net.control_prefix
        (self.folder / "run.toml").write_text(self.config.to_toml())
        self._recipe(CERTS, self.folder)
        self.coordinator = self._start(ctl, command(COORDINATOR), "coordinator", self.folder)
        relay = [*ctl, sys.executable, "-m", "swarm.launch.local_swarm", "relay", str(self.socket)]
        relay.append(f"{self.coordinator_ip}:{GRPC_PORT}")
        relay_proc = self.group.start(relay, self.folder / "relay.err")
        lines: list[str] = []
        tee(relay_proc, self.folder / "relay.log", lines)
        ca = Security.from_files(self.folder / "certs" / "ca.pem")
        relay_address = wait_for_line(lines, RELAYING, relay_proc, 60).group(1)
        self.poller = StatusPoller(relay_address, ca, server_name=self.coordinator_ip)
        self._wait(lambda: self._status() is not None, 90, "the coordinator to serve")
        if self.plan.prometheus:
            self._start_prometheus()
        if "no-dht" in self.roles:
            self.net.block_tcp_port(self.roles.index("no-dht"), DHT_PORT)
        for i, role in enumerate(self.roles):
            template = DIAL_ONLY_NODE if role == "dial-only" else INBOUND_NODE
            argv = command(template, self.coordinator_ip)
            data = self.folder / f"node{i}"
            argv += ["--data-dir", str(data), "--name", f"node{i}", "--linger-s", str(LINGER_S)]
            data.mkdir(exist_ok=True)
            self._hand_certificate(i, data)
            self.nodes.append(self._start(self.net.exec_prefix(i), argv, f"node{i}", data))
            self._wait(lambda n=i + 1: len(self._status().nodes) >= n, 120, f"node{i} to join")

    def _start_prometheus(self) -> None:
        targets = [f"{self.host_ip(i)}:{METRICS_PORT}" for i in range(len(self.roles))]
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
            "scrape_configs": [
                {
                    "job_name": "swarm-coordinator",
                    "static_configs": [{"targets": [f"{self.coordinator_ip}:9100"]}],
                },
                {"job_name": "swarm-nodes", "static_configs": [{"targets": targets}]},
            ],
        }
        path = self.folder / "prometheus.yml"
        path.write_text(json.dumps(config))  # JSON is YAML
        argv = ["prometheus", f"--config.file={path}", f"--storage.tsdb.path={self.folder / 'tsdb'}"]
        argv.append(f"--web.listen-address={self.coordinator_ip}:{PROMETHEUS_PORT}")
        self.prometheus = self._start(self.net.control_prefix, argv, "prometheus", self.folder)

    def _status(self):
        try:
            self.poller.poll()
        except Exception:  # not serving yet
            return None
        return self.poller

    def _wait(self, done, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            exited = [p.args[-1] for p in self.group.procs if p.poll() not in (None,)]
            if exited or time.monotonic() > deadline:
                raise RuntimeError(
                    f"waiting for {what}: processes exited {exited} or timed out; logs in {self.folder}"
                )
            time.sleep(0.5)

    def wait_complete(self, timeout: float = 600) -> StatusPoller:
        """Until the run is complete and every node has said Leave (they linger, serving metrics)."""

        def done() -> bool:
            return (
                self._status() is not None
                and self.poller.run_complete
                and all(n.left for n in self.poller.nodes)
            )

        self._wait(done, timeout, "the run to complete and every node to leave")
        return self.poller

    # -- looking at a host from inside it ---------------------------------------------------------

    def _in(self, host: int | None) -> list[str]:
        return self.net.control_prefix if host is None else self.net.exec_prefix(host)

    def fetch(self, url: str, host: int | None = None) -> bytes:
        """GET ``url`` from inside host ``host`` (None: the coordinator's host)."""
        argv = [*self._in(host), sys.executable, "-c", FETCH, url]
        return subprocess.run(argv, capture_output=True, check=True, timeout=60).stdout

    def health(self, address: str, service: str = "", host: int | None = None, node: bool = False) -> str:
        """The gRPC health status (e.g. ``SERVING``) of ``address`` (a node's when ``node``), asked
        over TLS from inside ``host``."""
        argv = [
            *self._in(host),
            sys.executable,
            "-c",
            HEALTH,
            address,
            service,
            str(self.folder / "certs/ca.pem"),
        ]
        argv += [NODE_SERVER_NAME] if node else []
        return subprocess.run(argv, capture_output=True, text=True, check=True, timeout=60).stdout.strip()

    def swarm_status(self, host: int, *flags: str) -> str:
        """The recipe's ``swarm status`` run on host ``host`` (in its node's folder, holding ca.pem)."""
        argv = [*self._in(host), *command(STATUS, self.coordinator_ip), *flags]
        cwd = self.folder / f"node{host}"
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=cwd)
        if done.returncode:
            raise RuntimeError(f"swarm status failed: {done.stderr}")
        return done.stdout

    def log(self, name: str) -> str:
        return (self.folder / f"{name}.log").read_text() + (self.folder / f"{name}.err").read_text()


@contextlib.contextmanager
def running(plan: MultiHostPlan, folder: Path) -> Iterator[MultiHostSwarm]:
    """A started :class:`MultiHostSwarm` whose run has completed."""
    with MultiHostSwarm(plan, folder) as swarm:
        swarm.start()
        swarm.wait_complete()
        yield swarm


def run(plan: MultiHostPlan, codecs: dict[str, CodecConfig]) -> list[dict]:
    """The benchmark section: the recipe's swarm on its emulated hosts, once per codec, side by side."""
    rows = []
    for name, codec in codecs.items():
        case = dataclasses.replace(plan, codec=codec)
        with tempfile.TemporaryDirectory(prefix="swarm-multihost-") as tmp, running(case, Path(tmp)) as swarm:
            status = json.loads(swarm.fetch(f"http://{swarm.coordinator_ip}:{METRICS_PORT}/status"))
            steps = swarm.poller.steps[2:] or swarm.poller.steps  # past process start-up
            seconds = sum(s.wall_seconds for s in steps)
            logs = [swarm.log(f"node{i}") for i in range(len(plan.roles))]
            rows.append(
                {
                    "codec": name,
                    "hosts": len(plan.roles) + 1,
                    "link_mbps": plan.mbps,
                    "steps": len(swarm.poller.steps),
                    "tokens_per_s": sum(s.tokens for s in steps) / seconds if seconds else 0.0,
                    "bytes_per_token": status["rates"]["bytes_per_token"],
                    "compression_ratio": status["rates"]["compression_ratio"],
                    "dht_joined": sum("DHT joined at" in log for log in logs),
                    "dht_fallback": sum("DHT unavailable" in log for log in logs),
                }
            )
    for row in rows:
        row["speedup_vs_first"] = row["tokens_per_s"] / rows[0]["tokens_per_s"]
    return rows
