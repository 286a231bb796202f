"""Prometheus metrics shared by the node daemon and the coordinator.

Each process owns one :class:`Metrics` with its own registry (so several can live in
one test process) and serves it with :meth:`Metrics.serve` on ``--metrics-port``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server


class Metrics:
    """The counters, gauges and histograms of one process."""

    def __init__(self, role: str):
        self.registry = CollectorRegistry()
        r = self.registry
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
        self.loss = Gauge("swarm_loss", "Training loss of the last step (last stage)", registry=r)
        self.step = Gauge("swarm_step", "Last completed optimizer step", ["stage"], registry=r)
        self.off_subspace = Gauge(
            "swarm_off_subspace_fraction",
            "||(I-P)G||/||G|| at the stage's inbound boundary",
            ["stage"],
            registry=r,
        )
        self.subspace_version = Gauge("swarm_subspace_version", "Subspace version in force", registry=r)
        self.rejected = Counter(
            "swarm_rejected_messages",
            "Messages rejected as malformed, stale or unauthenticated",
            ["reason"],
            registry=r,
        )
        self.nodes_alive = Gauge("swarm_nodes_alive", "Nodes with a recent heartbeat", registry=r)
        self.plan_epoch = Gauge(
            "swarm_plan_epoch", "Plan epoch in force (this node's, or the run's)", registry=r
        )
        self.epoch_restarts = Counter(
            "swarm_epoch_restarts", "Times this node rebuilt its stages for a new plan epoch", registry=r
        )
        self.phase = Gauge("swarm_node_phase", "Node phase (the NodePhase enum value)", registry=r)
        self.checkpoint_step = Gauge(
            "swarm_checkpoint_step", "Last step of the newest stored snapshot (or complete cut)", registry=r
        )
        self.checkpoint_bytes = Counter(
            "swarm_checkpoint_uploaded_bytes", "Snapshot bytes uploaded to the coordinator", registry=r
        )
        self.pending_reports = Gauge(
            "swarm_pending_reports",
            "Step reports queued for the coordinator, not yet acknowledged",
            registry=r,
        )
        self.role = role

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Serve ``/metrics`` on ``host:port`` (port 0 picks a free one); returns the port."""
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        return server.server_port
