"""`laneserve up`: run the whole stack under one supervisor (laneserve/supervisor.py).

Starts the recorder, the broker, N workers, the jobs runner, the HTTP API and the dashboard on
embedded defaults (SQLite in `$LANESERVE_HOME`, the bundled model, CPU when there is no GPU,
dtype auto), waits until they answer, writes `$LANESERVE_HOME/stack.json` (laneserve/stack.py)
and prints the URLs. A crashed child is restarted with backoff; Ctrl-C / SIGTERM stops everything
(children get `--parent-pid`, so they also exit if this process is killed).

The model is pulled and converted (file-locked, atomic) before any worker starts, so N workers do
not race to download it. On CPU each worker gets `cores / workers` torch threads
(`OMP_NUM_THREADS`, see `up_host.threads_per_worker`) and every child `OMP_WAIT_POLICY=PASSIVE`
with a short spin (`GOMP_SPINCOUNT=3000`) unless either is set already: libgomp's default busy
wait makes torch 10-30x slower on a loaded small CPU, a fully passive team pays a wake-up at every
op (see gpu_worker/openmp.py).

The engine options are `gpu_worker.config.EngineConfig`'s flags (the same as `laneserve worker`'s,
but `--lanes`, which here can differ per worker); each worker gets them as one JSON document
(`--engine-config`) with its lanes and device filled in.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from laneserve.commands.up_args import (
    LIVENESS_CPU,
    LIVENESS_GPU,
    PER_WORKER,
    add_arguments,
)
from laneserve.commands.up_host import (
    child_env,
    cpu_cores,
    free_port,
    gpu_count,
    port_free,
    prepare_model,
    tell_broker,
    threads_per_worker,
)
from laneserve.contracts import env as lsenv
from laneserve.gpu_worker.config import EngineConfig, config_from_args

if TYPE_CHECKING:
    from laneserve.supervisor import Supervisor

logger = logging.getLogger(__name__)

LANES = ("interactive", "batch")
# A child that has been restarted this many times before the stack is ready fails `up` at once.
START_RESTARTS = 3


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "up", help="run the whole stack (broker, workers, recorder, jobs runner, API, dashboard)"
    )
    add_arguments(parser)
    parser.set_defaults(func=run)


# ------------------------------------------------------------------------------------ helpers


def quiet_http_logs() -> None:
    """HTTP clients log every request at INFO; keep the terminal for what matters."""
    import logging as _logging

    for name in ("httpx", "httpx2", "httpcore", "openai"):
        _logging.getLogger(name).setLevel(_logging.WARNING)


def parse_lanes(spec: str, workers: int) -> list[list[str]]:
    """Lanes for each worker from `--lanes` (see its help).

    Raises:
        ValueError: unknown lane, an empty list, or a per-worker count that differs from workers.
    """
    groups = [[x.strip() for x in g.split(",") if x.strip()] for g in spec.split(";")]
    if len(groups) == 1:
        groups = groups * workers
    if len(groups) != workers:
        raise ValueError(f"--lanes gives {len(groups)} lane lists for {workers} workers")
    for group in groups:
        if not group or any(lane not in LANES for lane in group):
            raise ValueError(f"--lanes: each list needs lanes from {LANES}, got {group}")
    return groups


def engine_options(args: argparse.Namespace) -> EngineConfig:
    """Every worker's engine options (lanes and device are set per worker in `build_specs`).

    Raises:
        ValueError: --threads below 1, or an engine option out of range.
    """
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    return config_from_args(args, exclude=PER_WORKER)


def build_specs(args: argparse.Namespace, plan: dict) -> list:
    """The child commands for this stack (`plan`: addresses, ports, db url, pid, threads)."""
    from laneserve.supervisor import ChildSpec

    py = sys.executable
    pid = str(os.getpid())
    home = plan["home"]
    common = child_env(home, 1, plan["api_key"])
    worker_env = child_env(home, plan["threads"], plan["api_key"])
    liveness = str(plan["liveness"])
    specs = [
        ChildSpec(
            "recorder",
            [py, "-m", "laneserve.cli", "recorder", "--recorder-addr", plan["recorder_addr"],
             "--db", plan["db_url"], "--parent-pid", pid],
            common, stop_group=3,
        ),
        ChildSpec(
            "broker",
            [py, "-m", "laneserve.commands.broker", "--front", plan["front"],
             "--back", plan["back"], "--recorder", plan["recorder_addr"],
             "--liveness", liveness, "--parent-pid", pid],
            common, stop_group=2,
        ),
    ]  # fmt: skip
    engine: EngineConfig = plan["engine"]
    for i, lanes in enumerate(plan["lanes"]):
        device = engine.device
        if device is None and plan["gpus"] > 0:
            device = f"cuda:{i % plan['gpus']}"
        config = dataclasses.replace(engine, lanes=tuple(lanes), device=device)
        argv = [py, "-m", "laneserve.commands.worker", "--broker", plan["back"]]
        argv += ["--worker-id", f"worker-{i}", "--engine-config", config.to_json()]
        argv += ["--liveness", liveness, "--parent-pid", pid, "--drain-timeout", "5"]
        if args.synthetic:
            argv.append("--synthetic")
        # The start-up profile this worker uses, taken back by its restarts (not by a new stack)
        profile = home / "run" / f"worker-{i}.profile.json"
        profile.unlink(missing_ok=True)
        env = dict(worker_env, LANESERVE_RESTART_PROFILE=str(profile))
        specs.append(ChildSpec(f"worker-{i}", argv, env, stop_group=1, standby=args.standby))
    n_runners = args.jobs_runners
    tools = ["--tool-call-parser", args.tool_call_parser] if args.tool_call_parser else []
    for i in range(n_runners):
        name = "jobs-runner" if n_runners == 1 else f"jobs-runner-{i}"
        runner = [py, "-m", "laneserve.commands.jobs_runner", "--broker", plan["front"]]
        runner += ["--db", plan["db_url"], "--parent-pid", pid]
        # A stable lease id: the restarted child takes its own leases back at once.
        runner += ["--runner-id", f"{socket.gethostname()}-{name}"]
        runner += ["--no-length-check"] if args.synthetic else ["--model", engine.model]
        runner += tools
        specs.append(ChildSpec(name, runner, common, stop_group=0))
    api = [py, "-m", "laneserve.commands.api", "--broker", plan["front"]]
    api += ["--port", str(plan["api_port"]), "--db", plan["db_url"], "--parent-pid", pid]
    if not args.synthetic:
        api += ["--model", engine.model]
    api += tools + [
        "--ready-lanes",
        ",".join(lane for lane in LANES if any(lane in g for g in plan["lanes"])),
    ]
    specs.append(ChildSpec("api", api, common, stop_group=0))
    if plan["dashboard_port"] is not None:
        dash = [py, "-m", "laneserve.cli", "dashboard", "--port", str(plan["dashboard_port"])]
        dash += ["--db", plan["db_url"], "--api-url", plan["api_url"], "--parent-pid", pid]
        specs.append(ChildSpec("dashboard", dash, common, stop_group=0))
    return specs


def check_ready(plan: dict) -> list[str]:
    """Components not answering yet (empty when the stack is ready)."""
    import httpx

    from laneserve.broker.client import broker_status

    waiting = []
    try:
        status = broker_status(plan["front"], timeout_s=1.0)
        if len(status["workers"]) < len(plan["lanes"]):
            waiting.append(f"workers ({len(status['workers'])}/{len(plan['lanes'])})")
    except TimeoutError:
        waiting.append("broker")
    from laneserve.api.health import fetch_readiness

    ready = fetch_readiness(plan["api_url"], timeout_s=2.0)  # the API's /ready: 200 or 503
    if ready is None:
        waiting.append("api")
    elif not ready["ready"]:
        waiting.append(f"api ({'; '.join(ready.get('reasons') or [])})")
    elif ready.get("workers", 0) < len(plan["lanes"]):
        waiting.append("api (workers)")
    if plan["dashboard_url"]:
        try:
            if httpx.get(plan["dashboard_url"] + "/_stcore/health", timeout=2.0).status_code != 200:
                waiting.append("dashboard")
        except httpx.HTTPError:
            waiting.append("dashboard")
    return waiting


# ------------------------------------------------------------------------------------ run


class _Stop:
    requested = False
    signum = 0


def run(args: argparse.Namespace) -> int:
    quiet_http_logs()
    from laneserve import stack

    if args.jobs_runners < 1:
        print("laneserve up: --jobs-runners must be >= 1", file=sys.stderr)
        return 2
    if args.workers < 1:
        print("laneserve up: --workers must be >= 1", file=sys.stderr)
        return 2
    try:
        lanes = parse_lanes(args.lanes, args.workers)
        engine = engine_options(args)
    except ValueError as exc:
        print(f"laneserve up: {exc}", file=sys.stderr)
        return 2
    from filelock import FileLock, Timeout

    home = stack.laneserve_home().resolve()
    home.mkdir(parents=True, exist_ok=True)
    # One supervisor per home: held for our lifetime (the OS drops it if we are killed).
    lock = FileLock(str(home / "up.lock"), timeout=0)
    try:
        lock.acquire()
    except Timeout:
        other = stack.read_stack(home) or {}
        print(
            f"laneserve up: a stack is already running under {home} "
            f"(supervisor pid {other.get('supervisor_pid')}, API {other.get('api_url')})",
            file=sys.stderr,
        )
        return 1
    try:
        return _run_locked(args, home, lanes, engine)
    finally:
        lock.release()


class _CannotStart(Exception):
    """Why `up` gives up before starting any child (printed as `laneserve up: <why>`, exit 1)."""


def _run_locked(
    args: argparse.Namespace, home: Path, lanes: list[list[str]], engine: EngineConfig
) -> int:
    """`up` once it holds the home's lock: plan the children, start them, wait until they
    answer, write stack.json, then supervise them until a signal or the parent's exit."""
    from laneserve import stack
    from laneserve.supervisor import Supervisor

    try:
        ports = _pick_ports(args)
        stop = _catch_signals()
        db_url, gpus = _prepare(args, engine)
    except _CannotStart as exc:
        print(f"laneserve up: {exc}", file=sys.stderr)
        return 1
    if stop.requested:
        return 130
    plan = _plan(args, home, lanes, engine, db_url, gpus, ports)
    stack_file = _StackFile(plan, "synthetic" if args.synthetic else engine.model, time.time())
    sup = Supervisor(
        build_specs(args, plan),
        home / "logs",
        on_change=stack_file.write,
        on_exit=functools.partial(tell_broker, plan["front"]),
    )
    code = 0
    try:
        say(f"starting {len(sup.children)} processes (logs in {home / 'logs'})")
        sup.start()
        code = _wait_ready(sup, args, plan, stop)
        if not stop.requested and code == 0:
            stack_file.state = "ready"
            stack_file.write(sup)
            print_banner(plan, home, time.time() - stack_file.started_at)
            while not stop.requested:
                _watch(sup, args.parent_pid, stop)
                time.sleep(0.25)
    finally:
        stack_file.state = "stopping"
        stack_file.write(sup)
        say("stopping")
        sup.stop()
        stack.remove_stack(os.getpid(), home)
        say("stopped")
    return code


def _pick_ports(args: argparse.Namespace) -> dict[str, int | None]:
    """The API's and the dashboard's ports: as given, a free one for 0, None for no dashboard.

    Raises:
        _CannotStart: a given port is in use.
    """
    ports: dict[str, int | None] = {}
    for name, port in (("api", args.api_port), ("dashboard", args.dashboard_port)):
        if name == "dashboard" and args.no_dashboard:
            ports[name] = None
        elif port == 0:
            ports[name] = free_port()
        elif not port_free(port):
            raise _CannotStart(
                f"port {port} for the {name} is in use; pass --{name}-port (0 picks a free one)"
            )
        else:
            ports[name] = port
    return ports


def _catch_signals() -> _Stop:
    """A stop flag that SIGTERM, SIGINT and SIGHUP set from now on (instead of killing `up`)."""
    stop = _Stop()

    def on_signal(signum, _frame):
        stop.requested, stop.signum = True, signum

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    return stop


def _prepare(args: argparse.Namespace, engine: EngineConfig) -> tuple[str, int]:
    """Migrate the database, then (unless `--synthetic`) pull and convert the model. Returns the
    database URL (password included) and the CUDA devices visible (0 when synthetic).

    Raises:
        _CannotStart: a bad database URL, a failed migration, or a model that cannot be loaded.
    """
    from laneserve.db import migrate
    from laneserve.db.session import DatabaseURLError, resolve_url

    try:
        db_url = resolve_url(args.db).render_as_string(hide_password=False)
        say(f"preparing the database {resolve_url(db_url).render_as_string(True)}")
        migrate.upgrade(db_url)
    except (migrate.MigrationError, DatabaseURLError) as exc:
        raise _CannotStart(str(exc)) from exc
    if args.synthetic:
        return db_url, 0
    from laneserve.gpu_worker.errors import ModelLoadError

    local = Path(engine.model).expanduser().exists()  # a directory or file: nothing to download
    say(
        f"preparing the model {engine.model}"
        + ("" if local else " (downloaded and converted once)")
    )
    gpus = gpu_count()
    on_cuda = (engine.device or ("cuda" if gpus else "cpu")).startswith("cuda")
    # a worker that dequantizes (`none`, or `auto` on CUDA) reads the float32 copy: made here
    # once, before the workers start, not by each of them under the cache's lock
    float32 = engine.quantization == "none" or (on_cuda and engine.quantization == "auto")
    try:
        prepare_model(engine.model, weights=float32)
    except ModelLoadError as exc:
        raise _CannotStart(str(exc)) from exc
    return db_url, gpus


def _plan(
    args: argparse.Namespace,
    home: Path,
    lanes: list[list[str]],
    engine: EngineConfig,
    db_url: str,
    gpus: int,
    ports: dict[str, int | None],
) -> dict:
    """The stack's plan, what `build_specs`, `check_ready` and stack.json read: addresses,
    ports and URLs, database, lanes, engine options, threads per worker, GPUs, liveness, key."""
    from laneserve.broker.addresses import default_back, default_front, run_dir

    threads = args.threads or threads_per_worker(cpu_cores(), args.workers)
    return {
        "home": home,
        "front": default_front(),
        "back": default_back(),
        "recorder_addr": f"ipc://{run_dir() / 'recorder.sock'}",
        "db_url": db_url,
        "lanes": lanes,
        "engine": engine,
        "threads": threads,
        "gpus": gpus,
        "liveness": args.liveness or (LIVENESS_GPU if gpus else LIVENESS_CPU),
        "api_port": ports["api"],
        "api_url": f"http://127.0.0.1:{ports['api']}",
        "dashboard_port": ports["dashboard"],
        "dashboard_url": (
            f"http://127.0.0.1:{ports['dashboard']}" if ports["dashboard"] is not None else None
        ),
        "api_key": args.api_key or lsenv.get("LANESERVE_API_KEY"),
    }


@dataclasses.dataclass(slots=True)
class _StackFile:
    """`$LANESERVE_HOME/stack.json` (laneserve/stack.py) of this supervisor: written whenever
    its children change and at each `state` ("starting", "ready", "stopping")."""

    plan: dict
    model: str  # the served model, "synthetic" for synthetic workers
    started_at: float  # unix s
    state: str = "starting"

    def write(self, sup: Supervisor) -> None:
        from laneserve import stack

        plan, home = self.plan, self.plan["home"]
        stack.write_stack(
            {
                "state": self.state,
                "supervisor_pid": os.getpid(),
                "started_at": self.started_at,
                "api_url": plan["api_url"],
                "dashboard_url": plan["dashboard_url"],
                "broker_front": plan["front"],
                "broker_back": plan["back"],
                "recorder_addr": plan["recorder_addr"],
                "db_url": plan["db_url"],
                "model": self.model,
                "workers": [
                    {"name": f"worker-{i}", "lanes": ls} for i, ls in enumerate(plan["lanes"])
                ],
                "threads_per_worker": plan["threads"],
                "api_key_required": bool(plan["api_key"]),
                "logs": str(home / "logs"),
                "children": sup.pids(),
                "standby": sup.standby_pids(),
            },
            home,
        )


def _wait_ready(sup: Supervisor, args: argparse.Namespace, plan: dict, stop: _Stop) -> int:
    """Poll the started children until every one answers (0), a stop is asked for (0), or
    `--ready-timeout` passes or a child keeps exiting (1, said on stderr)."""
    deadline = time.monotonic() + args.ready_timeout
    waiting = ["everything"]
    while waiting and not stop.requested:
        if time.monotonic() > deadline:
            print(
                f"laneserve up: not ready after {args.ready_timeout:.0f}s; "
                f"waiting for {', '.join(waiting)}; logs in {plan['home'] / 'logs'}",
                file=sys.stderr,
            )
            return 1
        _watch(sup, args.parent_pid, stop)
        failing = [n for n, c in sup.children.items() if c.restarts >= START_RESTARTS]
        if failing:
            name = failing[0]
            tail = sup.log_path(name).read_text(errors="replace")[-2000:]
            print(
                f"laneserve up: {name} keeps exiting while starting "
                f"(log {sup.log_path(name)}):\n{tail}",
                file=sys.stderr,
            )
            return 1
        waiting = check_ready(plan)
        if waiting:
            time.sleep(0.5)
    return 0


def _watch(sup, parent_pid: int | None, stop: _Stop) -> None:
    from laneserve.contracts.procs import parent_gone

    sup.poll()
    if parent_gone(parent_pid):
        logger.info("parent %d is gone; stopping", parent_pid)
        stop.requested = True


def say(msg: str) -> None:
    """Progress lines for the person at the terminal (stderr; stdout carries the URLs)."""
    print(f"laneserve up: {msg}", file=sys.stderr, flush=True)


def print_banner(plan: dict, home: Path, elapsed_s: float) -> None:
    lines = [
        f"laneserve is up ({elapsed_s:.0f}s)",
        f"  API        {plan['api_url']}/v1   (OpenAI-compatible)",
    ]
    if plan["dashboard_url"]:
        lines.append(f"  dashboard  {plan['dashboard_url']}")
    lines += [
        f"  database   {_hide_password(plan['db_url'])}",
        f"  logs       {home / 'logs'}",
        f"  stack      {home / 'stack.json'}",
        '  try        laneserve chat "What does the json module do?"  |  laneserve status',
        "Ctrl-C (or `laneserve down` from another shell) stops everything.",
    ]
    print("\n".join(lines), flush=True)


def _hide_password(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


def main(argv: list[str] | None = None) -> int:
    """``python -m laneserve.commands.up``: this command alone (faster start)."""
    parser = argparse.ArgumentParser(prog="laneserve up")
    add_arguments(parser)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    return int(run(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
