"""Emulated slow links: network namespaces, a bridge, veth pairs and ``tc tbf`` rate limits.

Topology of one :class:`EmulatedNetwork` ``N`` (namespace names carry the owner's pid
and an instance counter, so parallel and aborted runs never collide)::

    netns N-h{i}  eth0 10.213.0.{i+2}/24  [tbf: what host i sends]
                    |  veth
    netns N-br    p{i} [tbf: what host i receives] -- br0 -- pc
                                                              |  veth (unshaped)
    netns N-ctl   eth0 10.213.0.1/24  (optional control host, e.g. a coordinator)

A host in ``nat`` is a home network instead: ``N-h{i}`` becomes its router (the public address
and the shaped access link, ``iptables`` MASQUERADE out of ``eth0``, and no inbound forwarding:
only packets of connections opened from inside come back), and its processes run in
``N-h{i}-lan`` at 192.168.{i+1}.2, which nothing outside can open a connection to::

    netns N-h{i}-lan  eth0 192.168.{i+1}.2/24, default via .1
                        |  veth
    netns N-h{i}      lan0 192.168.{i+1}.1/24, eth0 10.213.0.{i+2}/24 (as above)

Each host's access link is full duplex at ``mbps``: a ``tbf`` on the host's end of its
veth pair limits what it sends, one on the bridge's end limits what it receives. Every
namespace has ``lo`` up. Addresses exist only inside these namespaces and nothing
routes out of them, so instances cannot collide with each other or with the machine's
own networks (hence one fixed subnet); the root namespace gets no address. The kernel
has no ``netem``: these links add rate limits, not delay.
"""

from __future__ import annotations

import functools
import itertools
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Collection

SUBNET = "10.213.0"
IFNAME = "eth0"  # every host's interface inside its namespace
IPTABLES = "iptables"
QUEUE_MS = 100  # tbf queue (the time a packet may wait for tokens): a modest access-link buffer
_instances = itertools.count()


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if done.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


def _tc(ns: str, *args: str) -> None:
    done = subprocess.run(["tc", "-n", ns, *args], capture_output=True, text=True, timeout=30)
    if done.returncode:
        raise RuntimeError(f"tc -n {ns} {' '.join(args)}: {done.stderr.strip()}")


def _in(ns: str, *args: str) -> None:
    """Run a command inside namespace ``ns``; RuntimeError if it fails."""
    done = subprocess.run(["ip", "netns", "exec", ns, *args], capture_output=True, text=True, timeout=30)
    if done.returncode:
        raise RuntimeError(f"{' '.join(args)} in {ns}: {done.stderr.strip()}")


def _tbf(mbps: float) -> list[str]:
    """tbf arguments for ``mbps``; the bucket holds >= 4 ms of traffic and >= 32 KiB (GSO frames)."""
    burst = max(32 * 1024, int(mbps * 1e6 / 8 * 0.004))
    return ["tbf", "rate", f"{mbps}mbit", "burst", str(burst), "latency", f"{QUEUE_MS}ms"]


def list_namespaces() -> list[str]:
    done = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30, check=True)
    return [line.split()[0] for line in done.stdout.splitlines() if line.strip()]


@functools.cache
def available() -> tuple[bool, str]:
    """Whether this machine can build an :class:`EmulatedNetwork`, and if not, why."""
    if os.geteuid() != 0:
        return False, "network namespaces need root"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return False, f"missing {', '.join(missing)} (iproute2)"
    ns = f"sws-{os.getpid()}-{next(_instances)}-probe"  # cleanup_stale() finds it if left behind
    try:
        _ip("netns", "add", ns)
        _ip("-n", ns, "link", "add", "b0", "type", "bridge")
        _ip("-n", ns, "link", "add", "v0", "type", "veth", "peer", "name", "v1")
        _tc(ns, "qdisc", "add", "dev", "v0", "root", *_tbf(10))
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        return False, f"cannot build a namespace with a bridge, veth and tbf: {e}"
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
    return True, ""


@functools.cache
def nat_available() -> tuple[bool, str]:
    """Whether this machine can put an :class:`EmulatedNetwork` host behind NAT, and if not, why."""
    ok, reason = available()
    if not ok:
        return ok, reason
    if shutil.which(IPTABLES) is None:
        return False, "missing iptables (apt-get install iptables)"
    ns = f"sws-{os.getpid()}-{next(_instances)}-probe"
    try:
        _ip("netns", "add", ns)
        _in(ns, IPTABLES, "-t", "nat", "-A", "POSTROUTING", "-o", "lo", "-j", "MASQUERADE")
        _in(ns, IPTABLES, "-A", "FORWARD", "-m", "conntrack", "--ctstate", "ESTABLISHED", "-j", "ACCEPT")
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        return False, f"cannot MASQUERADE in a namespace: {e}"
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
    return True, ""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        pass
    return True


def cleanup_stale(prefix: str = "sws", include_live: bool = False) -> list[str]:
    """Delete the namespaces of ``prefix`` left by processes that no longer run (or all of them)."""
    pattern = re.compile(rf"^{re.escape(prefix)}-(\d+)-\d+-")
    deleted = []
    for ns in list_namespaces():
        m = pattern.match(ns)
        if m and (include_live or not _alive(int(m.group(1)))):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
            deleted.append(ns)
    return deleted


class EmulatedNetwork:
    """``n_hosts`` namespaces on one bridge, each behind a full-duplex ``mbps`` access link.

    Use as a context manager: ``__exit__`` deletes every namespace it made (also on
    errors and Ctrl-C). Kill the processes started inside first: a namespace lives on
    while a process still runs in it.
    """

    available = staticmethod(available)

    def __init__(
        self, n_hosts: int, mbps: float, prefix: str = "sws", control: bool = False, nat: Collection[int] = ()
    ):
        if not 1 <= n_hosts <= 250:
            raise ValueError(f"n_hosts={n_hosts} must lie in [1, 250]")
        if mbps <= 0:
            raise ValueError(f"mbps={mbps} must be positive")
        if not set(nat) <= set(range(n_hosts)):
            raise ValueError(f"nat={sorted(nat)} names hosts outside 0..{n_hosts - 1}")
        self.n_hosts, self.mbps, self.control, self.nat = n_hosts, mbps, control, frozenset(nat)
        self.name = f"{prefix}-{os.getpid()}-{next(_instances)}"
        self.bridge_ns = f"{self.name}-br"
        self.hosts = [f"{self.name}-h{i}" for i in range(n_hosts)]
        self.control_ns = f"{self.name}-ctl"
        self._made: list[str] = []

    def host_ip(self, i: int) -> str:
        """The address host ``i``'s programs bind: behind NAT a private one nobody outside reaches."""
        return f"192.168.{i + 1}.2" if i in self.nat else self.public_ip(i)

    def public_ip(self, i: int) -> str:
        """Host ``i``'s address on the shared network (its router's, behind NAT)."""
        return f"{SUBNET}.{i + 2}"

    def exec_prefix(self, i: int) -> list[str]:
        """The command prefix that runs a program inside host ``i`` (behind its NAT, if it has one)."""
        return ["ip", "netns", "exec", self.hosts[i] + ("-lan" if i in self.nat else "")]

    @property
    def control_ip(self) -> str:
        self._need_control()
        return f"{SUBNET}.1"

    @property
    def control_prefix(self) -> list[str]:
        self._need_control()
        return ["ip", "netns", "exec", self.control_ns]

    def partition(self, i: int, j: int) -> None:
        """Hosts ``i`` and ``j`` (not behind NAT) drop every packet between them; both still reach
        everyone else."""
        for a, b in ((i, j), (j, i)):
            _in(self.hosts[a], IPTABLES, "-A", "INPUT", "-s", self.public_ip(b), "-j", "DROP")
            _in(self.hosts[a], IPTABLES, "-A", "OUTPUT", "-d", self.public_ip(b), "-j", "DROP")

    def block_tcp_port(self, i: int, port: int) -> None:
        """Host ``i`` can no longer open TCP connections to ``port`` anywhere (a policy-routing
        rule: its connects fail at once, as behind a firewall that rejects them)."""
        _ip("-n", self.hosts[i], "rule", "add", "ipproto", "tcp", "dport", str(port), "prohibit")

    def _need_control(self) -> None:
        if not self.control:
            raise ValueError("this network was built without a control host (control=True)")

    def __enter__(self) -> EmulatedNetwork:
        try:
            self._build()
        except BaseException:
            self._teardown()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._teardown()

    def _add_ns(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._made.append(ns)
        _ip("-n", ns, "link", "set", "lo", "up")

    def _build(self) -> None:
        self._add_ns(self.bridge_ns)
        _ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.bridge_ns, "link", "set", "br0", "up")
        ports = [(ns, f"p{i}", self.public_ip(i), True) for i, ns in enumerate(self.hosts)]
        if self.control:
            ports.append((self.control_ns, "pc", f"{SUBNET}.1", False))
        for ns, port, address, shaped in ports:
            self._add_ns(ns)
            peer = ["peer", "name", IFNAME, "netns", ns]
            _ip("-n", self.bridge_ns, "link", "add", port, "type", "veth", *peer)
            _ip("-n", self.bridge_ns, "link", "set", port, "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", IFNAME)
            _ip("-n", ns, "link", "set", IFNAME, "up")
            if shaped:
                _tc(ns, "qdisc", "add", "dev", IFNAME, "root", *_tbf(self.mbps))
                _tc(self.bridge_ns, "qdisc", "add", "dev", port, "root", *_tbf(self.mbps))
        for i in sorted(self.nat):
            self._put_behind_nat(i)

    def _put_behind_nat(self, i: int) -> None:
        """Host ``i``'s namespace becomes the router of a LAN holding its programs (module docstring)."""
        router, lan, private = self.hosts[i], self.hosts[i] + "-lan", f"192.168.{i + 1}"
        self._add_ns(lan)
        _ip("-n", router, "link", "add", "lan0", "type", "veth", "peer", "name", IFNAME, "netns", lan)
        _ip("-n", router, "addr", "add", f"{private}.1/24", "dev", "lan0")
        _ip("-n", router, "link", "set", "lan0", "up")
        _ip("-n", lan, "addr", "add", f"{private}.2/24", "dev", IFNAME)
        _ip("-n", lan, "link", "set", IFNAME, "up")
        _ip("-n", lan, "route", "add", "default", "via", f"{private}.1")
        _in(router, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1")
        masquerade = ["-s", f"{private}.0/24", "-o", IFNAME, "-j", "MASQUERADE"]
        _in(router, IPTABLES, "-t", "nat", "-A", "POSTROUTING", *masquerade)
        established = ["-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"]
        _in(router, IPTABLES, "-A", "FORWARD", "-i", IFNAME, "-o", "lan0", *established)
        _in(router, IPTABLES, "-A", "FORWARD", "-i", IFNAME, "-o", "lan0", "-j", "DROP")

    def _teardown(self) -> None:
        """Delete every namespace made (their veths and the bridge go with them); Ctrl-C waits."""
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            while self._made:
                subprocess.run(["ip", "netns", "del", self._made.pop()], capture_output=True, timeout=30)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
