"""A multi-host rig for tests: Linux network namespaces joined by veth pairs (issue 22).

    root ns (the test) ── 10.231.9.0/30 ──┐
    ns "w1"  10.231.1.2 ── 10.231.1.0/30 ─┤
    ns "w2"  10.231.2.2 ── 10.231.2.0/30 ─┼── ns "broker" (10.231.k.1 on each link)
    ns "edge" 10.231.3.2 ─ 10.231.3.0/30 ─┘   (API gateway and jobs runner)

Every host reaches the broker namespace over its own link, so a link can be cut (`partition`:
`ip link set down` on both ends, packets are dropped, no RST is sent) or healed for one host
alone. Only addresses of these namespaces are used. Namespace names carry the test's pid and a
counter so concurrent runs never collide; `NetRig.close()` (also on failure, as a context
manager) deletes them and, with them, every veth.

Latency and loss: `tc qdisc ... netem` needs the kernel's sch_netem, which some kernels (this
project's VMs among them) lack; `netem_available()` tells. Without it, `Relay` emulates a slow,
lossy link in user space: a TCP relay in the broker namespace that delays every chunk by
`delay_ms` each way (in order) and holds a chunk for one retransmission timeout with
probability `loss` (what a lost TCP segment costs the application: a head-of-line stall).

Needs root and iproute2 (`ip`); `rig_or_skip()` skips (or fails under LANESERVE_REQUIRE_ALL=1)
with the reason otherwise.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from tests.conftest import skip_or_fail

HOSTS = {"w1": 1, "w2": 2, "edge": 3, "root": 9}  # host -> link number (10.231.N.0/30)
_counter = itertools.count()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=20)


def rig_or_skip() -> None:
    """Skip (fail in CI) unless this process can build namespaces."""
    if os.geteuid() != 0:
        skip_or_fail("the network-namespace rig needs root")
    if shutil.which("ip") is None:
        skip_or_fail("the network-namespace rig needs iproute2 (`ip`)")
    probe = f"lsprobe{os.getpid()}"
    res = _ip("netns", "add", probe, check=False)
    if res.returncode != 0:
        skip_or_fail(f"`ip netns add` failed: {res.stderr.strip()}")
    _ip("netns", "del", probe, check=False)


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
        argv = [sys.executable, "-m", "tests.netrelay", "--listen", f"{self.addr(host)}:{port}",
                "--to", f"127.0.0.1:{to_port}", "--delay-ms", str(delay_ms), "--loss", str(loss)]  # fmt: skip
        root = Path(__file__).resolve().parents[1]
        self.relays.append(subprocess.Popen([*self.wrap("broker"), *argv], cwd=root))
        return port

    def close(self) -> None:
        for proc in self.relays:
            proc.kill()
            proc.wait(timeout=10)
        self.relays.clear()
        _ip("link", "del", self._dev("root", "h"), check=False)
        for name in self.ns.values():
            _ip("netns", "del", name, check=False)
        self.ns.clear()
