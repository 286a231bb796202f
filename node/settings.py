"""What a volunteer chooses about its node, and every timeout, retry and backoff the node uses.

The defaults hold for a slow volunteer on a 50 Mbit/s link: a coordinator call may take
seconds, a stage of a large model may take minutes per step, and a coordinator restart
should look like a pause, not the end of the run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from swarm.io.manifest import CHUNK_BYTES
from swarm.net.channel import KeepAlive
from swarm.net.shaper import LinkProfile
from swarm.net.tls import INSECURE, Security
from swarm.runtime.faults import FaultSpec


@dataclass(frozen=True)
class Timeouts:
    rpc_s: float = 15.0  # one coordinator call
    retry_initial_s: float = 0.25  # first backoff after a failed coordinator call
    retry_max_s: float = 8.0  # backoff cap (each wait is jittered to 50-100%)
    coordinator_down_s: float = 900.0  # give up once the coordinator is unreachable this long
    connect_s: float = 60.0  # opening a boundary stream: dial retries, or waiting to be dialled
    step_s: float = 300.0  # a neighbour silent this long inside a step fails the step
    rotation_s: float = 600.0  # waiting for a subspace rotation the coordinator computes
    # After a broken boundary, wait this long for a new plan before reporting it: long enough for a
    # plan the coordinator already started to arrive (held heartbeats bring it in a round trip), short
    # because until someone reports, a killed neighbour is noticed only by its missed heartbeats.
    failure_grace_s: float = 0.2
    unreachable_grace_s: float = 2.0  # stay joined this long after finding no way to a peer (it learns too)
    leave_s: float = 120.0  # graceful leave: longest wait for the final cut before leaving anyway
    dht_bootstrap_s: float = 5.0  # a DHT whose initial peers stay silent this long is skipped
    upload_chunk_bytes: int = 1 << 20
    keepalive: KeepAlive = field(default_factory=KeepAlive)


@dataclass
class NodeSettings:
    """Everything a volunteer chooses about its node (the CLI maps flags onto this)."""

    coordinator: str
    token: str
    listen: str = "127.0.0.1:0"  # Stage service address; "" = dial-only (no inbound port)
    announce: str = ""  # address neighbours dial; default: the listen address, or for 0.0.0.0
    # the interface address that reaches the coordinator
    device: str = "auto"
    max_stages: int = 1
    data_dir: Path = field(default_factory=lambda: Path("swarm-node-data"))
    metrics_port: int = -1  # -1: no metrics server; 0: a free port
    metrics_host: str = ""  # default: the listen host, else the address that reaches the coordinator
    link: LinkProfile = field(default_factory=LinkProfile)
    use_dht: bool = True
    public_dht: bool = False
    dht_listen: str = ""  # DHT multiaddr; default: TCP on a free port of the metrics_host default
    name: str = ""
    relay_port: int | None = None  # run a relay for other nodes' links on the listen host (0: a free port)
    snapshot_mbps: float = 0.0  # cap on serving snapshot chunks to peers (0: the share below)
    snapshot_share: float = 0.5  # else this share of the uplink measured on boundary streams (0: none)
    snapshot_chunk_bytes: int = CHUNK_BYTES  # chunk size of the snapshots it takes
    timeouts: Timeouts = field(default_factory=Timeouts)
    fault: FaultSpec | None = None  # tests and the verification bench only: lie on purpose
    security: Security = INSECURE  # TLS of the coordinator channel, the Stage server and its streams
