"""Stack discovery: `$LANESERVE_HOME/stack.json`, written by `laneserve up`.

`submit`, `jobs`, `status`, `chat` and `demo` find the running stack from `LANESERVE_HOME` alone
(DESIGN.md "Contracts and edge cases: Stack discovery"). The file is one JSON object::

    {
      "version": 1,
      "state": "starting" | "ready" | "stopping",
      "supervisor_pid": 1234,
      "started_at": 1764400000.0,          # unix seconds
      "api_url": "http://127.0.0.1:8000",
      "dashboard_url": "http://127.0.0.1:8501" | null,
      "broker_front": "ipc://.../broker-front.sock",
      "broker_back": "ipc://.../broker-back.sock",
      "recorder_addr": "ipc://.../recorder.sock",
      "db_url": "sqlite:////.../laneserve.db",
      "model": "smollm2-135m",
      "children": {"broker": 1235, "worker-0": 1236, ...}   # name -> pid
    }

It is replaced atomically (write to a temp file, `os.replace`) and removed when the supervisor
stops. A file whose `supervisor_pid` is gone is stale: `running_stack()` ignores it.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from laneserve.contracts.env import laneserve_home
from laneserve.contracts.procs import pid_alive

STACK_FILE = "stack.json"
STACK_VERSION = 1


class StackNotRunningError(RuntimeError):
    """No live `laneserve up` under this `$LANESERVE_HOME`."""


def stack_path(home: Path | None = None) -> Path:
    return (home or laneserve_home()) / STACK_FILE


def write_stack(info: dict[str, Any], home: Path | None = None) -> Path:
    """Atomically write `info` (plus `version`) to `$LANESERVE_HOME/stack.json`; return the path."""
    path = stack_path(home)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"version": STACK_VERSION, **info}
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".stack-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def read_stack(home: Path | None = None) -> dict[str, Any] | None:
    """The stack file as a dict, or None when absent or unreadable (no liveness check)."""
    try:
        data = json.loads(stack_path(home).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def running_stack(home: Path | None = None, *, ready: bool = True) -> dict[str, Any] | None:
    """The stack file when its supervisor is alive (and, with `ready`, fully started), else None."""
    info = read_stack(home)
    if info is None or not pid_alive(info.get("supervisor_pid")):
        return None
    if ready and info.get("state") != "ready":
        return None
    return info


def require_stack(home: Path | None = None) -> dict[str, Any]:
    """`running_stack()` or raise StackNotRunningError with a hint to start one."""
    info = running_stack(home)
    if info is None:
        raise StackNotRunningError(
            f"no running laneserve stack under {home or laneserve_home()} "
            "(start one with `laneserve up`)"
        )
    return info


def remove_stack(pid: int, home: Path | None = None) -> None:
    """Remove the stack file if it belongs to supervisor `pid`."""
    info = read_stack(home)
    if info is not None and info.get("supervisor_pid") == pid:
        stack_path(home).unlink(missing_ok=True)


def start_stack_process(
    home: Path,
    up_args: list[str],
    *,
    timeout_s: float = 900.0,
    env: dict[str, str] | None = None,
    watch_parent: bool = True,
) -> tuple[subprocess.Popen, dict[str, Any]]:
    """Run `laneserve up UP_ARGS` as a child under `home` (its output in `home/logs/up.log`), with
    `--parent-pid` set to this process unless `watch_parent` is False (then it outlives us, in its
    own session); return (process, stack.json dict) once it is ready.

    For `laneserve demo` and the benchmark scripts; stop it with `stop_stack_process`.

    Raises:
        RuntimeError: it exited or was not ready within `timeout_s` (the message ends with the
            tail of its log).
    """
    import sys
    import time

    home = Path(home).resolve()
    log_path = home / "logs" / "up.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "laneserve.commands.up", *up_args]
    if watch_parent:
        cmd += ["--parent-pid", str(os.getpid())]
    child_env = dict(env if env is not None else os.environ, LANESERVE_HOME=str(home))
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=child_env, start_new_session=True,
        )  # fmt: skip
    deadline = time.monotonic() + timeout_s
    while (info := running_stack(home)) is None:
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_stack_process(proc)
            tail = log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"`laneserve up` did not start; {log_path}:\n{tail}")
        time.sleep(0.3)
    return proc, info


def stop_stack_process(proc: subprocess.Popen, timeout_s: float = 60.0) -> int:
    """SIGTERM a `laneserve up` child and wait (SIGKILL its group after `timeout_s`)."""
    import signal

    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return proc.wait()
