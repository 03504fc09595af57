"""Helpers for API tests: broker + workers + `laneserve api` as real processes on loopback.

Sockets are ipc:// in a short temp directory; the gateway listens on 127.0.0.1 on a free port.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from broker.client import broker_status

ROOT = Path(__file__).resolve().parents[2]
HB = 0.2  # heartbeat interval (s)
LIVENESS = 25  # generous: a CPU busy loading a model must not look dead
API_KEY = "test-key-0123456789"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ApiStack:
    """A broker, any number of workers and one gateway, each a real process."""

    def __init__(self, tmp: Path, home: Path) -> None:
        self.tmp = tmp
        self.home = home
        self.front = f"ipc://{tmp}/front.sock"
        self.back = f"ipc://{tmp}/back.sock"
        self.recorder = f"ipc://{tmp}/recorder.sock"
        self.db_path = home / "laneserve.db"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.procs: dict[str, subprocess.Popen] = {}
        self._logs: list = []
        self.env = dict(os.environ, PYTHONPATH=str(ROOT), LANESERVE_HOME=str(home))
        self.env.pop("LANESERVE_DB_URL", None)
        self.env.pop("LANESERVE_API_KEY", None)

    def _spawn(self, name: str, module: str, args: list[str]) -> subprocess.Popen:
        log = open(self.tmp / f"{name}.log", "wb")  # noqa: SIM115 - closed in stop()
        self._logs.append(log)
        proc = subprocess.Popen(
            [sys.executable, "-m", module, *args], stdout=log, stderr=log, cwd=ROOT, env=self.env
        )
        self.procs[name] = proc
        return proc

    def start_broker(self, *extra: str) -> None:
        args = ["--front", self.front, "--back", self.back, "--heartbeat-interval", str(HB)]
        self._spawn(
            "broker", "laneserve.commands.broker", [*args, "--liveness", str(LIVENESS), *extra]
        )

    def start_recorder(self) -> None:
        args = ["--recorder-addr", self.recorder, "--db", f"sqlite:///{self.db_path}"]
        self._spawn("recorder", "laneserve.cli", ["recorder", *args])

    def start_worker(self, name: str, *extra: str, lanes: str = "interactive,batch") -> None:
        args = ["--broker", self.back, "--worker-id", name, "--lanes", lanes]
        args += ["--heartbeat-interval", str(HB), "--liveness", str(LIVENESS), *extra]
        self._spawn(f"worker-{name}", "laneserve.commands.worker", args)

    def start_jobs_runner(self, *extra: str) -> None:
        args = ["jobs-runner", "--broker", self.front, "--db", f"sqlite:///{self.db_path}"]
        self._spawn("jobs-runner", "laneserve.cli", [*args, "--poll-interval", "0.2", *extra])

    def stop_proc(self, name: str) -> None:
        proc = self.procs.pop(name)
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def start_api(self, *extra: str, api_key: str | None = API_KEY) -> None:
        args = ["--broker", self.front, "--port", str(self.port)]
        args += ["--db", f"sqlite:///{self.db_path}"]
        if api_key:
            args += ["--api-key", api_key]
        self._spawn("api", "laneserve.commands.api", [*args, *extra])

    def status(self) -> dict:
        return broker_status(self.front, timeout_s=2.0)

    def wait_workers(self, names: set[str], timeout_s: float = 120.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                st = self.status()
            except TimeoutError:
                continue
            if {w["worker_id"] for w in st["workers"]} >= names:
                return st
            time.sleep(0.2)
        raise AssertionError(f"workers {names} not registered; logs:\n{self.logs()}")

    def wait_api(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"api not up; logs:\n{self.logs()}")

    def _check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise AssertionError(f"{name} exited with {proc.returncode}; logs:\n{self.logs()}")

    def logs(self) -> str:
        out = []
        for path in sorted(self.tmp.glob("*.log")):
            out.append(f"--- {path.name}\n{path.read_text(errors='replace')[-4000:]}")
        return "\n".join(out)

    def stop(self) -> None:
        procs = list(self.procs.values())
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for log in self._logs:
            log.close()


@contextlib.contextmanager
def real_model_stack(gguf: Path, *worker_extra: str, recorder: bool = False) -> Iterator[ApiStack]:
    """Broker (+ recorder writing SQLite) + one real SmolLM2 worker (float32, up to 16
    sequences, plus ``worker_extra`` flags) + gateway with a key, serving ``gguf`` as
    ``smollm2``."""
    tmp = Path(tempfile.mkdtemp(prefix="lsr", dir="/tmp"))
    home = tmp / "home"
    home.mkdir()
    stack = ApiStack(tmp, home)
    try:
        if recorder:
            stack.start_recorder()
            stack.start_broker("--recorder", stack.recorder)
        else:
            stack.start_broker()
        stack.start_worker(
            "real", "--model", str(gguf), "--dtype", "float32", "--max-num-seqs", "16",
            "--kv-cache-memory", "256MiB", *worker_extra,
        )  # fmt: skip
        stack.start_api("--model", str(gguf), "--served-model-name", "smollm2")
        stack.wait_workers({"real"}, timeout_s=300)
        stack.wait_api(timeout_s=300)
        yield stack
    finally:
        stack.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def wait_batch(client, batch_id: str, stack: ApiStack, timeout_s: float = 120.0):
    """Poll ``batch_id`` with the openai client until it ends; returns the batch object."""
    deadline = time.monotonic() + timeout_s
    b = client.batches.retrieve(batch_id)
    while b.status not in ("completed", "failed", "cancelled", "expired"):
        assert time.monotonic() < deadline, (b, stack.logs())
        time.sleep(0.3)
        b = client.batches.retrieve(batch_id)
    return b
