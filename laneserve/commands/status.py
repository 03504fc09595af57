"""`laneserve status [--json]`: each component of the running stack with its pid, address, health.

The stack is found from `$LANESERVE_HOME/stack.json` (laneserve/stack.py). `--json` prints one
JSON object on stdout (logs go to stderr)::

    {"running": true, "state": "ready", "supervisor_pid": 1, "api_url": ..., "dashboard_url": ...,
     "db_url": ... (password hidden), "model": ..., "home": ...,
     "components": [{"name", "pid", "alive", "address", "healthy"}],
     "workers": [{"name", "worker_id", "pid", "lanes", "model", "capacity", "in_flight",
                  "draining", "last_seen_s", "load": {...engine stats...}}],
     "queues": {"interactive": n, "batch": n, "in_flight": n, ...}}

`workers[].pid` is the pid of the process holding the engine (as the worker reported it to the
broker). Exit code 0 when every component is healthy, 1 when the stack is not running or a
component is unhealthy.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("status", help="show the running stack's components")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds per health probe")
    parser.set_defaults(func=run)


def _http_ok(url: str | None, timeout_s: float) -> bool:
    import httpx

    if not url:
        return False
    try:
        return httpx.get(url, timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


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
    from broker.client import broker_status
    from contracts.procs import pid_alive

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

    quiet_http_logs()
    from laneserve.stack import running_stack

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
    ok = status["state"] == "ready" and all(c["healthy"] for c in status["components"])
    if args.json:
        print(json.dumps(status))
    else:
        _print_table(status)
    return 0 if ok else 1


def _print_table(status: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(
        f"[bold]laneserve[/bold] {status['state']} (supervisor pid {status['supervisor_pid']}) "
        f"model {status['model']}"
    )
    table = Table("component", "pid", "address", "health")
    for c in status["components"]:
        health = "[green]ok" if c["healthy"] else ("[red]down" if not c["alive"] else "[yellow]?")
        table.add_row(c["name"], str(c["pid"] or "-"), str(c["address"] or "-"), health)
    console.print(table)
    if status["workers"]:
        wt = Table("worker", "pid", "lanes", "model", "in flight", "running", "waiting", "KV use")
        for w in status["workers"]:
            load = w.get("load") or {}
            kv = load.get("kv_usage")
            wt.add_row(
                str(w.get("worker_id")),
                str(w.get("pid")),
                ",".join(w.get("lanes") or []),
                str(w.get("model")),
                f"{w.get('in_flight', 0)}/{w.get('capacity', '?')}",
                str(load.get("num_running", load.get("running", "-"))),
                str(load.get("num_waiting", load.get("waiting", "-"))),
                f"{kv:.1%}" if isinstance(kv, (int, float)) else "-",
            )
        console.print(wt)
    q = status.get("queues") or {}
    console.print(
        f"queues: interactive {q.get('interactive', '-')}, batch {q.get('batch', '-')}, "
        f"in flight {q.get('in_flight', '-')}"
    )
    console.print(f"API {status['api_url']}/v1   dashboard {status['dashboard_url'] or '(off)'}")
    console.print(f"database {status['db_url']}")
    sys.stdout.flush()
