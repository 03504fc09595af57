"""Helpers for jobs tests: broker + worker + jobs runner as real processes on ipc:// sockets."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from broker.client import broker_status

ROOT = Path(__file__).resolve().parents[2]
HB = 0.2  # heartbeat interval (s)
LIVENESS = 10  # intervals; generous on a loaded 2-core machine


class JobsStack:
    """A broker, workers (synthetic or the real bundled model) and a jobs runner."""

    def __init__(self, home: Path, db_url: str) -> None:
        self.home = home
        self.db_url = db_url
        self.sock_dir = Path(tempfile.mkdtemp(prefix="lsj"))  # short ipc paths
        self.front = f"ipc://{self.sock_dir}/front.sock"
        self.back = f"ipc://{self.sock_dir}/back.sock"
        self.procs: dict[str, subprocess.Popen] = {}
        self._logs: list = []

    def _spawn(self, name: str, module: str, args: list[str]) -> subprocess.Popen:
        log = open(self.home / f"{name}.log", "ab")  # noqa: SIM115 - closed in stop()
        self._logs.append(log)
        env = dict(os.environ, PYTHONPATH=str(ROOT), LANESERVE_HOME=str(self.home))
        proc = subprocess.Popen(
            [sys.executable, "-m", module, *args], stdout=log, stderr=log, cwd=ROOT, env=env
        )
        self.procs[name] = proc
        return proc

    def start_broker(self, *extra: str, recorder: bool = False) -> None:
        """The broker; with `recorder`, also a recorder writing timings to the same database."""
        args = ["--front", self.front, "--back", self.back, "--heartbeat-interval", str(HB)]
        args += ["--liveness", str(LIVENESS), *extra]
        if recorder:
            addr = f"ipc://{self.sock_dir}/recorder.sock"
            rec_args = ["--recorder-addr", addr, "--db", self.db_url, "--flush-interval", "0.1"]
            self._spawn("recorder", "laneserve.cli", ["recorder", *rec_args])
            args += ["--recorder", addr]
        self._spawn("broker", "laneserve.commands.broker", args)

    def broker_counters(self) -> dict:
        return broker_status(self.front, timeout_s=3.0)["counters"]

    def start_worker(self, name: str = "w1", *extra: str, model: str | None = None) -> None:
        args = ["--broker", self.back, "--worker-id", name, "--lanes", "batch"]
        args += ["--heartbeat-interval", str(HB), "--liveness", str(LIVENESS)]
        if model is None:
            args.append("--synthetic")
        else:
            args += ["--model", model, "--dtype", "float32"]
        self._spawn(name, "laneserve.commands.worker", [*args, *extra])

    def start_runner(self, *extra: str, model: str | None = None) -> subprocess.Popen:
        args = ["--broker", self.front, "--db", self.db_url, "--poll-interval", "0.2"]
        # the lines name the bundled alias, whatever path the worker loads it from
        args += (
            ["--model", model, "--model-name", "smollm2-135m"] if model else ["--no-length-check"]
        )
        return self._spawn("runner", "laneserve.commands.jobs_runner", [*args, *extra])

    def wait_workers(self, n: int, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise AssertionError(f"{name} exited ({proc.returncode}):\n{self.logs()}")
            try:
                if len(broker_status(self.front, timeout_s=1.0)["workers"]) >= n:
                    return
            except TimeoutError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"{n} workers not registered:\n{self.logs()}")

    def kill(self, name: str) -> None:
        proc = self.procs[name]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)

    def logs(self) -> str:
        out = []
        for path in sorted(self.home.glob("*.log")):
            out.append(f"--- {path.name}\n{path.read_text(errors='replace')[-4000:]}")
        return "\n".join(out)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for log in self._logs:
            log.close()
        shutil.rmtree(self.sock_dir, ignore_errors=True)


def write_jsonl(path: Path, lines: list) -> Path:
    """Each item: a dict (dumped as JSON) or a str (written as is)."""
    with path.open("w") as f:
        for item in lines:
            f.write((item if isinstance(item, str) else json.dumps(item)) + "\n")
    return path


def chat_line(
    custom_id: str | None, content: str, max_tokens: int = 8, model: str = "smollm2-135m"
):
    line = {
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "temperature": 0,
        },
    }
    if custom_id is not None:
        line["custom_id"] = custom_id
    return line


def submit(engine, path: Path, **kwargs):
    from jobs import service

    endpoint = kwargs.pop("endpoint", "/v1/chat/completions")
    with path.open("rb") as f:
        file = service.create_file(engine, f, path.name)
    return service.create_batch(engine, file.id, endpoint, **kwargs)


def wait_job(engine, job_id: str, statuses, stack: JobsStack | None = None, timeout_s=120.0):
    from jobs import service

    deadline = time.monotonic() + timeout_s
    job = None
    while time.monotonic() < deadline:
        job = service.get_batch(engine, job_id)
        if job.status in statuses:
            return job
        time.sleep(0.2)
    logs = stack.logs() if stack else ""
    raise AssertionError(f"job {job_id} not in {statuses}: {job and job.status}\n{logs}")


def read_lines(engine, file_id: str | None) -> list[dict]:
    from jobs import service

    if file_id is None:
        return []
    return [json.loads(x) for x in service.file_content(engine, file_id).decode().splitlines()]
