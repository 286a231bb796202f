"""``swarm up``: a coordinator and N node daemons as separate processes on loopback.

Every process is real (its own interpreter, gRPC server, DHT peer); only the addresses
are local. Progress comes from the coordinator's ``Status`` RPC; each process's output
goes to a log file in the run folder. Ctrl-C (or any failure) stops every process:
SIGINT first (an immediate stop; SIGTERM would make each node leave gracefully after a
snapshot cut), SIGKILL for those that do not exit within the grace period.

The processes may also run elsewhere, e.g. each in its own network namespace
(:mod:`bench.netns`): a command prefix per process and the address each binds. A
coordinator started behind a prefix may be unreachable from here, so the launcher then
also starts a :func:`relay` behind the same prefix, from a Unix socket (the file
system is shared across network namespaces) to the coordinator, and polls through it.

With ``chaos`` a :class:`~swarm.launch.chaos.ChaosMonkey` ``kill -9``s a random stage-hosting
node every few seconds (or a whole stage with its keepers) and starts a fresh node in each one's
place (a volunteer coming back), so the run keeps its standbys; the summary reports what each
kill cost.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm import tqdm

from swarm._proto.swarm.v1 import coordinator_pb2, coordinator_pb2_grpc
from swarm.coordinator.settings import CoordinatorSettings
from swarm.launch.chaos import ChaosMonkey
from swarm.net.netaddr import split_host_port
from swarm.net.relay import splice
from swarm.net.tls import INSECURE, Security, cli_flags

if TYPE_CHECKING:  # not imported at run time: the relay process starts without torch
    from swarm.core.config import RunConfig

LISTENING = re.compile(r"coordinator listening on (\S+)")
RELAYING = re.compile(r"relay listening on (\S+)")
GRACE_S = 10.0
EXIT_GRACE_S = 30.0  # a node that said Leave at the run's end and still runs after this is stopped
STATE_FILE = "coordinator.sqlite"  # in the run folder; the coordinator writes the model beside it
WARMUP_STEPS = 2


@dataclass
class SwarmSummary:
    steps: int
    losses: list[float]
    seconds: float
    tokens: int
    wire_bytes_forward: int
    wire_bytes_backward: int
    boundaries: int
    node_logs: list[Path] = field(default_factory=list)
    step_summaries: list = field(default_factory=list)  # coordinator_pb2.StepSummary per step
    epochs_restarted: int = 0
    chaos: dict | None = None  # ChaosMonkey.summary() when nodes were killed on purpose
    model_dir: Path | None = None  # the trained model the coordinator wrote (None: not written)

    @property
    def tokens_per_second(self) -> float:
        """Steady-state throughput: tokens over summed step durations, past the warm-up steps."""
        return steady_tokens_per_second(self.step_summaries)

    @property
    def steady_steps(self) -> list:
        """The steps after :data:`WARMUP_STEPS` (process start-up, caches), or all if there are no more."""
        return steady(self.step_summaries)

    @property
    def wire_bytes_per_token(self) -> float:
        """Serialized bytes crossing one boundary per token, forward + backward."""
        total = self.wire_bytes_forward + self.wire_bytes_backward
        return total / max(1, self.boundaries) / max(1, self.tokens)


def steady(steps: Sequence) -> list:
    """The step summaries after :data:`WARMUP_STEPS` (process start-up, caches), or all if no more."""
    return list(steps[WARMUP_STEPS:]) or list(steps)


def steady_tokens_per_second(steps: Sequence) -> float:
    """Tokens over the summed durations of the steady steps (:func:`steady`)."""
    kept = steady(steps)
    seconds = sum(x.wall_seconds for x in kept)
    return sum(x.tokens for x in kept) / seconds if seconds else 0.0


class ProcessGroup:
    """Child processes that are all stopped together, whatever happens."""

    def __init__(self):
        self.procs: list[subprocess.Popen] = []

    def start(
        self, args: list[str], log_path: Path, cwd: Path | None = None, env: dict[str, str] | None = None
    ) -> subprocess.Popen:
        """Start ``args`` (stderr to ``log_path``, stdout piped) with ``env`` added to this environment."""
        log = open(log_path, "w")  # noqa: SIM115 - closed with the process
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=log, text=True, env=env, cwd=cwd)
        proc.log = log  # type: ignore[attr-defined]
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        deadline = time.monotonic() + GRACE_S
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            p.log.close()  # type: ignore[attr-defined]


def tee(proc: subprocess.Popen, log_path: Path, lines: list[str]) -> threading.Thread:
    """Copy a child's stdout to its log (and a list, for the caller) on a background thread."""

    def pump() -> None:
        with open(log_path, "w") as log:
            for line in proc.stdout:
                lines.append(line)
                log.write(line)
                log.flush()

    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    return thread


def _last_error(path: Path) -> str:
    """The most telling line of a process's stderr: a gRPC error's details, else the last error line."""
    lines = [x.strip() for x in path.read_text(errors="replace").splitlines() if "fork_posix" not in x]
    for marker in ("details =", "Error", "error"):
        hits = [x for x in lines if marker in x]
        if hits:
            return hits[-1]
    return next((x for x in reversed(lines) if x), "(no output)")


def wait_for_line(lines: list[str], pattern: re.Pattern, proc: subprocess.Popen, timeout: float) -> re.Match:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in lines:
            if m := pattern.search(line):
                return m
        if proc.poll() is not None:
            raise RuntimeError(
                f"process exited with code {proc.returncode} before printing {pattern.pattern!r}"
            )
        time.sleep(0.05)
    raise TimeoutError(f"no {pattern.pattern!r} within {timeout}s")


def up(
    config: RunConfig,
    run_dir: str | Path,
    nodes: int | None = None,
    stages_per_node: int = 1,
    link_mbps: float = 0.0,
    link_latency_ms: float = 0.0,
    device: str = "cpu",
    use_dht: bool = True,
    dead_after: float = CoordinatorSettings.dead_after_s,
    progress: bool = True,
    timeout: float = 3600.0,
    launch_prefix: Callable[[int], list[str]] | None = None,
    node_host: Callable[[int], str] | None = None,
    coordinator_prefix: list[str] | None = None,
    coordinator_host: str | None = None,
    standbys: int = 0,
    chaos: ChaosMonkey | None = None,
    metrics_base_port: int | None = None,
    tls: bool = False,
    dial_only: int = 0,
    relay: bool = False,
    connect_timeout: float | None = None,
    snapshot_keepers: int | None = None,
) -> SwarmSummary:
    """Run ``config`` on a local swarm; returns when every node has finished (or raises).

    ``launch_prefix(i)`` / ``coordinator_prefix``: commands that node ``i`` / the
    coordinator run behind (e.g. ``ip netns exec NS``); ``node_host(i)`` /
    ``coordinator_host``: the address each binds and announces (default: no prefix, 127.0.0.1).
    ``dead_after``: seconds without a heartbeat before the coordinator drops a node (raise it
    for very slow links, where heartbeats queue behind the frames). ``standbys``: extra nodes
    that wait to replace a lost one. ``chaos``: kills nodes as it decides (each replaced by a fresh one).
    ``metrics_base_port``: the coordinator serves ``/metrics`` and ``/status`` on it, node ``i``
    ``/metrics`` on the next ports (printed); None: no metrics endpoints. ``tls``: a fresh CA
    in ``run_dir/certs`` and mutual TLS on every channel; otherwise clear text (``--insecure``
    where an address is not loopback). ``dial_only``: the first that many nodes accept no inbound
    stream (``--listen ''``, as behind NAT); ``relay``: the coordinator runs a relay for the links
    between such nodes (``--relay-port``). ``connect_timeout``: how long a node waits for a
    boundary stream to open before its epoch fails (None: the node's default).
    ``snapshot_keepers``: the coordinator's ``--snapshot-keepers`` (None: its default).
    """
    run = Path(run_dir)
    run.mkdir(parents=True, exist_ok=True)
    nodes = nodes or -(-config.n_stages // stages_per_node)
    if nodes * stages_per_node < config.n_stages:
        raise ValueError(f"{nodes} nodes x {stages_per_node} stages cannot host {config.n_stages} stages")
    token = secrets.token_hex(16)
    status_socket = Path(tempfile.gettempdir()) / f"swarm-status-{token[:16]}.sock"
    security, flags = _transport_security(run, tls, coordinator_host, node_host is not None)
    launch = _Launch(run, ProcessGroup(), {"SWARM_TOKEN": token}, flags, use_dht, metrics_base_port)
    restore_sigterm = _sigterm_exits()
    try:
        address = _start_coordinator(
            launch, config, coordinator_prefix or [], coordinator_host, dead_after, relay, snapshot_keepers
        )
        status_address = address
        if coordinator_prefix:
            status_address = _start_relay(launch, coordinator_prefix, status_socket, address)
        swarm = _Nodes(
            launch,
            address,
            stages_per_node,
            device,
            link_mbps,
            link_latency_ms,
            launch_prefix,
            node_host,
            dial_only=dial_only,
            connect_timeout=connect_timeout,
        )
        for _ in range(nodes + standbys):
            swarm.start()
        if metrics_base_port is not None:
            _print_metrics(metrics_base_port, coordinator_host or "127.0.0.1", swarm)
        watch = status_command(status_address, launch.flags("operator"))
        print(f"coordinator {address}; watch the run: {watch}")
        start = time.monotonic()
        poller = StatusPoller(status_address, security, coordinator_host or "127.0.0.1")
        churn = functools.partial(_churn, chaos, poller, swarm, config.n_stages) if chaos else None
        try:
            end = _follow(config, poller, swarm.procs, progress, timeout, swarm.killed, churn)
        finally:
            poller.close()
        summary = _result(config, swarm, poller, chaos, end - start)
    finally:
        launch.group.stop()  # the coordinator finishes writing the model before it exits
        restore_sigterm()
        if coordinator_prefix:
            status_socket.unlink(missing_ok=True)
    from swarm.coordinator.export import default_model_dir  # not at import: the relay process has no torch

    model = default_model_dir(run / STATE_FILE)
    summary.model_dir = model if (model / "manifest.json").is_file() else None
    return summary


def status_command(address: str, flags: list[str]) -> str:
    """The ``swarm status`` command line that watches the coordinator at ``address``."""
    return shlex.join(["swarm", "status", "--coordinator", address, *flags, "--watch", "2"])


def _sigterm_exits() -> Callable[[], None]:
    """Make SIGTERM end this process as Ctrl-C does, through ``up``'s cleanup (every process it
    started is stopped), instead of at once with them left running; returns what undoes it."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None  # only the main thread may set handlers; its own stay in force

    def exit_cleanly(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, exit_cleanly)
    return lambda: signal.signal(signal.SIGTERM, previous)


def _python_m(module: str) -> list[str]:
    """The command that runs ``module`` with this interpreter."""
    return [sys.executable, "-m", module]


@dataclass
class _Launch:
    """What the processes of one ``up`` share: the run folder, their group, the token, TLS flags, the
    DHT, metrics ports (the coordinator's; node ``i`` serves on the next port + ``i``; None: none)."""

    run: Path
    group: ProcessGroup
    secret: dict[str, str]  # the join token, in the environment: a command line is visible in ps
    flags: Callable[[str], list[str]]  # the TLS flags of a certificate name
    use_dht: bool
    metrics_base_port: int | None

    def start(self, name: str, args: list[str], secret: bool) -> tuple[subprocess.Popen, list[str]]:
        """Start process ``name`` (``name.err``, ``name.log`` in the run folder); it and its stdout lines."""
        lines: list[str] = []
        proc = self.group.start(args, self.run / f"{name}.err", env=self.secret if secret else None)
        tee(proc, self.run / f"{name}.log", lines)
        return proc, lines


def _start_coordinator(
    launch: _Launch,
    config: RunConfig,
    prefix: list[str],
    host: str | None,
    dead_after: float,
    relay: bool = False,
    snapshot_keepers: int | None = None,
) -> str:
    """Serve ``config`` from a fresh state file behind ``prefix``; the gRPC address once it listens."""
    from swarm.coordinator.cli import serve_command  # not at import: the relay process has no torch

    (launch.run / "run.toml").write_text(config.to_toml())
    state = launch.run / STATE_FILE
    state.unlink(missing_ok=True)
    args = serve_command(
        config=launch.run / "run.toml",
        host=host,
        port=0,
        state=state,
        metrics_port=-1 if launch.metrics_base_port is None else launch.metrics_base_port,
        dead_after=dead_after,
        use_dht=launch.use_dht,
        security=launch.flags("coordinator"),
        relay_port=0 if relay else None,
        snapshot_keepers=snapshot_keepers,
    )
    proc, lines = launch.start("coordinator", [*prefix, *_python_m("swarm.coordinator.cli"), *args], True)
    return wait_for_line(lines, LISTENING, proc, 60).group(1)


def _start_relay(launch: _Launch, prefix: list[str], socket: Path, address: str) -> str:
    """A :func:`relay` from ``socket`` to ``address`` behind ``prefix``; the address to poll through."""
    args = [*prefix, *_python_m("swarm.launch.local_swarm"), "relay", str(socket), address]
    proc, lines = launch.start("relay", args, False)
    return wait_for_line(lines, RELAYING, proc, 60).group(1)


@dataclass
class _Nodes:
    """The node processes of one ``up``: ``node{i}`` is the ``i``-th started; killed ones are kept."""

    launch: _Launch
    coordinator: str
    stages: int
    device: str
    link_mbps: float
    link_latency_ms: float
    prefix: Callable[[int], list[str]] | None = None
    host: Callable[[int], str] | None = None
    dial_only: int = 0  # the first that many nodes accept no inbound stream
    connect_timeout: float | None = None
    procs: list[subprocess.Popen] = field(default_factory=list)
    killed: set[int] = field(default_factory=set)

    def start(self) -> None:
        """Start the next node."""
        from swarm.node.cli import join_command  # not at import: the relay process has no torch

        i = len(self.procs)
        args = join_command(
            self.coordinator,
            listen="" if i < self.dial_only else f"{self.host(i)}:0" if self.host else None,
            stages=self.stages,
            data_dir=self.launch.run / f"node{i}",
            device=self.device,
            link_mbps=self.link_mbps,
            link_latency_ms=self.link_latency_ms,
            name=f"node{i}",
            use_dht=self.launch.use_dht,
            metrics_port=self.metrics_port(i),
            connect_timeout=self.connect_timeout,
            security=self.launch.flags(f"node{i}"),
        )
        prefix = self.prefix(i) if self.prefix else []
        proc, _ = self.launch.start(f"node{i}", [*prefix, *_python_m("swarm.node.cli"), *args], True)
        self.procs.append(proc)

    def metrics_port(self, i: int) -> int | None:
        base = self.launch.metrics_base_port
        return None if base is None else base + 1 + i

    def address(self, i: int) -> str:
        """The host node ``i`` binds."""
        return self.host(i) if self.host else "127.0.0.1"

    def kill(self, name: str) -> None:
        """``kill -9`` node ``name``."""
        index = int(name.removeprefix("node"))
        self.procs[index].kill()
        self.killed.add(index)

    def failed(self) -> list[tuple[int, int]]:
        """(index, exit code) of the nodes that failed on their own."""
        return [
            (i, p.returncode)
            for i, p in enumerate(self.procs)
            if p.returncode not in (0, None) and i not in self.killed
        ]

    @property
    def logs(self) -> list[Path]:
        return [self.launch.run / f"node{i}.log" for i in range(len(self.procs))]


def _print_metrics(base_port: int, coordinator_host: str, swarm: _Nodes) -> None:
    print(f"metrics: coordinator http://{coordinator_host}:{base_port}/metrics (run JSON at /status)")
    for i in range(len(swarm.procs)):
        print(f"metrics: node{i} http://{swarm.address(i)}:{swarm.metrics_port(i)}/metrics")


def _churn(chaos: ChaosMonkey, poller: StatusPoller, swarm: _Nodes, n_stages: int) -> None:
    """When due, kill (kill -9) what the chaos monkey picks and start as many fresh nodes in their place."""
    chaos.observe({s.step: s.completed_at for s in poller.steps})
    if not chaos.due() or poller.run_complete:
        return
    for name in chaos.pick({n.node_name: list(n.stages) for n in poller.nodes if n.alive}, n_stages):
        swarm.kill(name)
        chaos.killed(name, len(poller.steps) - 1, poller.latest_cut)
        swarm.start()


def _result(
    config: RunConfig, swarm: _Nodes, poller: StatusPoller, chaos: ChaosMonkey | None, seconds: float
) -> SwarmSummary:
    """The run's summary; RuntimeError (with each failed node's telling line) if a node failed."""
    failed = swarm.failed()
    if failed:
        run = swarm.launch.run
        detail = "\n".join(f"node{i}: {_last_error(run / f'node{i}.err')}" for i, _ in failed)
        raise RuntimeError(f"nodes failed (index, exit code): {failed}; logs in {run}\n{detail}")
    summary = _summary(config, poller.steps, seconds, swarm.logs)
    summary.epochs_restarted = poller.epochs_restarted
    if chaos is not None:
        chaos.observe({s.step: s.completed_at for s in poller.steps})
        summary.chaos = chaos.summary() | {"kills_detail": [vars(k) for k in chaos.kills]}
    return summary


async def relay(socket_path: str, target: str) -> None:
    """Forward every connection to the Unix socket ``socket_path`` to ``target`` (HOST:PORT)."""
    host, port = split_host_port(target)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            upstream = await asyncio.open_connection(host, port)
        except OSError:
            writer.close()
            return
        with contextlib.suppress(ConnectionError, OSError):
            await splice((reader, writer), upstream)

    Path(socket_path).unlink(missing_ok=True)
    server = await asyncio.start_unix_server(handle, socket_path)
    print(f"relay listening on unix:{socket_path}", flush=True)
    async with server:
        await server.serve_forever()


def _transport_security(
    run: Path, tls: bool, coordinator_host: str | None, remote_nodes: bool
) -> tuple[Security, Callable[[str], list[str]]]:
    """The operator's own security and each process's TLS flags (by certificate name)."""
    if not tls:
        insecure = ["--insecure"] if coordinator_host or remote_nodes else []
        return INSECURE, lambda name: insecure
    from swarm.net import certs

    folder = run / "certs"
    shutil.rmtree(folder, ignore_errors=True)
    certs.init(folder, [coordinator_host or "127.0.0.1", "localhost"])
    certs.issue_node(folder, "operator")

    def flags(name: str) -> list[str]:
        if not (folder / f"{name}.pem").exists():
            certs.issue_node(folder, name)
        return cli_flags(folder, name)

    key_pair = (folder / "operator.pem", folder / "operator.key")
    return Security.from_files(folder / "ca.pem", *key_pair, mutual=True), flags


class StatusPoller:
    """Collects the coordinator's per-step summaries (redone steps: their latest run) as the run goes.

    ``server_name``: the name the coordinator's certificate holds (the address may be a relay).
    """

    def __init__(self, address: str, security: Security = INSECURE, server_name: str | None = None):
        self.channel = security.channel(address, server_name=server_name)
        self.stub = coordinator_pb2_grpc.CoordinatorStub(self.channel)
        self.steps: list[coordinator_pb2.StepSummary] = []
        self.nodes: list[coordinator_pb2.NodeStatus] = []
        self.run_complete = False
        self.epochs_restarted = 0
        self.resume_step = 0  # where the current plan epoch resumed
        self.latest_cut = -1  # the newest durable checkpoint cut (-1: none yet)
        self.reply: coordinator_pb2.StatusReply | None = None  # the whole of the last answer

    def poll(self) -> list[coordinator_pb2.StepSummary]:
        """The steps completed for the first time since the last poll."""
        reply = self.reply = self.stub.Status(coordinator_pb2.StatusRequest(since_step=0), timeout=10)
        new = list(reply.steps[len(self.steps) :])
        self.steps = list(reply.steps)
        self.nodes, self.run_complete = list(reply.nodes), reply.run_complete
        self.epochs_restarted, self.resume_step = reply.epochs_restarted, reply.resume_step
        self.latest_cut = reply.latest_cut - 1
        return new

    def close(self) -> None:
        self.channel.close()


def _follow(
    config: RunConfig,
    poller: StatusPoller,
    procs: list[subprocess.Popen],
    progress: bool,
    timeout: float,
    killed: set[int] = frozenset(),
    churn: Callable[[], None] | None = None,
) -> float:
    """Show step, loss, tokens/s and wire bytes/token until every node has exited (``churn``: kill
    a node whenever the chaos monkey says so); when the run ended (every node exited, or the run
    was complete and every node had said Leave: a straggler's exit does not count)."""
    bar = tqdm(total=config.train.steps, disable=not progress, desc="swarm", unit="step")
    deadline, t0 = time.monotonic() + timeout, time.monotonic()
    boundaries = max(1, config.n_stages - 1)
    done_at = None  # when the run was complete and every node had said Leave
    try:
        while any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for i, p in enumerate(procs) if i not in killed):
                return time.monotonic()
            if churn is not None:
                churn()
            if time.monotonic() > deadline:
                raise TimeoutError(f"the swarm did not finish within {timeout}s")
            if poller.run_complete and poller.nodes and all(n.left or not n.alive for n in poller.nodes):
                done_at = done_at or time.monotonic()
                if time.monotonic() - done_at > EXIT_GRACE_S:
                    _stop_stragglers(procs)
                    return done_at
            time.sleep(0.5)
            new = poller.poll()
            if new:
                tokens = sum(s.tokens for s in poller.steps)
                wire = sum(s.bytes_sent_forward + s.bytes_sent_backward for s in poller.steps)
                bar.update(len(new))
                bar.set_postfix(
                    loss=f"{new[-1].loss:.3f}",
                    tok_s=f"{tokens / (time.monotonic() - t0):.0f}",
                    B_tok=f"{wire / boundaries / max(1, tokens):.1f}",
                )
        poller.poll()
        return time.monotonic()
    finally:
        bar.close()


def _stop_stragglers(procs: list[subprocess.Popen]) -> None:
    """Stop the nodes still running ``EXIT_GRACE_S`` after they said Leave at the run's end."""
    for i, p in enumerate(procs):
        if p.poll() is None:
            print(f"warning: node{i} said Leave but did not exit within {EXIT_GRACE_S:.0f} s: stopping it")
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()


def _summary(config: RunConfig, steps: list, seconds: float, logs: list[Path]) -> SwarmSummary:
    return SwarmSummary(
        steps=len(steps),
        losses=[s.loss for s in steps],
        seconds=seconds,
        tokens=sum(s.tokens for s in steps),
        wire_bytes_forward=sum(s.bytes_sent_forward for s in steps),
        wire_bytes_backward=sum(s.bytes_sent_backward for s in steps),
        boundaries=config.n_stages - 1,
        node_logs=logs,
        step_summaries=list(steps),
    )


if __name__ == "__main__":  # python -m swarm.launch.local_swarm relay SOCKET HOST:PORT (see up)
    if len(sys.argv) != 4 or sys.argv[1] != "relay":
        sys.exit("usage: python -m swarm.launch.local_swarm relay SOCKET HOST:PORT")
    asyncio.run(relay(sys.argv[2], sys.argv[3]))
