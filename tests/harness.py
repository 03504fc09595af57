"""The one test harness: laneserve processes (broker, workers, recorder, jobs runner, gateway,
`laneserve up` and other commands) as real child processes on loopback.

Sockets are ipc:// in a short temp directory, HTTP on 127.0.0.1 on a free port; every wait is
bounded in time; every process is stopped (a signal, then SIGKILL) by ``Stack.stop()``. Children
run this checkout's code (``PYTHONPATH``) with ``LANESERVE_HOME`` pointing at the stack's home and
without the caller's database URL, API key or fault-injection variables.

- :class:`Stack`: named child processes sharing one socket/log directory, home and SQLite file;
  presets :meth:`Stack.for_api`, :meth:`Stack.for_broker`, :meth:`Stack.for_jobs`.
- :func:`real_model_stack`: broker + one real SmolLM2 worker + gateway.
- Job helpers: :func:`write_jsonl`, :func:`chat_line`, :func:`submit`, :func:`submit_job`,
  :func:`wait_job`, :func:`wait_job_done`, :func:`read_lines`.
- Whole-stack commands: :func:`laneserve`, :class:`UpProcess`, :func:`link_model`,
  :func:`processes_mentioning`.
- :func:`free_port`, :func:`wait_for`, :func:`run`, :func:`report`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx

from laneserve.broker.client import broker_status

ROOT = Path(__file__).resolve().parents[1]
HB = 0.2  # heartbeat interval (s)
API_KEY = "test-key-0123456789"
MODEL_ALIAS = "smollm2-135m"  # the bundled model's alias, as job lines name it
# Variables of the caller that a child must not inherit (each test sets what it needs).
_DROPPED_ENV = (
    "LANESERVE_DB_URL",
    "LANESERVE_API_KEY",
    "LANESERVE_FAULT_CRASH",
    "LANESERVE_FAULT_STEP",
    "LANESERVE_FAULT_SLOWDOWN",
)


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


def child_env(home: Path) -> dict[str, str]:
    """The environment of a child: this checkout on PYTHONPATH, LANESERVE_HOME=`home`."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), LANESERVE_HOME=str(home))
    for key in _DROPPED_ENV:
        env.pop(key, None)
    return env


def _stop_all(procs: list[subprocess.Popen], sig: int, grace_s: float) -> None:
    """Send `sig` to every live process, then SIGKILL whatever is left after `grace_s` in all."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(sig)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Stack:
    """Named child processes sharing one temp directory (sockets, ``<name>.log``), one
    LANESERVE_HOME and one SQLite database.

    `liveness` (heartbeat intervals) and `hb` (s) go to the broker and workers; `lanes` is the
    default lanes of a worker; `api_key` the gateway's key (None: no key). `fail_fast` says which
    children a wait watches: True, all (an exited child fails the wait with the logs); a name, that
    one; False, none. `wait_s` is `wait_workers`' default bound; `stop()` sends `stop_signal`, then
    SIGKILL after `stop_grace_s` in all. With `own_tmp`, `stop()` also removes `tmp`.
    """

    def __init__(
        self,
        tmp: Path,
        *,
        home: Path | None = None,
        db_url: str | None = None,
        liveness: int = 10,
        hb: float = HB,
        lanes: str = "interactive,batch",
        api_key: str | None = None,
        fail_fast: bool | str = False,
        wait_s: float = 30.0,
        stop_signal: int = signal.SIGINT,
        stop_grace_s: float = 10.0,
        own_tmp: bool = False,
    ) -> None:
        self.tmp = tmp
        self.home = home if home is not None else tmp / "home"
        self.home.mkdir(parents=True, exist_ok=True)
        self.front = f"ipc://{tmp}/front.sock"
        self.back = f"ipc://{tmp}/back.sock"
        self.recorder_addr = f"ipc://{tmp}/recorder.sock"
        self.db_path = self.home / "laneserve.db"
        self.db_url = db_url or f"sqlite:///{self.db_path}"
        self.liveness, self.hb, self.lanes, self.api_key = liveness, hb, lanes, api_key
        self.fail_fast, self.wait_s = fail_fast, wait_s
        self.stop_signal, self.stop_grace_s, self._own_tmp = stop_signal, stop_grace_s, own_tmp
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.procs: dict[str, subprocess.Popen] = {}
        self.wraps: dict[str, list[str]] = {}  # child name -> command prefix (tests/netns.py)
        self._logs: list = []
        self.env = child_env(self.home)

    # ------------------------------------------------------------------ presets

    @classmethod
    def for_api(cls, tmp: Path, home: Path) -> Stack:
        """Gateway tests: generous liveness (a CPU loading a model must not look dead), the test
        API key, any exited child fails a wait."""
        return cls(tmp, home=home, liveness=25, api_key=API_KEY, fail_fast=True, wait_s=120.0)

    @classmethod
    def for_broker(cls, tmp: Path) -> Stack:
        """Broker tests: a worker is lost after ~1 s of silence; waits watch the broker."""
        return cls(tmp, liveness=5, fail_fast="broker", wait_s=20.0, stop_grace_s=5.0)

    @classmethod
    def for_jobs(cls, home: Path, db_url: str) -> Stack:
        """Jobs tests: batch-lane workers, `db_url` (SQLite or PostgreSQL), sockets in a fresh
        short temp directory removed by `stop()`, SIGTERM to stop."""
        tmp = Path(tempfile.mkdtemp(prefix="lsj"))
        return cls(
            tmp, home=home, db_url=db_url, lanes="batch", fail_fast=True, wait_s=120.0,
            stop_signal=signal.SIGTERM, own_tmp=True,
        )  # fmt: skip

    # ------------------------------------------------------------------ processes

    def spawn(self, name: str, argv: list[str], env: dict | None = None) -> subprocess.Popen:
        """Start ``python -m ARGV`` as child `name` (replacing an earlier child of that name),
        behind `wraps[name]` when set (e.g. ``ip netns exec NS``)."""
        log = open(self.tmp / f"{name}.log", "ab")  # noqa: SIM115 - closed in stop()
        self._logs.append(log)
        cmd = [*self.wraps.get(name, []), sys.executable, "-m", *argv]
        proc = subprocess.Popen(cmd, stdout=log, stderr=log, cwd=ROOT, env=env or self.env)
        self.procs[name] = proc
        return proc

    def start_broker(
        self, *extra: str, name: str = "broker", recorder: bool = False
    ) -> subprocess.Popen:
        """The broker; with `recorder`, also a recorder writing to `db_url`, linked to it."""
        args = ["--front", self.front, "--back", self.back, "--heartbeat-interval", str(self.hb)]
        args += ["--liveness", str(self.liveness), *extra]
        if recorder:
            self.start_recorder()
            args += ["--recorder", self.recorder_addr]
        return self.spawn(name, ["laneserve.commands.broker", *args])

    def start_worker(
        self,
        name: str = "w1",
        *extra: str,
        lanes: str | None = None,
        synthetic: bool = True,
        model: str | None = None,
        back: str | None = None,
        env: dict | None = None,
        heartbeat_s: float | None = None,
        liveness: int | None = None,
    ) -> subprocess.Popen:
        """Worker `name` (child ``worker-<name>``): synthetic, or the model at `model` (float32)."""
        args = ["--model", model, "--dtype", "float32"] if model else []
        args += ["--synthetic"] if synthetic and not model else []
        args += ["--broker", back or self.back, "--worker-id", name, "--lanes", lanes or self.lanes]
        args += ["--heartbeat-interval", str(heartbeat_s or self.hb)]
        args += ["--liveness", str(liveness or self.liveness), *extra]
        return self.spawn(f"worker-{name}", ["laneserve.commands.worker", *args], env=env)

    def start_recorder(self, db_url: str | None = None) -> subprocess.Popen:
        args = ["recorder", "--recorder-addr", self.recorder_addr, "--db", db_url or self.db_url]
        return self.spawn("recorder", ["laneserve.cli", *args, "--flush-interval", "0.1"])

    def start_jobs_runner(
        self, *extra: str, model: str | None = None, name: str = "jobs-runner"
    ) -> subprocess.Popen:
        """Jobs runner `name` (also its lease id, so a restart resumes its lines at once):
        counting prompts with `model`'s tokenizer (lines name the bundled alias, whatever path
        the worker loads), or without a length check."""
        args = ["--broker", self.front, "--db", self.db_url, "--poll-interval", "0.2"]
        args += ["--model", model, "--model-name", MODEL_ALIAS] if model else ["--no-length-check"]
        args += ["--runner-id", name]
        return self.spawn(name, ["laneserve.commands.jobs_runner", *args, *extra])

    def start_api(self, *extra: str) -> subprocess.Popen:
        args = ["--broker", self.front, "--port", str(self.port), "--db", self.db_url]
        args += ["--api-key", self.api_key] if self.api_key else []
        return self.spawn("api", ["laneserve.commands.api", *args, *extra])

    def kill(self, name: str) -> None:
        """SIGKILL child `name` and reap it (it stays in `procs`, dead)."""
        proc = self.procs[name]
        proc.kill()
        proc.wait(timeout=10)

    def stop_proc(self, name: str) -> None:
        """Stop child `name` as `stop()` would, and forget it."""
        _stop_all([self.procs.pop(name)], self.stop_signal, self.stop_grace_s)

    def restart_dead(self, starters: dict[str, Callable[[], object]]) -> list[str]:
        """Mini-supervisor step: start again each named child that has exited."""
        restarted = []
        for name, start in starters.items():
            if self.procs[name].poll() is not None:
                start()
                restarted.append(name)
        return restarted

    def stop(self) -> None:
        _stop_all(list(self.procs.values()), self.stop_signal, self.stop_grace_s)
        for log in self._logs:
            log.close()
        if self._own_tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)

    # ------------------------------------------------------------------ observation

    @property
    def broker(self) -> subprocess.Popen | None:
        return self.procs.get("broker")

    def alive(self, name: str) -> bool:
        return self.procs[name].poll() is None

    def check_alive(self) -> None:
        """Fail (with the logs) when a child that `fail_fast` watches has exited."""
        if self.fail_fast is False:
            return
        for name, proc in self.procs.items():
            if (self.fail_fast is True or name == self.fail_fast) and proc.poll() is not None:
                raise AssertionError(f"{name} exited with {proc.returncode}; logs:\n{self.logs()}")

    def status(self, timeout_s: float = 3.0) -> dict:
        return broker_status(self.front, timeout_s=timeout_s)

    def try_status(self) -> dict | None:
        try:
            return self.status(timeout_s=1.0)
        except (TimeoutError, OSError):
            return None

    def broker_counters(self) -> dict:
        return self.status()["counters"]

    def worker_ids(self) -> set[str]:
        st = self.try_status()
        return {w["worker_id"] for w in st["workers"]} if st else set()

    def wait_workers(self, names: set[str] | int, timeout_s: float | None = None) -> dict:
        """Wait until the broker lists the workers `names` (or at least `names` workers)."""

        def ready():
            self.check_alive()
            st = self.try_status()
            if st is None:
                return None
            ids = {w["worker_id"] for w in st["workers"]}
            return st if (len(ids) >= names if isinstance(names, int) else ids >= names) else None

        timeout_s = self.wait_s if timeout_s is None else timeout_s
        try:
            return wait_for(ready, timeout_s, f"workers {names}")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.logs()}") from None

    def wait_status(self, pred: Callable[[dict], bool], timeout_s: float = 10.0) -> dict:
        """Wait until `pred(broker status)` holds; returns that status."""
        last: dict = {}

        def met():
            nonlocal last
            last = self.status()
            return last if pred(last) else None

        try:
            return wait_for(met, timeout_s, "a broker status condition")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; last status {last}") from None

    def wait_api(self, timeout_s: float = 120.0) -> None:
        def up():
            self.check_alive()
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

    def logs(self, tail: int = 4000) -> str:
        out = []
        for path in sorted(self.tmp.glob("*.log")):
            out.append(f"--- {path.name}\n{path.read_text(errors='replace')[-tail:]}")
        return "\n".join(out)


@contextlib.contextmanager
def real_model_stack(
    gguf: Path, *worker_extra: str, recorder: bool = False, api_extra: tuple[str, ...] = ()
) -> Iterator[Stack]:
    """Broker (+ recorder writing SQLite) + one real SmolLM2 worker (float32, up to 16
    sequences, plus the `worker_extra` flags) + gateway with a key (plus the `api_extra` flags),
    serving ``gguf`` as ``smollm2``."""
    tmp = Path(tempfile.mkdtemp(prefix="lsr", dir="/tmp"))
    stack = Stack.for_api(tmp, tmp / "home")
    try:
        stack.start_broker(recorder=recorder)
        stack.start_worker(
            "real",
            "--max-num-seqs",
            "16",
            "--kv-cache-memory",
            "256MiB",
            *worker_extra,
            model=str(gguf),
        )
        stack.start_api("--model", str(gguf), "--served-model-name", "smollm2", *api_extra)
        stack.wait_workers({"real"}, timeout_s=300)
        stack.wait_api(timeout_s=300)
        yield stack
    finally:
        stack.stop()
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------------------------- jobs


@contextlib.contextmanager
def in_process_broker(engine, **worker_kwargs) -> Iterator[str]:
    """A real broker and a real worker over `engine`, as threads of this process on ipc
    sockets (so a test can count or inspect their calls); yields the broker's front address."""
    import threading

    from laneserve.broker.broker import Broker
    from laneserve.broker.config import BrokerConfig
    from laneserve.gpu_worker.worker import Worker

    tmp = Path(tempfile.mkdtemp(prefix="lsr", dir="/tmp"))  # short ipc paths
    front, back = f"ipc://{tmp}/f.sock", f"ipc://{tmp}/b.sock"
    broker = Broker(BrokerConfig(front=front, back=back))
    worker = Worker(engine, broker_addr=back, worker_id="w", model="smollm2", **worker_kwargs)
    threads = [threading.Thread(target=broker.run, name="broker", daemon=True),
               threading.Thread(target=worker.run, name="engine-loop", daemon=True)]  # fmt: skip
    for t in threads:
        t.start()
    try:
        yield front
    finally:
        worker.request_stop(drain=False)
        broker.stop()
        for t in threads:
            t.join(timeout=10)
        shutil.rmtree(tmp, ignore_errors=True)


def write_jsonl(path: Path, lines: list) -> Path:
    """Each item: a dict (dumped as JSON) or a str (written as is)."""
    with path.open("w") as f:
        for item in lines:
            f.write((item if isinstance(item, str) else json.dumps(item)) + "\n")
    return path


def chat_line(
    custom_id: str | None,
    content: str,
    max_tokens: int = 8,
    model: str = MODEL_ALIAS,
    temperature: float | None = 0,
) -> dict:
    """One chat-completions batch line (no ``custom_id`` key when it is None)."""
    body: dict = {"model": model, "messages": [{"role": "user", "content": content}]}
    body["max_tokens"] = max_tokens
    if temperature is not None:
        body["temperature"] = temperature
    line: dict = {"method": "POST", "url": "/v1/chat/completions", "body": body}
    if custom_id is not None:
        line = {"custom_id": custom_id, **line}
    return line


def submit(engine, path: Path, **kwargs):
    """Upload `path` and create a batch on it through jobs.service; returns the Job."""
    from laneserve.jobs import service

    endpoint = kwargs.pop("endpoint", "/v1/chat/completions")
    with path.open("rb") as f:
        file = service.create_file(engine, f, path.name)
    return service.create_batch(engine, file.id, endpoint, **kwargs)


def submit_job(engine, tmp: Path, lines: list[dict]):
    """Write `lines` to a fresh input file in `tmp` and submit it (chat completions)."""
    return submit(engine, write_jsonl(tmp / f"input-{time.monotonic_ns()}.jsonl", lines))


def job_state(engine, job_id: str):
    from laneserve.jobs import service

    return service.get_batch(engine, job_id)


TERMINAL = ("completed", "failed", "cancelled", "expired")


def wait_job(
    engine, job_id: str, statuses=TERMINAL, stack: Stack | None = None, timeout_s=120.0, tick=None
):
    """Wait until the job's status is one of `statuses`; ``tick()`` runs every poll (e.g. a
    mini-supervisor). Fails with the stack's logs after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    job = None
    while time.monotonic() < deadline:
        job = job_state(engine, job_id)
        if job.status in statuses:
            return job
        if tick is not None:
            tick()
        time.sleep(0.2)
    logs = stack.logs() if stack else ""
    raise AssertionError(f"job {job_id} still {job and job.status} after {timeout_s}s\n{logs}")


def wait_job_done(engine, job_id: str, timeout_s: float, stack: Stack | None = None, tick=None):
    """Wait for a terminal status (the reliability tests' form of :func:`wait_job`)."""
    return wait_job(engine, job_id, TERMINAL, stack, timeout_s, tick)


def read_lines(engine, file_id: str | None) -> list[dict]:
    """The JSON lines of a stored file ([] for None)."""
    from laneserve.jobs import service

    if file_id is None:
        return []
    return [json.loads(x) for x in service.file_content(engine, file_id).decode().splitlines()]


def check_exactly_once(engine, job, ids: list[str]) -> tuple[list[dict], list[dict]]:
    """Each of `ids` appears exactly once across the job's output and error files and has one
    `requests` row; returns (output lines, error lines)."""
    out = read_lines(engine, job.output_file_id)
    err = read_lines(engine, job.error_file_id)
    seen = collections.Counter(line["custom_id"] for line in out + err)
    dup = [cid for cid, n in seen.items() if n > 1]
    missing = sorted(set(ids) - set(seen))
    assert not dup and not missing, {"duplicates": dup[:10], "missing": missing[:10]}
    from sqlalchemy import text

    with engine.connect() as conn:  # and one `requests` row per line
        rows = conn.execute(
            text("SELECT custom_id, COUNT(*) FROM requests WHERE job_id = :j GROUP BY custom_id"),
            {"j": job.id},
        ).all()
    assert len(rows) == len(ids) and all(n == 1 for _, n in rows), rows[:10]
    return out, err


def report(scenario: str, **figures) -> None:
    """Print one scenario's figures (and append them to $LANESERVE_RELIABILITY_OUT if set), the
    source of docs/reliability.md's table."""
    line = json.dumps({"scenario": scenario, **figures})
    print(line)
    out = os.environ.get("LANESERVE_RELIABILITY_OUT")
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")


# ---------------------------------------------------------------------------------- whole stack


def link_model(home: Path, gguf: Path, hf_dir: Path) -> None:
    """Make the bundled alias resolve inside `home` without a download (symlinks to the cache)."""
    models = home / "models"
    models.mkdir(parents=True, exist_ok=True)
    (models / gguf.name).symlink_to(gguf)
    (models / hf_dir.name).symlink_to(hf_dir, target_is_directory=True)


def load_script(name: str):
    """scripts/`name`.py as a module; scripts/ is on sys.path only while it loads (the benchmark
    scripts import scripts/benchlib.py)."""
    import importlib.util

    saved = sys.path[:]
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = saved
    return module


def run_script(
    name: str, home: Path, *args: str, cwd: Path, timeout: float = 900.0
) -> subprocess.CompletedProcess:
    """Run scripts/`name`.py ARGS in `cwd` with LANESERVE_HOME=`home` (output captured)."""
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / f"{name}.py"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env={**os.environ, "LANESERVE_HOME": str(home)},
    )


def laneserve(home: Path, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
    """Run `laneserve ARGS` with only LANESERVE_HOME pointing at the stack."""
    return subprocess.run(
        [sys.executable, "-m", "laneserve.cli", *args],
        env=child_env(home),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


class UpProcess:
    """`laneserve up` as a child process, with its stack.json once ready (`env`: variables added
    to its environment, e.g. a test-only fault)."""

    def __init__(self, home: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.home = home
        self.log = home / "up.log"
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "laneserve.commands.up", *args],
                env={**child_env(home), **(env or {})},
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.info: dict = {}

    def wait_ready(self, timeout_s: float = 300.0) -> dict:
        def ready():
            if self.proc.poll() is not None:
                raise AssertionError(f"laneserve up exited {self.proc.returncode}:\n{self.logs()}")
            info = self.stack()
            ours = info.get("supervisor_pid") == self.proc.pid
            return info if info.get("state") == "ready" and ours else None

        try:
            self.info = wait_for(ready, timeout_s, "stack.json state ready", poll_s=0.3)
        except AssertionError as exc:
            raise AssertionError(f"{exc}:\n{self.logs()}") from None
        return self.info

    def stack(self) -> dict:
        """stack.json ({} while it is missing or half-written)."""
        try:
            return json.loads((self.home / "stack.json").read_text())
        except (OSError, json.JSONDecodeError):
            return {}

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
