"""`laneserve broker`: the request router between edges and GPU workers (broker/broker.py)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from typing import Any

from laneserve.broker.config import BrokerConfig
from laneserve.contracts.defaults import field_default

logger = logging.getLogger(__name__)


def _default(name: str) -> Any:
    """The flag's default: `BrokerConfig`'s (declared once, there)."""
    return field_default(BrokerConfig, name)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("broker", help="run the broker (lanes, credits, heartbeats)")
    _add_endpoints(parser)
    _add_liveness(parser)
    _add_limits(parser)
    _add_curve(parser)
    parser.set_defaults(func=run)


def _add_endpoints(parser: argparse.ArgumentParser) -> None:
    """Where the broker binds (edges, workers) and the recorder it sends records to."""
    default = "(default: ipc under $LANESERVE_HOME/run)"
    parser.add_argument("--front", default=None, help=f"client endpoint to bind {default}")
    parser.add_argument("--back", default=None, help=f"worker endpoint to bind {default}")
    parser.add_argument(
        "--recorder",
        default=None,
        help="recorder endpoint to connect (records to SQL); none: no records",
    )


def _add_liveness(parser: argparse.ArgumentParser) -> None:
    """Heartbeats, timeouts and periods (seconds), and the parent watch."""
    parser.add_argument(
        "--heartbeat-interval",
        type=float,
        default=_default("heartbeat_interval_s"),
        help="seconds (default: %(default)s)",
    )
    parser.add_argument(
        "--liveness",
        type=int,
        default=_default("liveness"),
        help="missed heartbeats before a worker is lost (default: %(default)s)",
    )
    parser.add_argument(
        "--record-resend",
        type=float,
        default=_default("record_resend_s"),
        help="seconds before an unacknowledged record batch is resent (default: %(default)s)",
    )
    parser.add_argument(
        "--record-retention",
        type=int,
        default=_default("record_retention"),
        help="records held for the recorder until it commits them (e.g. while the database is "
        "away); beyond this the oldest batches are dropped, counted in records_dropped "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--snapshot-interval",
        type=float,
        default=_default("snapshot_interval_s"),
        help="seconds between worker_stats snapshots (default: %(default)s)",
    )
    parser.add_argument(
        "--no-worker-timeout",
        type=float,
        default=_default("no_worker_timeout_s"),
        help="seconds an interactive request waits with no worker serving its lane",
    )
    parser.add_argument(
        "--parent-pid", type=int, default=None, help="exit when this process is gone"
    )


def _add_limits(parser: argparse.ArgumentParser) -> None:
    """Queue bounds, dispatch attempts and the per-client send queue (messages)."""
    parser.add_argument(
        "--max-interactive-queue",
        type=int,
        default=_default("max_interactive_queue"),
        help="full -> overloaded (default: %(default)s)",
    )
    parser.add_argument(
        "--max-batch-queue",
        type=int,
        default=_default("max_batch_queue"),
        help="(default: %(default)s)",
    )
    parser.add_argument(
        "--max-attempts",
        type=int,
        default=_default("max_attempts"),
        help="dispatches before worker_lost is final (default: %(default)s)",
    )
    parser.add_argument(
        "--client-sndhwm",
        type=int,
        default=_default("client_sndhwm"),
        help="messages queued per client before it counts as not reading (default: %(default)s)",
    )


def _add_curve(parser: argparse.ArgumentParser) -> None:
    curve = parser.add_argument_group("CurveZMQ for remote workers (`laneserve keys generate`)")
    curve.add_argument(
        "--curve-server-key",
        default=None,
        help="server key pair (keys/server.key_secret): the back socket becomes a CURVE server",
    )
    curve.add_argument(
        "--curve-allow",
        default=None,
        help="directory of allowed worker public keys (keys/allowed); others are refused",
    )


def run(args: argparse.Namespace) -> int:
    from laneserve.broker.addresses import default_back, default_front
    from laneserve.broker.broker import Broker, BrokerConfig

    if args.record_retention < 1:
        print("laneserve broker: --record-retention must be >= 1", file=sys.stderr)
        return 2
    config = BrokerConfig(
        front=args.front or default_front(),
        back=args.back or default_back(),
        recorder=args.recorder,
        heartbeat_interval_s=args.heartbeat_interval,
        liveness=args.liveness,
        max_interactive_queue=args.max_interactive_queue,
        max_batch_queue=args.max_batch_queue,
        max_attempts=args.max_attempts,
        parent_pid=args.parent_pid,
        client_sndhwm=args.client_sndhwm,
        record_resend_s=args.record_resend,
        record_retention=args.record_retention,
        snapshot_interval_s=args.snapshot_interval,
        no_worker_timeout_s=args.no_worker_timeout,
        curve_server_key=args.curve_server_key,
        curve_allow=args.curve_allow,
    )
    broker = Broker(config)
    signal.signal(signal.SIGTERM, lambda *_: broker.stop())
    signal.signal(signal.SIGINT, lambda *_: broker.stop())
    broker.run()
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m laneserve.commands.broker``: this command alone (faster start)."""
    from laneserve.cli import run_single

    return run_single("broker", register, argv)


if __name__ == "__main__":
    raise SystemExit(main())
