"""`laneserve down [--timeout S]`: stop the stack `laneserve up` runs under `$LANESERVE_HOME`.

The stack is found from `$LANESERVE_HOME/stack.json` (laneserve/stack.py). Its supervisor gets
SIGTERM, the same as Ctrl-C in the terminal of `laneserve up`: it stops its children group by
group (SIGKILL for a group that outlives its stop timeout) and removes the stack file. This command
waits until the supervisor and every child it listed have exited.

Exit code 0 when the stack stopped, or when none was running (stopping is idempotent, so scripts
can call it unconditionally); 1 when the supervisor or a child is still alive after `--timeout`
seconds (their pids are printed; nothing is killed behind the supervisor's back).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

from laneserve.contracts.env import laneserve_home
from laneserve.contracts.procs import pid_alive
from laneserve.stack import read_stack


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "down", help="stop the stack `laneserve up` runs under $LANESERVE_HOME"
    )
    parser.add_argument(
        "--timeout", type=float, default=90.0, help="seconds to wait for every process to exit"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    home = laneserve_home()
    info = read_stack(home)
    pid = (info or {}).get("supervisor_pid")
    if not pid_alive(pid):
        print(f"No laneserve stack running under {home}", file=sys.stderr)
        return 0
    children = {n: p for n, p in (info.get("children") or {}).items() if isinstance(p, int)}
    print(f"stopping the laneserve stack under {home} (supervisor pid {pid})", file=sys.stderr)
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + args.timeout
    while True:
        alive = {n: p for n, p in {"supervisor": pid, **children}.items() if pid_alive(p)}
        if not alive:
            print("stopped", file=sys.stderr)
            return 0
        if time.monotonic() > deadline:
            left = ", ".join(f"{n} (pid {p})" for n, p in alive.items())
            print(f"still running after {args.timeout:g} s: {left}", file=sys.stderr)
            return 1
        time.sleep(0.2)
