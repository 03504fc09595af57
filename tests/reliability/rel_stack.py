"""Helpers for reliability tests: broker, workers, recorder, jobs runner and gateway as real
processes on loopback (ipc:// sockets in a short temp directory, HTTP on 127.0.0.1).

Every wait is bounded in time; every process is stopped (SIGINT, then SIGKILL) by ``stop()``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from broker.client import broker_status

ROOT = Path(__file__).resolve().parents[2]
HB = 0.2  # heartbeat interval (s)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(pred: Callable[[], object], timeout_s: float, what: str, poll_s: float = 0.1):
    """Poll ``pred`` until it returns something truthy (returned) or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(poll_s)


def run(coro, timeout_s: float = 60.0):
    """Run a coroutine with a hard time bound."""
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


class RelStack:
    """Named child processes sharing one temp directory, LANESERVE_HOME and SQLite database."""

    def __init__(self, tmp: Path, *, liveness: int = 10, hb: float = HB) -> None:
        self.tmp = tmp
        self.home = tmp / "home"
        self.home.mkdir(exist_ok=True)
        self.front = f"ipc://{tmp}/front.sock"
        self.back = f"ipc://{tmp}/back.sock"
        self.recorder_addr = f"ipc://{tmp}/recorder.sock"
        self.db_url = f"sqlite:///{self.home / 'laneserve.db'}"
        self.liveness = liveness
        self.hb = hb
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.procs: dict[str, subprocess.Popen] = {}
        self._logs: list = []
        self.env = dict(os.environ, PYTHONPATH=str(ROOT), LANESERVE_HOME=str(self.home))
        for key in ("LANESERVE_DB_URL", "LANESERVE_API_KEY", "LANESERVE_FAULT_CRASH"):
            self.env.pop(key, None)
        self.env.pop("LANESERVE_FAULT_STEP", None)

    # ------------------------------------------------------------------ processes

    def spawn(self, name: str, argv: list[str], env: dict | None = None) -> subprocess.Popen:
        log = open(self.tmp / f"{name}.log", "ab")  # noqa: SIM115 - closed in stop()
        self._logs.append(log)
        proc = subprocess.Popen(
            [sys.executable, "-m", *argv],
            stdout=log,
            stderr=log,
            cwd=ROOT,
            env=env or self.env,
        )
        self.procs[name] = proc
        return proc

    def start_broker(self, *extra: str, name: str = "broker") -> subprocess.Popen:
        args = ["--front", self.front, "--back", self.back, "--heartbeat-interval", str(self.hb)]
        args += ["--liveness", str(self.liveness), *extra]
        return self.spawn(name, ["laneserve.commands.broker", *args])

    def start_worker(
        self,
        name: str,
        *extra: str,
        lanes: str = "interactive,batch",
        synthetic: bool = True,
        back: str | None = None,
        env: dict | None = None,
    ) -> subprocess.Popen:
        args = ["--synthetic"] if synthetic else []
        args += ["--broker", back or self.back, "--worker-id", name, "--lanes", lanes]
        args += ["--heartbeat-interval", str(self.hb), "--liveness", str(self.liveness), *extra]
        return self.spawn(f"worker-{name}", ["laneserve.commands.worker", *args], env=env)

    def start_recorder(self, db_url: str | None = None) -> subprocess.Popen:
        args = ["recorder", "--recorder-addr", self.recorder_addr, "--db", db_url or self.db_url]
        args += ["--flush-interval", "0.1"]
        return self.spawn("recorder", ["laneserve.cli", *args])

    def start_jobs_runner(self, *extra: str) -> subprocess.Popen:
        """The jobs runner without a tokenizer (synthetic workers; no length check)."""
        args = ["--broker", self.front, "--db", self.db_url, "--poll-interval", "0.2"]
        argv = ["laneserve.commands.jobs_runner", *args, "--no-length-check", *extra]
        return self.spawn("jobs-runner", argv)

    def start_api(self, *extra: str) -> subprocess.Popen:
        args = ["--broker", self.front, "--port", str(self.port), "--db", self.db_url]
        return self.spawn("api", ["laneserve.commands.api", *args, *extra])

    def kill(self, name: str) -> None:
        proc = self.procs[name]
        proc.kill()
        proc.wait(timeout=10)

    def restart_dead(self, starters: dict[str, Callable[[], object]]) -> list[str]:
        """Mini-supervisor step: start again each named child that has exited."""
        restarted = []
        for name, start in starters.items():
            if self.procs[name].poll() is not None:
                start()
                restarted.append(name)
        return restarted

    def stop(self) -> None:
        procs = list(self.procs.values())
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 8
        for proc in procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for log in self._logs:
            log.close()

    # ------------------------------------------------------------------ observation

    def alive(self, name: str) -> bool:
        return self.procs[name].poll() is None

    def status(self, timeout_s: float = 2.0) -> dict:
        return broker_status(self.front, timeout_s=timeout_s)

    def try_status(self) -> dict | None:
        try:
            return self.status(timeout_s=1.0)
        except (TimeoutError, OSError):
            return None

    def worker_ids(self) -> set[str]:
        st = self.try_status()
        return {w["worker_id"] for w in st["workers"]} if st else set()

    def wait_workers(self, names: set[str], timeout_s: float = 30.0) -> dict:
        def ready():
            st = self.try_status()
            return st if st and {w["worker_id"] for w in st["workers"]} >= names else None

        try:
            return wait_for(ready, timeout_s, f"workers {names}", poll_s=0.2)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.logs()}") from None

    def wait_api(self, timeout_s: float = 120.0) -> None:
        def up():
            if not self.alive("api"):
                raise AssertionError(f"api exited:\n{self.logs()}")
            try:
                return httpx.get(self.url + "/health", timeout=1.0).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(up, timeout_s, "the API's /health", poll_s=0.2)

    def log(self, name: str) -> str:
        path = self.tmp / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def logs(self, tail: int = 3000) -> str:
        out = []
        for path in sorted(self.tmp.glob("*.log")):
            out.append(f"--- {path.name}\n{path.read_text(errors='replace')[-tail:]}")
        return "\n".join(out)


# ---------------------------------------------------------------------------------- jobs


def chat_line(custom_id: str, content: str, max_tokens: int = 8) -> dict:
    body = {
        "model": "smollm2-135m",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
    }
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def submit_job(engine, tmp: Path, lines: list[dict]):
    """Create the input file and the batch through jobs.service; returns the Job row."""
    import json

    from jobs import service

    path = tmp / f"input-{time.monotonic_ns()}.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with path.open("rb") as f:
        file = service.create_file(engine, f, path.name)
    return service.create_batch(engine, file.id, "/v1/chat/completions")


def job_state(engine, job_id: str):
    from jobs import service

    return service.get_batch(engine, job_id)


def wait_job(engine, job_id: str, timeout_s: float, stack: RelStack | None = None, tick=None):
    """Wait for a terminal status; ``tick()`` runs every poll (e.g. a mini-supervisor)."""
    deadline = time.monotonic() + timeout_s
    job = None
    while time.monotonic() < deadline:
        job = job_state(engine, job_id)
        if job.status in ("completed", "failed", "cancelled", "expired"):
            return job
        if tick is not None:
            tick()
        time.sleep(0.2)
    logs = stack.logs() if stack else ""
    raise AssertionError(f"job {job_id} still {job and job.status} after {timeout_s}s\n{logs}")


def read_file_lines(engine, file_id: str | None) -> list[dict]:
    import json

    from jobs import service

    if file_id is None:
        return []
    return [json.loads(x) for x in service.file_content(engine, file_id).decode().splitlines()]


def report(scenario: str, **figures) -> None:
    """Print one scenario's figures (and append them to $LANESERVE_RELIABILITY_OUT if set), the
    source of docs/reliability.md's table."""
    import json

    line = json.dumps({"scenario": scenario, **figures})
    print(line)
    out = os.environ.get("LANESERVE_RELIABILITY_OUT")
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")
