"""Helpers for broker tests: a broker + synthetic workers as real processes on ipc:// sockets."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from broker.client import broker_status

ROOT = Path(__file__).resolve().parents[2]
HB = 0.2  # heartbeat interval for tests (s)
LIVENESS = 5  # -> a worker is lost after ~1 s of silence


class Stack:
    """A broker process plus any number of synthetic worker processes."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.front = f"ipc://{tmp}/front.sock"
        self.back = f"ipc://{tmp}/back.sock"
        self.broker: subprocess.Popen | None = None
        self.workers: dict[str, subprocess.Popen] = {}
        self._logs: list = []

    def _spawn(self, module: str, args: list[str], log_name: str) -> subprocess.Popen:
        log = open(self.tmp / f"{log_name}.log", "wb")  # noqa: SIM115 - closed in stop()
        self._logs.append(log)
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        return subprocess.Popen(
            [sys.executable, "-m", module, *args], stdout=log, stderr=log, cwd=ROOT, env=env
        )

    def start_broker(self, *extra: str) -> None:
        args = ["--front", self.front, "--back", self.back, "--heartbeat-interval", str(HB)]
        args += ["--liveness", str(LIVENESS), *extra]
        self.broker = self._spawn("laneserve.commands.broker", args, "broker")

    def start_worker(
        self,
        name: str,
        *extra: str,
        lanes: str = "interactive,batch",
        synthetic: bool = True,
        heartbeat_s: float = HB,
        liveness: int = LIVENESS,
    ) -> subprocess.Popen:
        args = ["--synthetic"] if synthetic else []
        args += ["--broker", self.back, "--worker-id", name, "--lanes", lanes]
        args += ["--heartbeat-interval", str(heartbeat_s), "--liveness", str(liveness), *extra]
        proc = self._spawn("laneserve.commands.worker", args, f"worker-{name}")
        self.workers[name] = proc
        return proc

    def status(self, timeout_s: float = 3.0) -> dict:
        return broker_status(self.front, timeout_s=timeout_s)

    def wait_workers(self, names: set[str], timeout_s: float = 20.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.broker is not None and self.broker.poll() is not None:
                raise AssertionError(f"broker exited; logs: {self.logs()}")
            try:
                st = self.status(timeout_s=1.0)
            except TimeoutError:
                continue
            if {w["worker_id"] for w in st["workers"]} >= names:
                return st
            time.sleep(0.1)
        raise AssertionError(f"workers {names} not registered; logs: {self.logs()}")

    def wait_status(self, pred, timeout_s: float = 10.0) -> dict:
        deadline = time.monotonic() + timeout_s
        st: dict = {}
        while time.monotonic() < deadline:
            st = self.status()
            if pred(st):
                return st
            time.sleep(0.1)
        raise AssertionError(f"condition not met; last status {st}")

    def logs(self) -> str:
        out = []
        for path in sorted(self.tmp.glob("*.log")):
            out.append(f"--- {path.name}\n{path.read_text(errors='replace')[-3000:]}")
        return "\n".join(out)

    def stop(self) -> None:
        procs = [*self.workers.values(), *([self.broker] if self.broker else [])]
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        for proc in procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for log in self._logs:
            log.close()


def run(coro, timeout_s: float = 60.0):
    """Run a coroutine with a hard time bound."""
    return asyncio.run(asyncio.wait_for(coro, timeout_s))
