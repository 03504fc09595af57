"""`laneserve jobs-runner`: runs bulk jobs from SQL through the broker's batch lane (jobs/runner.py)."""

from __future__ import annotations

import argparse
import logging
import sys

from laneserve.commands import add_tool_parser_argument
from laneserve.commands.recorder import default_retention_days

# Same value as jobs.retention.DEFAULT_INTERVAL_S (building the parser imports no SQLAlchemy).
RETENTION_INTERVAL_S = 3600.0
LEASE_S = 15.0  # jobs.leases.DEFAULT_LEASE_S

logger = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("jobs-runner", help="run bulk jobs (started by `laneserve up`)")
    parser.add_argument(
        "--broker",
        default=None,
        help="broker front endpoint (default: ipc under $LANESERVE_HOME/run)",
    )
    parser.add_argument(
        "--db",
        default=None,
        help="database URL (default: $LANESERVE_DB_URL, else sqlite:///$LANESERVE_HOME/laneserve.db)",
    )
    parser.add_argument(
        "--parent-pid", type=int, default=None, help="exit when this process is gone"
    )
    parser.add_argument(
        "--model",
        default="smollm2-135m",
        help="served model: its tokenizer validates prompt lengths; lines without a model use it "
        "(alias, .gguf or HF directory; default: %(default)s)",
    )
    parser.add_argument(
        "--model-name",
        default=None,
        help="model name recorded for lines that name none (default: --model)",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="context length in tokens for the length check and map-reduce (default: the model's)",
    )
    parser.add_argument(
        "--no-length-check",
        action="store_true",
        help="do not load a tokenizer (no over-length check, no map-reduce)",
    )
    add_tool_parser_argument(parser)
    parser.add_argument("--max-in-flight", type=int, default=256, help="lines in flight in total")
    parser.add_argument("--window", type=int, default=None, help="lines in flight per job")
    parser.add_argument(
        "--poll-interval", type=float, default=0.5, help="seconds between SQL polls"
    )
    parser.add_argument(
        "--runner-id",
        default=None,
        help="this runner's name in job leases; a restart with the same id resumes its lines at "
        "once (default: HOSTNAME-PID, unique per process)",
    )
    parser.add_argument(
        "--lease-timeout",
        type=float,
        default=LEASE_S,
        help="seconds a claimed job or line range stays this runner's without a renewal; a dead "
        "runner's lines are taken over after this (default: %(default)s)",
    )
    parser.add_argument(
        "--retention-days",
        type=float,
        default=default_retention_days(),
        help="delete job files and clear the line bodies of jobs ended more than this many days "
        "ago; jobs that have not ended are kept; 0 keeps all "
        "(default: $LANESERVE_RETENTION_DAYS or %(default)s)",
    )
    parser.add_argument(
        "--retention-interval",
        type=float,
        default=RETENTION_INTERVAL_S,
        help="seconds between two retention passes (default: %(default)s)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import asyncio
    import signal

    from laneserve.broker.addresses import default_front
    from laneserve.db import migrate
    from laneserve.db.session import DatabaseURLError, make_engine
    from laneserve.jobs.runner import JobsRunner

    if args.lease_timeout <= 0:
        print("laneserve jobs-runner: --lease-timeout must be > 0", file=sys.stderr)
        return 2
    try:
        migrate.upgrade(args.db)
        engine = make_engine(args.db)
    except (migrate.MigrationError, DatabaseURLError) as exc:
        print(f"laneserve jobs-runner: {exc}", file=sys.stderr)
        return 1
    from laneserve.contracts.tokens import TokenizerError
    from laneserve.gpu_worker.errors import ModelLoadError
    from laneserve.gpu_worker.model_files import model_display_name
    from laneserve.jobs.tokens import load_served_model

    model_name = args.model_name or model_display_name(args.model)
    try:
        counter = load_served_model(
            args.model, model_name, args.max_model_len, tokenizer=not args.no_length_check
        )
    except (ModelLoadError, TokenizerError) as exc:
        print(f"laneserve jobs-runner: {exc}", file=sys.stderr)
        return 1
    counter.tool_call_parser = args.tool_call_parser
    logger.info("served model %s; max_model_len %s", model_name, counter.max_model_len)
    runner = JobsRunner(
        engine,
        args.broker or default_front(),
        counter=counter,
        default_model=model_name,
        max_in_flight=args.max_in_flight,
        window=args.window,
        poll_interval_s=args.poll_interval,
        parent_pid=args.parent_pid,
        retention_s=max(0.0, args.retention_days) * 86400,
        retention_interval_s=args.retention_interval,
        runner_id=args.runner_id,
        lease_s=args.lease_timeout,
    )

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, runner.stop)
        await runner.run()

    asyncio.run(main())
    engine.dispose()
    logger.info("jobs-runner stopped: %s", runner.counters)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m laneserve.commands.jobs_runner``: this command alone (faster start)."""
    from laneserve.cli import run_single

    return run_single("jobs-runner", register, argv)


if __name__ == "__main__":
    raise SystemExit(main())
