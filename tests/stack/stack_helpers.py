"""Helpers for the whole-stack tests: `laneserve` commands and `laneserve up` as real processes
with only LANESERVE_HOME pointing at the stack."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def link_model(home: Path, gguf: Path, hf_dir: Path) -> None:
    """Make the bundled alias resolve inside `home` without a download (symlinks to the cache)."""
    models = home / "models"
    models.mkdir(parents=True, exist_ok=True)
    (models / gguf.name).symlink_to(gguf)
    (models / hf_dir.name).symlink_to(hf_dir, target_is_directory=True)


def cli_env(home: Path) -> dict[str, str]:
    env = dict(os.environ, LANESERVE_HOME=str(home), PYTHONPATH=str(ROOT))
    for name in ("LANESERVE_DB_URL", "LANESERVE_API_KEY"):
        env.pop(name, None)
    return env


def laneserve(home: Path, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
    """Run `laneserve ARGS` with only LANESERVE_HOME pointing at the stack."""
    return subprocess.run(
        [sys.executable, "-m", "laneserve.cli", *args],
        env=cli_env(home),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


class UpProcess:
    """`laneserve up` as a child process, with its stack.json once ready."""

    def __init__(self, home: Path, *args: str) -> None:
        self.home = home
        self.log = home / "up.log"
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "laneserve.commands.up", *args],
                env=cli_env(home),
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.info: dict = {}

    def wait_ready(self, timeout_s: float = 300.0) -> dict:
        deadline = time.monotonic() + timeout_s
        path = self.home / "stack.json"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"laneserve up exited {self.proc.returncode}:\n{self.logs()}")
            try:
                info = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError):
                info = {}
            if info.get("state") == "ready" and info.get("supervisor_pid") == self.proc.pid:
                self.info = info
                return info
            time.sleep(0.3)
        raise AssertionError(f"stack not ready after {timeout_s}s:\n{self.logs()}")

    def stack(self) -> dict:
        return json.loads((self.home / "stack.json").read_text())

    def logs(self) -> str:
        out = [f"--- up.log\n{self.log.read_text(errors='replace')[-4000:]}"]
        for path in sorted((self.home / "logs").glob("*.log")):
            out.append(f"--- {path.name}\n{path.read_text(errors='replace')[-3000:]}")
        return "\n".join(out)

    def stop(self, sig: int = signal.SIGINT, timeout_s: float = 90.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(
                f"laneserve up did not stop in {timeout_s}s:\n{self.logs()}"
            ) from None


def processes_mentioning(text: str) -> list:
    """Live processes whose command line contains `text` (e.g. a tmp LANESERVE_HOME path)."""
    import psutil

    found = []
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            cmd = " ".join(proc.info["cmdline"] or [])
            if text in cmd and proc.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found
