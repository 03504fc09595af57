"""`laneserve jobs list|show|cancel|download ID`: inspect and manage bulk jobs in SQL.

Finds the database like `laneserve submit` (--db, stack.json's `db_url`, $LANESERVE_DB_URL,
the default SQLite file). Exit code 1 when the job does not exist or cannot be cancelled.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("jobs", help="list, show, cancel or download bulk jobs")
    parser.add_argument("--db", default=None, help="database URL (default: the running stack's)")
    sub = parser.add_subparsers(dest="jobs_command", metavar="ACTION", required=True)
    p_list = sub.add_parser("list", help="jobs, newest first")
    p_list.add_argument("--limit", type=int, default=20)
    p_list.add_argument("--json", action="store_true")
    p_show = sub.add_parser("show", help="one job as JSON (the OpenAI batch object)")
    p_show.add_argument("id")
    p_cancel = sub.add_parser("cancel", help="cancel a job (finished results are kept)")
    p_cancel.add_argument("id")
    p_dl = sub.add_parser("download", help="write a job's output and error files")
    p_dl.add_argument("id")
    p_dl.add_argument("--output", type=Path, default=None, help="default: ./ID_output.jsonl")
    p_dl.add_argument("--errors", type=Path, default=None, help="default: ./ID_errors.jsonl")
    for p in (p_list, p_show, p_cancel, p_dl):
        p.add_argument("--db", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from jobs import service
    from jobs.errors import JobsError
    from laneserve.commands.submit import open_engine

    engine = open_engine(args.db)
    try:
        return ACTIONS[args.jobs_command](engine, args, service)
    except JobsError as exc:
        print(f"laneserve jobs: {exc}", file=sys.stderr)
        return 1
    finally:
        engine.dispose()


def _list(engine, args, service) -> int:
    jobs = service.list_batches(engine, limit=args.limit)
    if args.json:
        print(json.dumps([service.batch_object(j) for j in jobs]))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table("status", "kind", "done/total", "failed", "created")
    table.add_column(
        "id", no_wrap=True, overflow="fold"
    )  # full ids: they are what show/cancel take
    for j in jobs:
        c = j.request_counts
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(j.created_at))
        table.add_row(
            j.status,
            j.task or j.endpoint,
            f"{c['completed'] + c['failed']}/{c['total']}",
            str(c["failed"]),
            created,
            j.id,
        )
    Console().print(table)
    return 0


def _resolve(engine, service, batch_id: str):
    """The job named by `batch_id` or by a unique prefix of its id (as `jobs list` shows them)."""
    from jobs.errors import JobsError

    try:
        return service.get_batch(engine, batch_id)
    except JobsError:
        prefix = batch_id.rstrip("…. ")
        matches = [j for j in service.list_batches(engine, limit=100) if j.id.startswith(prefix)]
        if len(prefix) >= 10 and len(matches) == 1:  # "batch_" + a few hex digits
            return matches[0]
        if len(matches) > 1:
            raise JobsError(
                f"{batch_id!r} matches {len(matches)} batches; give more of the id"
            ) from None
        raise


def _show(engine, args, service) -> int:
    print(json.dumps(service.batch_object(_resolve(engine, service, args.id)), indent=2))
    return 0


def _cancel(engine, args, service) -> int:
    job = service.cancel_batch(engine, _resolve(engine, service, args.id).id)
    print(f"{job.id}: {job.status}")
    return 0


def _download(engine, args, service) -> int:
    from jobs.files import copy_file_content

    job = _resolve(engine, service, args.id)
    if job.output_file_id is None and job.error_file_id is None:
        print(f"laneserve jobs: {job.id} is {job.status}; no files yet", file=sys.stderr)
        return 1
    for file_id, dest, kind in (
        (job.output_file_id, args.output or Path(f"{job.id}_output.jsonl"), "output"),
        (job.error_file_id, args.errors or Path(f"{job.id}_errors.jsonl"), "errors"),
    ):
        if file_id is not None:
            n = copy_file_content(engine, file_id, dest)
            print(f"{kind}: {dest} ({n} bytes)")
    return 0


ACTIONS = {"list": _list, "show": _show, "cancel": _cancel, "download": _download}
