"""`laneserve recorder`: the process that writes request records and worker snapshots to SQL."""

from __future__ import annotations

import argparse
import logging
import signal
import sys

from laneserve.contracts import env

logger = logging.getLogger(__name__)


# Same values as db.recorder.FLUSH_INTERVAL_S / DEFAULT_RETENTION_S, repeated here so that
# building the CLI parser does not import SQLAlchemy (seconds of start-up on a small CPU).
FLUSH_INTERVAL_S = 0.2
DEFAULT_RETENTION_DAYS = 30.0


def default_retention_days() -> float:
    """`$LANESERVE_RETENTION_DAYS` (0 keeps everything), else `DEFAULT_RETENTION_DAYS`: the
    window of both the recorder's pruning and the jobs runner's (`--retention-days`)."""
    days = env.get("LANESERVE_RETENTION_DAYS")
    return DEFAULT_RETENTION_DAYS if days is None else days


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("recorder", help="write request records to SQL")
    parser.add_argument(
        "--recorder-addr", required=True, help="ZMQ address to bind (tcp://127.0.0.1:P, ipc://...)"
    )
    parser.add_argument(
        "--db",
        default=None,
        help="database URL (default: $LANESERVE_DB_URL, else sqlite:///$LANESERVE_HOME/laneserve.db)",
    )
    parser.add_argument(
        "--parent-pid", type=int, default=None, help="exit when this parent process is gone"
    )
    parser.add_argument(
        "--flush-interval",
        type=float,
        default=FLUSH_INTERVAL_S,
        help="seconds to pool batches before a write (default: %(default)s)",
    )
    parser.add_argument(
        "--retention-days",
        type=float,
        default=default_retention_days(),
        help="prune API request rows and snapshots older than this; 0 keeps all "
        "(default: $LANESERVE_RETENTION_DAYS or %(default)s)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import zmq

    from laneserve.db import migrate
    from laneserve.db.recorder import RecorderServer
    from laneserve.db.session import DatabaseURLError, make_engine

    try:
        migrate.upgrade(args.db)
        engine = make_engine(args.db)
        server = RecorderServer(
            args.recorder_addr,
            engine,
            parent_pid=args.parent_pid,
            flush_interval_s=args.flush_interval,
            retention_s=args.retention_days * 86400,
        )
    except (migrate.MigrationError, DatabaseURLError, zmq.ZMQError) as exc:
        print(f"laneserve recorder: {exc}", file=sys.stderr)
        return 1
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: server.stop())
    stats = server.run()
    engine.dispose()
    failed = stats.records_failed + stats.snapshots_failed
    if failed:
        logger.warning("recorder: %d records/snapshots could not be written", failed)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m laneserve.commands.recorder``: this command alone (faster start)."""
    from laneserve.cli import run_single

    return run_single("recorder", register, argv)


if __name__ == "__main__":
    raise SystemExit(main())
