"""`laneserve status [--json] [--url URL]`: the stack's health, its workers and queues.

With `--url` / `$LANESERVE_URL` (a stack on any host) it reports what the HTTP API tells:
liveness (`/health`), readiness (`/ready` where the stack has it, else derived from the broker
and its workers), and the broker's workers and queues (`GET /status`, laneserve/api/inspection.py)::

    {"running": true, "remote": true, "api_url": ..., "ready": true, "reason": null,
     "broker": true, "model": ..., "workers": [...], "queues": {...}}

Exit code 0 when the API answers and is ready, 1 when it is not ready, 2 when it cannot be used
(unreachable, wrong key).

Without a URL the stack is found from `$LANESERVE_HOME/stack.json` (laneserve/stack.py), and the
report adds what only its host can see: each component with its pid and health. `--json`
prints one JSON object on stdout (logs go to stderr)::

    {"running": true, "state": "ready", "supervisor_pid": 1, "api_url": ..., "dashboard_url": ...,
     "db_url": ... (password hidden), "model": ..., "home": ...,
     "components": [{"name", "pid", "alive", "address", "healthy"}],
     "workers": [{"name", "worker_id", "pid", "lanes", "model", "capacity", "in_flight",
                  "draining", "last_seen_s", "load": {...engine stats...}}],
     "queues": {"interactive": n, "batch": n, "in_flight": n, ...}}

`workers[].pid` is the pid of the process holding the engine (as the worker reported it to the
broker); `ready` and `reason` are the API's readiness as above. Exit code 0 when every component
is healthy and the API is ready, 1 when the stack is not running, a component is unhealthy or the
API is not ready.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from laneserve.http_client import StackClient, StackError, Target, add_api_arguments, resolve_target


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("status", help="show the running stack's components")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds per health probe")
    add_api_arguments(parser)
    parser.set_defaults(func=run)


def _http_ok(url: str | None, timeout_s: float) -> bool:
    import httpx

    if not url:
        return False
    try:
        return httpx.get(url, timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


def api_view(client: StackClient, details: bool = True) -> dict[str, Any]:
    """What the HTTP API tells about its stack (module docstring). Raises StackError (401).

    `details`: also read `/status` (broker, model, workers, queues), which needs the API key
    where the stack has one; without it only the open probes `/health` and `/ready` are read
    (a local `laneserve status` reads the details from the broker itself)."""
    view: dict[str, Any] = {"api_url": client.base_url, "running": False, "ready": False}
    view.update(reason=None, broker=None, model=None, workers=[], queues={})
    try:
        code, _ = client.probe("/health")
    except StackError as exc:
        if exc.status == 401:
            raise
        return view | {"reason": str(exc)}
    view["running"] = code == 200
    code, status = client.probe("/status") if details else (None, None)
    if code == 200 and isinstance(status, dict):
        view.update({k: status.get(k) for k in ("broker", "model", "workers", "queues")})
        models = [w.get("model") for w in view["workers"] or [] if w.get("model")]
        view["model"] = view["model"] or (models[0] if models else None)
    code, ready = client.probe("/ready")
    if code in (200, 503):  # the stack's own readiness check
        view["ready"] = code == 200
        view["reason"] = None if code == 200 else _reason_of(ready)
    elif not details:
        view["ready"] = view["running"]
    elif not view["broker"]:
        view["reason"] = "the broker does not answer the API"
    elif not view["workers"]:
        view["reason"] = "no worker is attached to the broker"
    else:
        view["ready"] = view["running"]
    return view


def _reason_of(body: Any) -> str:
    if isinstance(body, dict) and body.get("reasons"):  # /ready (laneserve.api.health)
        return "; ".join(str(r) for r in body["reasons"])
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        for key in ("reason", "detail", "message"):
            if body.get(key):
                return str(body[key])
    return "not ready"


def _hide_password(url: str | None) -> str | None:
    if not url:
        return url
    try:
        from sqlalchemy.engine import make_url

        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # unparsable: show nothing secret
        return "(unparsable URL)"


def collect(info: dict[str, Any], timeout_s: float = 3.0) -> dict[str, Any]:
    """The status object (module docstring) for a running stack's `stack.json` dict."""
    from laneserve.broker.client import broker_status
    from laneserve.contracts.procs import pid_alive

    try:
        broker = broker_status(info["broker_front"], timeout_s=timeout_s)
    except (TimeoutError, KeyError):
        broker = None
    registered = {w.get("worker_id"): w for w in (broker or {}).get("workers", [])}
    addresses = {
        "recorder": info.get("recorder_addr"),
        "broker": info.get("broker_front"),
        "jobs-runner": info.get("broker_front"),
        "api": info.get("api_url"),
        "dashboard": info.get("dashboard_url"),
    }
    components = []
    for name, pid in (info.get("children") or {}).items():
        alive = pid_alive(pid)
        healthy = alive
        if name == "broker":
            healthy = alive and broker is not None
        elif name == "api":
            healthy = alive and _http_ok(info.get("api_url", "") + "/health", timeout_s)
        elif name == "dashboard":
            healthy = alive and _http_ok(
                (info.get("dashboard_url") or "") + "/_stcore/health", timeout_s
            )
        elif name.startswith("worker-"):
            healthy = alive and name in registered
        components.append(
            {
                "name": name,
                "pid": pid,
                "alive": alive,
                "address": addresses.get(name, info.get("broker_back")),
                "healthy": healthy,
            }
        )
    workers = []
    for w in (broker or {}).get("workers", []):
        entry = {"name": w.get("worker_id"), **w}
        workers.append(entry)
    return {
        "running": True,
        "home": str(_home()),
        "state": info.get("state"),
        "supervisor_pid": info.get("supervisor_pid"),
        "api_url": info.get("api_url"),
        "dashboard_url": info.get("dashboard_url"),
        "db_url": _hide_password(info.get("db_url")),
        "model": info.get("model"),
        "components": components,
        "workers": workers,
        "queues": (broker or {}).get("queues", {}),
    }


def _home():
    from laneserve.stack import laneserve_home

    return laneserve_home()


def run(args: argparse.Namespace) -> int:
    from laneserve.commands.up import quiet_http_logs
    from laneserve.contracts import env
    from laneserve.stack import running_stack

    quiet_http_logs()
    if args.url or env.get("LANESERVE_URL"):
        return _run_remote(args)
    info = running_stack(ready=False)
    if info is None:
        if args.json:
            print(
                json.dumps(
                    {"running": False, "home": str(_home()), "components": [], "workers": []}
                )
            )
        else:
            print(f"no laneserve stack running under {_home()} (start one with `laneserve up`)")
        return 1
    status = collect(info, args.timeout)
    target = Target(info["api_url"], args.api_key or env.get("LANESERVE_API_KEY"), local=True)
    try:
        with StackClient(target, args.timeout) as client:
            view = api_view(client, details=False)  # the details come from the broker above
    except StackError as exc:
        view = {"ready": False, "reason": str(exc)}
    status.update(ready=view["ready"], reason=view["reason"])
    ok = status["state"] == "ready" and all(c["healthy"] for c in status["components"])
    ok = ok and bool(status["ready"])
    if args.json:
        print(json.dumps(status))
    else:
        _print_table(status)
    return 0 if ok else 1


def _run_remote(args: argparse.Namespace) -> int:
    try:
        with StackClient(resolve_target(args.url, args.api_key), args.timeout) as client:
            view = api_view(client)
    except StackError as exc:
        print(f"laneserve status: {exc}", file=sys.stderr)
        return exc.exit_code
    view["remote"] = True
    if args.json:
        print(json.dumps(view))
    else:
        _print_remote(view)
    if not view["running"]:
        print(f"laneserve status: {view['reason']}", file=sys.stderr)
        return 2
    return 0 if view["ready"] else 1


def _print_remote(view: dict[str, Any]) -> None:
    from rich.console import Console

    console = Console()
    state = "ready" if view["ready"] else f"not ready ({view['reason']})"
    if not view["running"]:
        state = "not answering"
    console.print(
        f"[bold]laneserve[/bold] at {view['api_url']}: {state}; model {view['model'] or '-'}",
        markup=True,
        highlight=False,
    )
    _print_workers(console, view)


def components_table(components: list[dict[str, Any]]):
    """The supervisor's children, one row each. An address is one long word (an ipc:// path):
    on a narrow terminal it folds onto more lines instead of ending in "…"."""
    from rich.table import Column, Table

    table = Table("component", "pid", Column("address", overflow="fold"), "health")
    for c in components:
        health = "[green]ok" if c["healthy"] else ("[red]down" if not c["alive"] else "[yellow]?")
        table.add_row(c["name"], str(c["pid"] or "-"), str(c["address"] or "-"), health)
    return table


def _print_table(status: dict[str, Any]) -> None:
    from rich.console import Console

    console = Console()
    console.print(
        f"[bold]laneserve[/bold] {status['state']} (supervisor pid {status['supervisor_pid']}) "
        f"model {status['model']}"
    )
    console.print(components_table(status["components"]))
    if status.get("reason"):
        console.print(f"API not ready: {status['reason']}", markup=False)
    _print_workers(console, status)
    console.print(f"API {status['api_url']}/v1   dashboard {status['dashboard_url'] or '(off)'}")
    console.print(f"database {status['db_url']}")
    sys.stdout.flush()


def _ms(value: Any) -> str:
    return f"{value:.0f}" if isinstance(value, int | float) else "-"


def _pct(value: Any) -> str:
    return f"{value:.0%}" if isinstance(value, int | float) else "-"


def _gib(value: Any) -> str:
    return f"{value / 2**30:.2f} GiB" if isinstance(value, int | float) else "-"


def kv_pool_text(pool: Any) -> str:
    """A worker's announced KV pool: blocks x block size, tokens, bytes and dtype, and the
    profiled activation peak on a GPU (``-`` when the worker announced none)."""
    if not isinstance(pool, dict) or not isinstance(pool.get("num_blocks"), int):
        return "-"
    text = f"{pool['num_blocks']} x {pool.get('block_size')} = {pool.get('num_tokens')} tok"
    if pool.get("kv_cache_bytes") is not None:
        text += f", {_gib(pool['kv_cache_bytes'])} {pool.get('dtype', '')}".rstrip()
    if pool.get("activation_bytes") is not None:
        text += f", activations {_gib(pool['activation_bytes'])}"
    return text


# Below this many columns each worker prints as a block of "field value" lines instead of one
# row of a wide table (whose cells rich squeezes into unreadable slivers at 80 columns).
WIDE_COLUMNS = 120


def _slo_cells(ld: dict[str, Any]) -> dict[str, str]:
    """Per worker under SLO control: the targets (P99 ms), attainment, the chosen budget and
    the step-cost model's predicted vs measured step time (gpu_worker/step_budget.py)."""
    return {
        "interactive ttft/tpot ms": (
            f"{_ms(ld.get('slo_interactive_ttft_ms'))}/{_ms(ld.get('slo_interactive_tpot_ms'))}"
        ),
        "interactive met": _pct(ld.get("slo_interactive_attainment")),
        "batch ttft/tpot ms": f"{_ms(ld.get('slo_batch_ttft_ms'))}/{_ms(ld.get('slo_batch_tpot_ms'))}",
        "batch met": _pct(ld.get("slo_batch_attainment")),
        "budget": str(ld.get("step_token_budget", "-")),
        "batch tok": "all" if ld.get("step_batch_tokens") is None else str(ld["step_batch_tokens"]),
        "step ms pred/meas": (
            f"{ld.get('predicted_step_ms', 0):.1f}/{ld.get('measured_step_ms', 0):.1f}"
        ),
    }


def _worker_cells(w: dict[str, Any]) -> dict[str, str]:
    load = w.get("load") or {}
    kv = load.get("kv_usage")
    seats = ((w.get("info") or {}).get("engine") or {}).get("max_num_seqs")
    return {
        "worker": str(w.get("worker_id")),
        "pid": str(w.get("pid")),
        "lanes": ",".join(w.get("lanes") or []),
        "model": str(w.get("model")),
        "in flight": f"{w.get('in_flight', 0)}/{w.get('capacity', '?')}",
        # running sequences against the engine's seats (max_num_seqs); "in flight" above counts
        # what the broker handed the worker, which may exceed it (capacity = 2 x max_num_seqs)
        "running": _of(load.get("num_running", load.get("running", "-")), seats),
        "waiting": str(load.get("num_waiting", load.get("waiting", "-"))),
        "KV use": f"{kv:.1%}" if isinstance(kv, (int, float)) else "-",
        "KV pool": kv_pool_text((w.get("info") or {}).get("kv_pool")),
    }


def _of(value: Any, limit: Any) -> str:
    return f"{value}/{limit}" if limit is not None and value != "-" else str(value)


def _under_slo(w: dict[str, Any]) -> bool:
    return bool((w.get("load") or {}).get("slo_interactive_tpot_ms"))


def _print_workers(console, status: dict[str, Any]) -> None:
    """The workers table, the SLO table of those under SLO control, and the queue depths (local
    and remote reports alike); on a console narrower than `WIDE_COLUMNS`, one block of lines per
    worker holding the same fields."""
    from rich.table import Table

    workers = status["workers"]
    if workers and console.width >= WIDE_COLUMNS:
        wt = Table(*_worker_cells(workers[0]))
        for w in workers:
            wt.add_row(*_worker_cells(w).values())
        console.print(wt)
        slo = [w for w in workers if _under_slo(w)]
        if slo:
            st = Table("worker", *_slo_cells(slo[0]["load"]), title="SLO")
            for w in slo:
                st.add_row(str(w.get("worker_id")), *_slo_cells(w["load"]).values())
            console.print(st)
    for w in workers if console.width < WIDE_COLUMNS else []:
        cells = _worker_cells(w)
        block = Table(show_header=False, box=None, padding=(0, 1), title_justify="left",
                      title=f"[bold]{cells.pop('worker')}[/bold]")  # fmt: skip
        block.add_column(style="dim", no_wrap=True)
        block.add_column(overflow="fold")
        for name, value in cells.items():
            block.add_row(name, value)
        if _under_slo(w):
            for name, value in _slo_cells(w["load"]).items():
                block.add_row(f"SLO {name}", value)
        console.print(block)
    q = status.get("queues") or {}
    console.print(
        f"queues: interactive {q.get('interactive', '-')}, batch {q.get('batch', '-')}, "
        f"in flight {q.get('in_flight', '-')}"
    )
    sys.stdout.flush()
