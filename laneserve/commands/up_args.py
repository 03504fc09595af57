"""`laneserve up`'s flags (laneserve/commands/up.py runs them)."""

from __future__ import annotations

import argparse

from laneserve.commands import add_tool_parser_argument, port_number
from laneserve.gpu_worker.config import add_engine_arguments

DEFAULT_API_PORT = 8000
DEFAULT_DASHBOARD_PORT = 8501
# Broker <-> worker liveness: missed 1 s heartbeats before a worker counts as lost. Generous on
# CPU, where a loaded machine can starve the worker's IO thread for seconds.
LIVENESS_CPU = 30
LIVENESS_GPU = 5
# Engine options `up` sets for each worker itself (`--lanes` here takes one list per worker).
PER_WORKER = ("lanes",)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, default=1, help="engine workers (default: 1)")
    parser.add_argument(
        "--jobs-runners",
        type=int,
        default=1,
        help="jobs runners sharing the database through leases (default: 1)",
    )
    parser.add_argument(
        "--lanes",
        default="interactive,batch",
        help="lanes per worker: one list for all workers (default: %(default)s), or one list "
        "per worker separated by ';', e.g. --workers 2 --lanes 'interactive;batch'",
    )
    parser.add_argument(
        "--api-port", type=port_number, default=DEFAULT_API_PORT, help="0: any free port"
    )
    parser.add_argument(
        "--dashboard-port",
        type=port_number,
        default=DEFAULT_DASHBOARD_PORT,
        help="0: any free port",
    )
    parser.add_argument("--no-dashboard", action="store_true", help="do not start the dashboard")
    parser.add_argument(
        "--db", default=None, help="database URL (default: $LANESERVE_DB_URL, else SQLite in home)"
    )
    parser.add_argument(
        "--api-key", default=None, help="key the API requires (default: $LANESERVE_API_KEY; none)"
    )
    engine = parser.add_argument_group("engine (passed to every worker, gpu_worker/config.py)")
    add_engine_arguments(engine, exclude=PER_WORKER)
    engine.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads per worker (default: cores/workers)",
    )
    engine.add_argument(
        "--synthetic",
        action="store_true",
        help="synthetic workers (fake tokens, no model): for tests and benchmarks of the plumbing",
    )
    add_tool_parser_argument(parser)
    parser.add_argument(
        "--liveness",
        type=int,
        default=None,
        help=f"missed 1 s heartbeats before a worker is lost (default: {LIVENESS_CPU} on CPU, "
        f"{LIVENESS_GPU} on GPU)",
    )
    parser.add_argument(
        "--ready-timeout",
        type=float,
        default=600.0,
        help="seconds to wait for every component to answer (default: %(default)s)",
    )
    parser.add_argument(
        "--parent-pid", type=int, default=None, help="stop the stack when this process is gone"
    )
    parser.add_argument(
        "--no-standby",
        dest="standby",
        action="store_false",
        help="no spare worker processes (by default each worker gets one once it has run 30 s: "
        "it has done its imports and takes over a killed worker at once; laneserve/supervisor.py)",
    )
