"""Prometheus metrics shared by the node daemon and the coordinator, and the HTTP endpoint serving them.

Each process owns one :class:`Metrics` with its own registry (so several can live in
one test process) and serves it with :meth:`Metrics.serve` on ``--metrics-host``/
``--metrics-port``. The same HTTP server answers ``/healthz`` (liveness) and, on the
coordinator, ``/status`` (the run as JSON for dashboards; see :mod:`swarm.ops.status`).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

ROLES = ("node", "coordinator")
SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    """The counters, gauges and histograms of one process (``role``: "node" or "coordinator")."""

    def __init__(self, role: str):
        if role not in ROLES:
            raise ValueError(f"metrics role {role!r} is not one of {ROLES}")
        self.registry = CollectorRegistry()
        self.role = role
        r = self.registry
        # -- both roles --
        self.loss = Gauge("swarm_loss", "Training loss of the last step (last stage)", registry=r)
        self.step = Gauge("swarm_step", "Last completed optimizer step", ["stage"], registry=r)
        self.subspace_version = Gauge("swarm_subspace_version", "Subspace version in force", registry=r)
        self.rejected = Counter(
            "swarm_rejected_messages",
            "Messages rejected as malformed, stale or unauthenticated",
            ["reason"],
            registry=r,
        )
        self.plan_epoch = Gauge(
            "swarm_plan_epoch", "Plan epoch in force (this node's, or the run's)", registry=r
        )
        self.checkpoint_step = Gauge(
            "swarm_checkpoint_step", "Last step of the newest stored snapshot (or complete cut)", registry=r
        )
        self._checkpoint_at = time.time()  # process start until the first snapshot
        self.checkpoint_age = Gauge(
            "swarm_checkpoint_age_seconds",
            "Seconds since the newest snapshot (node) or complete cut (coordinator); since start if none",
            registry=r,
        )
        self.checkpoint_age.set_function(lambda: time.time() - self._checkpoint_at)
        self.audits = Counter(
            "swarm_audits",
            "Sampled recomputations of a sibling replica's microbatch (node: run here; coordinator: "
            "reported), by outcome (match, mismatch, unavailable: the evidence was gone or unreachable)",
            ["outcome"],
            registry=r,
        )
        if role == "node":
            self._node(r)
        else:
            self._coordinator(r)

    def _node(self, r: CollectorRegistry) -> None:
        """Traffic, compute, streams and recovery of the stages one node hosts."""
        self.tokens = Counter("swarm_tokens", "Tokens processed", ["stage"], registry=r)
        self.wire_bytes = Counter(
            "swarm_wire_bytes",
            "Bytes of boundary frames sent or received (serialized protobuf)",
            ["boundary", "direction", "io"],
            registry=r,
        )
        self.dense_bytes = Counter(
            "swarm_dense_equivalent_bytes",
            "What the same boundary traffic would be as uncompressed bf16 activations",
            ["boundary", "direction", "io"],
            registry=r,
        )
        self.step_seconds = Histogram(
            "swarm_step_seconds",
            "Wall-clock duration of one optimizer step",
            ["stage"],
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=r,
        )
        self.stage_tokens_per_second = Gauge(
            "swarm_stage_tokens_per_second",
            "Tokens per second of the stage's last step",
            ["stage"],
            registry=r,
        )
        self.microbatch_compute = Histogram(
            "swarm_microbatch_compute_seconds",
            "Forward or backward compute of one microbatch (incl. boundary encode/decode)",
            ["stage", "pass"],
            buckets=SECONDS_BUCKETS,
            registry=r,
        )
        self.microbatch_wire = Histogram(
            "swarm_microbatch_wire_seconds",
            "Time one microbatch's frame waited to enter the boundary's send queue (backpressure)",
            ["boundary", "direction"],
            buckets=SECONDS_BUCKETS,
            registry=r,
        )
        self.queue_depth = Gauge(
            "swarm_stream_queue_depth",
            "Frames received on a boundary and not yet computed",
            ["boundary", "direction"],
            registry=r,
        )
        self.live_microbatches = Gauge(
            "swarm_stage_live_microbatches",
            "Most microbatches whose activations the stage held at once during its last step",
            ["stage"],
            registry=r,
        )
        self.send_queue_depth = Gauge(
            "swarm_send_queue_depth",
            "Messages queued on a boundary for sending (compute runs ahead of the wire up to a bound)",
            ["boundary"],
            registry=r,
        )
        self.averaging_bytes = Counter(
            "swarm_averaging_bytes",
            "Gradient bytes this replica sent in its stage's averaging rounds (parts and averages)",
            ["stage"],
            registry=r,
        )
        self.averaging_seconds = Histogram(
            "swarm_averaging_seconds",
            "Duration of one averaging round of a replicated stage",
            ["stage"],
            buckets=SECONDS_BUCKETS,
            registry=r,
        )
        self.reconnects = Counter(
            "swarm_stream_reconnects",
            "Boundary streams opened again after an earlier stream of that boundary ended",
            ["boundary"],
            registry=r,
        )
        self.off_subspace = Gauge(
            "swarm_off_subspace_fraction",
            "||(I-P)G||/||G|| at the stage's inbound boundary",
            ["stage"],
            registry=r,
        )
        self.epoch_restarts = Counter(
            "swarm_epoch_restarts", "Times this node rebuilt its stages for a new plan epoch", registry=r
        )
        self.phase = Gauge("swarm_node_phase", "Node phase (the NodePhase enum value)", registry=r)
        self.snapshot_pause = Histogram(
            "swarm_snapshot_pause_seconds",
            "Training stood still while a stage's state was copied to host memory: at a cut (cut), "
            "after every step of a replicated run (own)",
            ["kind"],
            buckets=SECONDS_BUCKETS,
            registry=r,
        )
        self.snapshot_served_bytes = Counter(
            "swarm_snapshot_served_bytes",
            "Snapshot chunk bytes this node served to fetching peers",
            registry=r,
        )
        self.snapshot_serving_mbps = Gauge(
            "swarm_snapshot_serving_mbps",
            "The cap on serving snapshot chunks when last applied: --snapshot-mbps, else --snapshot-share "
            "of the uplink measured on boundary streams (0: unpaced)",
            registry=r,
        )
        self.snapshot_fetched_bytes = Counter(
            "swarm_snapshot_fetched_bytes",
            "Snapshot bytes this node fetched and verified, from peers or from the coordinator",
            ["source"],
            registry=r,
        )
        self.snapshot_bad_chunks = Counter(
            "swarm_snapshot_bad_chunks",
            "Snapshot chunks a holder served that failed their hash or size (fetched elsewhere)",
            registry=r,
        )
        self.checkpoint_bytes = Counter(
            "swarm_checkpoint_uploaded_bytes", "Snapshot bytes uploaded to the coordinator", registry=r
        )
        self.pending_reports = Gauge(
            "swarm_pending_reports",
            "Step reports queued for the coordinator, not yet acknowledged",
            registry=r,
        )

    def _coordinator(self, r: CollectorRegistry) -> None:
        """Membership, and the run as a whole over its recent steps."""
        self.nodes_alive = Gauge("swarm_nodes_alive", "Nodes with a recent heartbeat", registry=r)
        self.stage_nodes = Gauge("swarm_stage_nodes", "Alive nodes hosting each stage", ["stage"], registry=r)
        self.run_tokens_per_second = Gauge(
            "swarm_run_tokens_per_second", "Pipeline throughput over the recent steps", registry=r
        )
        self.run_bytes_per_token = Gauge(
            "swarm_run_bytes_per_token",
            "Serialized boundary bytes per token per boundary, forward + backward, over the recent steps",
            registry=r,
        )
        self.run_compression_ratio = Gauge(
            "swarm_run_compression_ratio",
            "Dense bf16 activation bytes over serialized boundary bytes, over the recent steps",
            registry=r,
        )
        self.evictions = Counter(
            "swarm_evictions",
            "Nodes evicted: a neighbour received invalid frames from them (bad_input), they accused a "
            "second neighbour (accuser), their join token was revoked (revoked), or distinct sibling "
            "replicas' audits found them computing wrong (audit), or another auditor's clean audits "
            "contradicted their mismatch reports (audit_accuser)",
            ["reason"],
            registry=r,
        )
        self.stage_rebuilds = Counter(
            "swarm_stage_rebuilds",
            "Stages rebuilt from their neighbours' snapshots because no copy of their own was left "
            "(checkpoint.lost_stage = 'rebuild')",
            registry=r,
        )
        self.screen_drifted_frames = Counter(
            "swarm_screen_drifted_frames",
            "Activation frames a downstream screen flagged as drifting from their moving statistics, "
            "by sending stage (evidence for an audit; never an eviction on its own)",
            ["stage"],
            registry=r,
        )
        self.commitment_checks = Counter(
            "swarm_commitment_checks",
            "Boundary crossings (step, boundary, direction) whose senders' and receivers' frame "
            "commitments were compared",
            registry=r,
        )
        self.commitment_mismatches = Counter(
            "swarm_commitment_mismatches",
            "Compared crossings whose senders' and receivers' frame commitments disagreed",
            ["direction"],
            registry=r,
        )
        self.unreachable_joins = Counter(
            "swarm_unreachable_joins",
            "Joins placed as dial-only: no address announced (no_address), or the coordinator could not "
            "reach the one announced (no_answer)",
            ["reason"],
            registry=r,
        )

    def checkpointed(self, step: int, at: float | None = None) -> None:
        """A snapshot (node) or complete cut (coordinator) of ``step`` exists since ``at`` (unix time)."""
        self.checkpoint_step.set(step)
        self._checkpoint_at = time.time() if at is None else at

    def serve(
        self, port: int, host: str = "127.0.0.1", status: Callable[[], dict] | None = None
    ) -> MetricsServer:
        """Serve ``/metrics`` and ``/healthz`` (and ``/status`` from ``status()``) on ``host:port``."""
        return MetricsServer(self.registry, host, port, status)


class MetricsServer:
    """A threaded HTTP server for one process: ``/metrics``, ``/healthz``, optionally ``/status``.

    ``port`` 0 picks a free one (see :attr:`port`). Runs on a daemon thread until :meth:`close`.
    """

    def __init__(
        self, registry: CollectorRegistry, host: str, port: int, status: Callable[[], dict] | None = None
    ):
        routes: dict[str, Callable[[], tuple[str, bytes]]] = {
            "/metrics": lambda: (CONTENT_TYPE_LATEST, generate_latest(registry)),
            "/healthz": lambda: ("text/plain; charset=utf-8", b"ok\n"),
        }
        if status is not None:
            routes["/status"] = lambda: ("application/json", json.dumps(status(), indent=1).encode())

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                route = routes.get(self.path.split("?", 1)[0])
                if route is None:
                    self.send_error(404, f"no {self.path}; try {', '.join(routes)}")
                    return
                try:
                    content_type, body = route()
                except Exception as e:  # a status that cannot be built now: say so, keep serving
                    self.send_error(503, f"{type(e).__name__}: {e}")
                    return
                self.send_response(200)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:  # scrapes every few seconds: keep stderr quiet
                pass

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self.host, self.port = host, self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, name="metrics-http", daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
