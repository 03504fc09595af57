"""`laneserve jobs list|show|cancel|download ID`: inspect and manage bulk jobs in SQL.

Finds the database like `laneserve submit` (--db, stack.json's `db_url`, $LANESERVE_DB_URL,
the default SQLite file). Exit code 1 when the job does not exist or cannot be cancelled.
`jobs list` fits the terminal's width (`list_table`); `jobs list --json` has every field.
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


# `jobs list` columns from most to least useful; on a narrow terminal the last ones go first.
# The id is never shortened: it is what `show`, `cancel` and `download` take.
LIST_COLUMNS = ("id", "status", "lines", "failed", "kind", "created")


def _kind(job) -> str:
    """The task shorthand's name, else the endpoint without its /v1/ prefix."""
    return job.task or job.endpoint.removeprefix("/v1/")


def _list_rows(jobs) -> list[dict[str, str]]:
    rows = []
    for j in jobs:
        c = j.request_counts
        rows.append(
            {
                "id": j.id,
                "status": j.status,
                "lines": f"{c['completed'] + c['failed']}/{c['total']}",
                "failed": str(c["failed"]),
                "kind": _kind(j),
                "created": time.strftime("%m-%d %H:%M", time.localtime(j.created_at)),
            }
        )
    return rows


def list_table(jobs, width: int):
    """The `jobs list` table (rich) fitted to `width` columns of text.

    Columns are dropped from the end of `LIST_COLUMNS` until the table fits (the id, status
    and line counts always stay; a caption names what was dropped). Cells are never cut: on a
    terminal too narrow even for those three, they fold onto a second line."""
    from rich.box import SIMPLE_HEAD
    from rich.console import Console
    from rich.table import Table

    rows = _list_rows(jobs)
    measure = Console(width=10_000)
    for keep in range(len(LIST_COLUMNS), 2, -1):
        shown, hidden = LIST_COLUMNS[:keep], LIST_COLUMNS[keep:]
        table = Table(
            box=SIMPLE_HEAD,
            show_edge=False,
            pad_edge=False,
            padding=(0, 1, 0, 0),
            caption_justify="left",
        )
        for name in shown:  # fold (never cut) only below the three columns' own width
            justify = "right" if name == "failed" else "left"
            table.add_column(name, overflow="fold", justify=justify)
        for row in rows:
            table.add_row(*(row[name] for name in shown))
        if hidden:
            table.caption = f"{', '.join(hidden)} hidden at {width} columns (--json has all)"
        if measure.measure(table).maximum <= width:
            break
    return table


def _list(engine, args, service) -> int:
    jobs = service.list_batches(engine, limit=args.limit)
    if args.json:
        print(json.dumps([service.batch_object(j) for j in jobs]))
        return 0
    from rich.console import Console

    console = Console()
    if not jobs:
        print("no jobs", file=sys.stderr)
        return 0
    console.print(list_table(jobs, console.width))
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


def result_files(job) -> list[tuple[str, str, Path]]:
    """(kind, file id, default download path) of each result file the job has written:
    "output" -> ./ID_output.jsonl, "errors" -> ./ID_errors.jsonl (none before the job ends,
    and no error file when no line failed)."""
    files = (("output", job.output_file_id), ("errors", job.error_file_id))
    return [(kind, fid, Path(f"{job.id}_{kind}.jsonl")) for kind, fid in files if fid is not None]


def _download(engine, args, service) -> int:
    from jobs.files import copy_file_content

    job = _resolve(engine, service, args.id)
    files = result_files(job)
    if not files:
        print(f"laneserve jobs: {job.id} is {job.status}; no files yet", file=sys.stderr)
        return 1
    for kind, file_id, default in files:
        dest = (args.output if kind == "output" else args.errors) or default
        n = copy_file_content(engine, file_id, dest)
        print(f"{kind}: {dest} ({n} bytes)")
    return 0


ACTIONS = {"list": _list, "show": _show, "cancel": _cancel, "download": _download}
