"""`laneserve dashboard`: the live latency dashboard (`streamlit run dashboard/app.py`, headless).

Binds 127.0.0.1 (DESIGN.md "Dashboard"), migrates the database first so an empty one shows the
friendly empty state, and passes the database URL to the app in `LANESERVE_DB_URL` and the API's
address (for the job view's download links) in `LANESERVE_URL`.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from laneserve.commands import port_number
from laneserve.contracts.procs import parent_gone

logger = logging.getLogger(__name__)

DEFAULT_PORT = 8501
# Seconds between checks that the parent (`--parent-pid`) and streamlit are alive.
POLL_S = 0.5
# Seconds streamlit gets to exit after SIGTERM before SIGKILL.
STOP_GRACE_S = 10.0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("dashboard", help="run the live latency dashboard (Streamlit)")
    parser.add_argument(
        "--port", type=port_number, default=DEFAULT_PORT, help="(default: %(default)s)"
    )
    parser.add_argument(
        "--db", default=None, help="database URL (default: $LANESERVE_DB_URL or $LANESERVE_HOME)"
    )
    parser.add_argument(
        "--api-url",
        default=None,
        help="the stack's HTTP API, for the job view's download links "
        "(default: $LANESERVE_URL, else the running stack's)",
    )
    parser.add_argument(
        "--parent-pid", type=int, default=None, help="exit when this process is gone"
    )
    parser.set_defaults(func=run)


def app_path() -> Path:
    """The installed package's `dashboard/app.py`."""
    from laneserve import dashboard

    return Path(dashboard.__file__).resolve().with_name("app.py")


def streamlit_command(port: int) -> list[str]:
    """The `streamlit run` command line: headless, 127.0.0.1, no telemetry, no file watcher."""
    if not 0 < port < 65536:
        raise ValueError(f"port must be in 1..65535, got {port}")
    return [
        sys.executable, "-m", "streamlit", "run", str(app_path()),
        "--server.headless", "true",
        "--server.address", "127.0.0.1",
        "--server.port", str(port),
        "--server.fileWatcherType", "none",
        "--browser.gatherUsageStats", "false",
    ]  # fmt: skip


def _stack_api_url() -> str | None:
    """$LANESERVE_URL, else the API of the stack running under $LANESERVE_HOME (or None)."""
    from laneserve.contracts import env
    from laneserve.stack import running_stack

    return env.get("LANESERVE_URL") or (running_stack(ready=False) or {}).get("api_url")


def run(args: argparse.Namespace) -> int:
    from laneserve.db.migrate import MigrationError, upgrade
    from laneserve.db.session import resolve_url

    url = resolve_url(args.db)
    try:
        upgrade(url)
    except MigrationError as exc:
        logger.error("cannot prepare the database %s: %s", url.render_as_string(True), exc)
        return 1
    env = dict(os.environ, LANESERVE_DB_URL=url.render_as_string(hide_password=False))
    if api_url := args.api_url or _stack_api_url():
        env["LANESERVE_URL"] = api_url
    cmd = streamlit_command(args.port)
    logger.info(
        "dashboard on http://127.0.0.1:%d (database %s)", args.port, url.render_as_string(True)
    )
    child = subprocess.Popen(cmd, env=env)
    stopping = False
    kill_at = float("inf")

    def stop(*_):
        nonlocal stopping, kill_at
        if not stopping:
            stopping, kill_at = True, time.monotonic() + STOP_GRACE_S
            child.terminate()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    while child.poll() is None:
        if not stopping and parent_gone(args.parent_pid):
            logger.info("parent %d is gone; stopping the dashboard", args.parent_pid)
            stop()
        if time.monotonic() > kill_at:
            child.kill()
        time.sleep(POLL_S)
    return 0 if stopping else child.returncode
