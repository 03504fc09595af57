"""A multi-host rig for tests: Linux network namespaces joined by veth pairs (issue 22).

    root ns (the test) ── 10.231.9.0/30 ──┐
    ns "w1"  10.231.1.2 ── 10.231.1.0/30 ─┤
    ns "w2"  10.231.2.2 ── 10.231.2.0/30 ─┼── ns "broker" (10.231.k.1 on each link)
    ns "edge" 10.231.3.2 ─ 10.231.3.0/30 ─┘   (API gateway and jobs runner)

Every host reaches the broker namespace over its own link (and the other hosts through it, the
broker namespace forwarding), so a link can be cut (`partition`: `ip link set down` on both ends,
packets are dropped, no RST is sent) or healed for one host alone. Only addresses of these namespaces are used. Namespace names carry the test's pid and a
counter so concurrent runs never collide; `NetRig.close()` (also on failure, as a context
manager) deletes them and, with them, every veth.

Latency and loss: `tc qdisc ... netem` needs the kernel's sch_netem, which some kernels (this
project's VMs among them) lack; `netem_available()` tells. Without it, `Relay` emulates a slow,
lossy link in user space: a TCP relay in the broker namespace that delays every chunk by
`delay_ms` each way (in order) and holds a chunk for one retransmission timeout with
probability `loss` (what a lost TCP segment costs the application: a head-of-line stall).

Needs root and iproute2 (`ip`); the `netns_rig` fixture (tests/conftest.py) skips, or fails
under LANESERVE_REQUIRE_ALL=1, with `rig_missing()`'s reason otherwise.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from tests.harness import Stack, free_port

HB = 0.5  # s between heartbeats, both ways
BROKER_LIVENESS = 4  # the broker loses a silent worker after 2 s
WORKER_LIVENESS = 30  # a worker gives up on a silent broker after 15 s: it outlives a partition
WORKERS = ("w1", "w2")
HOSTS = {"w1": 1, "w2": 2, "edge": 3, "root": 9}  # host -> link number (10.231.N.0/30)
_counter = itertools.count()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=90)


def rig_missing() -> str | None:
    """Why this process cannot build namespaces (None when it can)."""
    if os.geteuid() != 0:
        return "the network-namespace rig needs root"
    if shutil.which("ip") is None:
        return "the network-namespace rig needs iproute2 (`ip`)"
    probe = f"lsprobe{os.getpid()}"
    try:
        res = _ip("netns", "add", probe, check=False)
    except subprocess.TimeoutExpired:
        return "`ip netns add` did not return within 90 s (the host is stuck on namespaces)"
    if res.returncode != 0:
        return f"`ip netns add` failed: {res.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def netem_available(ns: str, dev: str) -> bool:
    """Whether `tc qdisc add ... netem` works on `dev` in namespace `ns` (removed again)."""
    if shutil.which("tc") is None:
        return False
    cmd = ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "netem"]
    ok = subprocess.run([*cmd, "delay", "0ms"], capture_output=True, timeout=10).returncode == 0
    if ok:
        subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"],
                       capture_output=True, timeout=10)  # fmt: skip
    return ok


@dataclass
class NetRig:
    """The namespaces above; `ns[host]` is a namespace name, `addr(host)` the broker's address
    on `host`'s link, `host_addr(host)` the host's own."""

    tag: str = field(default_factory=lambda: f"ls{os.getpid() % 100000}x{next(_counter)}")
    ns: dict[str, str] = field(default_factory=dict)
    relays: list[subprocess.Popen] = field(default_factory=list)

    def __enter__(self) -> NetRig:
        try:
            self.build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @staticmethod
    def addr(host: str) -> str:
        return f"10.231.{HOSTS[host]}.1"

    @staticmethod
    def host_addr(host: str) -> str:
        return f"10.231.{HOSTS[host]}.2"

    def _dev(self, host: str, side: str) -> str:
        return f"{self.tag}{side}{HOSTS[host]}"  # under 15 characters

    def build(self) -> None:
        self.ns["broker"] = f"{self.tag}-broker"
        _ip("netns", "add", self.ns["broker"])
        _ip("-n", self.ns["broker"], "link", "set", "lo", "up")
        for host in HOSTS:
            peer = self._dev(host, "h")
            hub = self._dev(host, "b")
            if host == "root":
                _ip("link", "add", peer, "type", "veth", "peer", "name", hub,
                    "netns", self.ns["broker"])  # fmt: skip
                _ip("addr", "add", f"{self.host_addr(host)}/30", "dev", peer)
                _ip("link", "set", peer, "up")
            else:
                self.ns[host] = f"{self.tag}-{host}"
                _ip("netns", "add", self.ns[host])
                _ip("-n", self.ns[host], "link", "set", "lo", "up")
                _ip("-n", self.ns[host], "link", "add", peer, "type", "veth", "peer", "name",
                    hub, "netns", self.ns["broker"])  # fmt: skip
                _ip("-n", self.ns[host], "addr", "add", f"{self.host_addr(host)}/30", "dev", peer)
                _ip("-n", self.ns[host], "link", "set", peer, "up")
            _ip("-n", self.ns["broker"], "addr", "add", f"{self.addr(host)}/30", "dev", hub)
            _ip("-n", self.ns["broker"], "link", "set", hub, "up")
            if host != "root":  # every host reaches the others through the broker namespace
                _ip("-n", self.ns[host], "route", "add", "default", "via", self.addr(host))
        subprocess.run([*self.wrap("broker"), "sysctl", "-qw", "net.ipv4.ip_forward=1"],
                       check=True, timeout=10)  # fmt: skip
        # The root namespace reaches the rig's hosts (this route goes with the veth).
        _ip("route", "add", "10.231.0.0/16", "via", self.addr("root"))

    def wrap(self, host: str) -> list[str]:
        """The command prefix that runs a program on `host` ("broker", "w1", "w2", "edge")."""
        return ["ip", "netns", "exec", self.ns[host]]

    def partition(self, host: str) -> None:
        """Cut `host`'s link: its packets are dropped silently (both ends down)."""
        self._link(host, "down")

    def heal(self, host: str) -> None:
        self._link(host, "up")

    def _link(self, host: str, state: str) -> None:
        _ip("-n", self.ns["broker"], "link", "set", self._dev(host, "b"), state)
        _ip("-n", self.ns[host], "link", "set", self._dev(host, "h"), state)

    def relay(self, host: str, port: int, to_port: int, delay_ms: float, loss: float) -> int:
        """A `Relay` in the broker namespace on `host`'s link address: `port` -> `to_port`
        (loopback). Returns `port`; stopped by `close()`."""
        self._relay(self.wrap("broker"), f"{self.addr(host)}:{port}", to_port, delay_ms, loss)
        return port

    def expose_root(self, port: int, to_port: int) -> str:
        """Make the root namespace's loopback service on `to_port` (e.g. PostgreSQL) reachable
        from the rig at the returned HOST:PORT (a plain relay in the root namespace)."""
        listen = f"{self.host_addr('root')}:{port}"
        self._relay([], listen, to_port, 0.0, 0.0)
        return listen

    def _relay(self, wrap: list[str], listen: str, to_port: int, delay_ms: float, loss: float):
        argv = [sys.executable, "-m", "tests.netrelay", "--listen", listen, "--to",
                f"127.0.0.1:{to_port}", "--delay-ms", str(delay_ms), "--loss", str(loss)]  # fmt: skip
        root = Path(__file__).resolve().parents[1]
        self.relays.append(subprocess.Popen([*wrap, *argv], cwd=root))

    def close(self) -> None:
        for proc in self.relays:
            proc.kill()
            proc.wait(timeout=10)
        self.relays.clear()
        _ip("link", "del", self._dev("root", "h"), check=False)
        for name in self.ns.values():
            _ip("netns", "del", name, check=False)
        self.ns.clear()


HB = 0.5  # s between heartbeats, both ways
BROKER_LIVENESS = 4  # the broker loses a silent worker after 2 s
WORKER_LIVENESS = 30  # a worker gives up on a silent broker after 15 s: it outlives a partition
WORKERS = ("w1", "w2")


class RigStack:
    """A running multi-host stack: `stack` (children in namespaces), `rig` (the namespaces)."""

    def __init__(self, tmp: Path, rig: NetRig, db_url: str | None = None) -> None:
        from laneserve.broker.curve import generate_keys

        self.rig, self.tmp = rig, tmp
        self.keys = generate_keys(tmp / "keys", list(WORKERS))
        self.front_port, self.back_port = free_port(), free_port()
        self.stack = Stack(
            tmp, db_url=db_url, liveness=BROKER_LIVENESS, hb=HB, lanes="batch", wait_s=60.0
        )
        self.stack.front = f"tcp://{rig.addr('root')}:{self.front_port}"  # for the test's status
        self.stack.wraps = {"broker": rig.wrap("broker"), "jobs-runner": rig.wrap("edge")}
        self.stack.wraps |= {f"worker-{w}": rig.wrap(w) for w in WORKERS}

    def start(self, runners: tuple[str, ...] = ("jobs-runner",), *runner_args: str) -> None:
        """The broker, and jobs runners `runners` on the edge host (workers: `start_worker`)."""
        self.stack.start_broker(
            "--front", f"tcp://0.0.0.0:{self.front_port}",
            "--back", f"tcp://0.0.0.0:{self.back_port}",
            "--curve-server-key", str(self.keys.server_secret),
            "--curve-allow", str(self.keys.allow_dir),
        )  # fmt: skip
        for name in runners:
            self.stack.wraps[name] = self.rig.wrap("edge")
            self.stack.start_jobs_runner("--broker", self.edge_front, "--max-in-flight", "16",
                                         *runner_args, name=name)  # fmt: skip

    @property
    def edge_front(self) -> str:
        """The broker's front socket as the edge host reaches it."""
        return f"tcp://{self.rig.addr('edge')}:{self.front_port}"

    def start_worker(self, name: str, port: int | None = None, lanes: str = "batch") -> None:
        """Synthetic worker `name` ("w1", "w2") on its host, CURVE to the broker (through a relay
        listening on `port` when given)."""
        back = f"tcp://{self.rig.addr(name)}:{port or self.back_port}"
        curve = ["--curve-server-public", str(self.keys.server_public)]
        curve += ["--curve-client-key", str(self.keys.clients[name])]
        self.stack.start_worker(name, "--synthetic-step-ms", "20", *curve, back=back,
                                lanes=lanes, liveness=WORKER_LIVENESS)  # fmt: skip

    def start_api(self, name: str) -> str:
        """Gateway `name` on the edge host (no key, no tokenizer); returns its base URL."""
        port = free_port()
        self.stack.wraps[name] = self.rig.wrap("edge")
        args = ["--broker", self.edge_front, "--host", self.rig.host_addr("edge")]
        args += ["--port", str(port), "--db", self.stack.db_url]
        self.stack.spawn(name, ["laneserve.commands.api", *args])
        return f"http://{self.rig.host_addr('edge')}:{port}"

    def counter(self, key: str) -> int:
        st = self.stack.try_status()
        return st["counters"].get(key, 0) if st else -1
