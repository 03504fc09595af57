"""`laneserve submit FILE`: create a bulk job and (with --wait) follow it with a progress bar.

The job is created directly in SQL (`jobs.service`); the jobs runner of the running stack
picks it up. The database is found like every CLI command finds the stack: `--db`, else
`db_url` in `$LANESERVE_HOME/stack.json` (written by `laneserve up`), else
`$LANESERVE_DB_URL`, else the default SQLite file under `$LANESERVE_HOME`.

Input: OpenAI Batch JSONL (endpoint from the first line's `url` unless --endpoint), or with
`--task summarize|translate` the shorthand `{"id", "text"}` per line; a `.txt` file is one
document per line (`--txt-mode line`, the default) or one document (`--txt-mode file`).

Exit codes with --wait: 0 completed (failed lines included), 1 failed, 3 cancelled, 4 expired,
130 interrupted (the job keeps running).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

EXIT_CODES = {"completed": 0, "failed": 1, "cancelled": 3, "expired": 4}
TERMINAL = tuple(EXIT_CODES)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("submit", help="submit a bulk job (JSONL or task shorthand)")
    parser.add_argument("file", type=Path, help="input .jsonl (OpenAI Batch or {id, text}) or .txt")
    parser.add_argument("--task", choices=("summarize", "translate"), default=None)
    parser.add_argument(
        "--target-lang", default=None, help="translate: target language (fr, de, ...)"
    )
    parser.add_argument("--source-lang", default=None, help="translate: source language")
    parser.add_argument(
        "--max-tokens", type=int, default=None, help="task: output tokens per document"
    )
    parser.add_argument("--model", default=None, help="model for lines that name none")
    parser.add_argument("--endpoint", default=None, help="default: the first line's url")
    parser.add_argument("--completion-window", default="24h")
    parser.add_argument("--txt-mode", choices=("line", "file"), default="line")
    parser.add_argument("--metadata", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--wait", action="store_true", help="follow the job to its end")
    parser.add_argument("--json", action="store_true", help="print the batch object as JSON")
    parser.add_argument("--db", default=None, help="database URL (default: the running stack's)")
    parser.set_defaults(func=run)


def stack_info() -> dict:
    """`$LANESERVE_HOME/stack.json` as a dict ({} when absent or unreadable)."""
    from db.session import laneserve_home

    try:
        return json.loads((laneserve_home() / "stack.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def resolve_db(explicit: str | None) -> str | None:
    """--db, else the stack's `db_url`, else None (db.session's default resolution)."""
    return explicit or stack_info().get("db_url") or None


def open_engine(explicit: str | None):
    """A migrated database engine for the CLI (see `resolve_db`)."""
    from db import migrate
    from db.session import make_engine

    url = resolve_db(explicit)
    migrate.upgrade(url)
    return make_engine(url)


def _endpoint_of(path: Path) -> str:
    with path.open("rb") as f:
        for raw in f:
            if raw.strip():
                try:
                    url = json.loads(raw).get("url")
                except (json.JSONDecodeError, AttributeError, UnicodeDecodeError):
                    break
                if isinstance(url, str):
                    return url
                break
    return "/v1/chat/completions"


def _txt_as_jsonl(path: Path, mode: str) -> bytes:
    text = path.read_text(encoding="utf-8", errors="replace")
    if mode == "file":
        docs = [(path.stem, text)]
    else:
        docs = [(f"{path.stem}-{i}", t) for i, t in enumerate(text.splitlines(), 1) if t.strip()]
    return b"".join(json.dumps({"id": i, "text": t}).encode() + b"\n" for i, t in docs)


def _fail(msg: str) -> int:
    print(f"laneserve submit: {msg}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    from jobs import service
    from jobs.errors import JobsError
    from laneserve.commands.jobs import result_files

    if not args.file.is_file():
        return _fail(f"{args.file}: no such file")
    if args.file.suffix == ".txt" and args.task is None:
        return _fail(".txt input needs --task summarize|translate")
    if args.task == "translate" and not args.target_lang:
        return _fail("--task translate needs --target-lang")
    metadata = {}
    for item in args.metadata:
        key, sep, value = item.partition("=")
        if not sep:
            return _fail(f"--metadata {item!r}: expected KEY=VALUE")
        metadata[key] = value
    options = None
    if args.task:
        options = {"target_lang": args.target_lang, "source_lang": args.source_lang}
        options["max_tokens"] = args.max_tokens
        options = {k: v for k, v in options.items() if v is not None}
    endpoint = args.endpoint or ("/v1/chat/completions" if args.task else _endpoint_of(args.file))
    engine = open_engine(args.db)
    try:
        if args.file.suffix == ".txt":
            file = service.create_file(
                engine, _txt_as_jsonl(args.file, args.txt_mode), args.file.name
            )
        else:
            with args.file.open("rb") as f:
                file = service.create_file(engine, f, args.file.name)
        job = service.create_batch(
            engine,
            file.id,
            endpoint,
            args.completion_window,
            metadata or None,
            task=args.task,
            task_options=options,
            model=args.model,
        )
    except JobsError as exc:
        return _fail(str(exc))
    if args.json:
        print(json.dumps(service.batch_object(job)), flush=True)
    else:
        print(job.id, flush=True)
    if not args.wait:
        print(f"follow it with: laneserve jobs show {job.id}", file=sys.stderr)
        return 0
    try:
        job = follow(engine, job.id)
    except KeyboardInterrupt:
        print(f"\nstopped waiting; {job.id} keeps running", file=sys.stderr)
        return 130
    finally:
        engine.dispose()
    counts = job.request_counts
    print(
        f"{job.id}: {job.status} ({counts['completed']} completed, {counts['failed']} failed"
        f" of {counts['total']})",
        file=sys.stderr,
    )
    if job.errors:
        for err in job.errors:
            print(f"  {err.get('code')}: {err.get('message')}", file=sys.stderr)
    files = result_files(job)
    if files:
        names = " and ".join(f"./{path}" for _, _, path in files)
        print(f"results: laneserve jobs download {job.id}  (writes {names})", file=sys.stderr)
    return EXIT_CODES.get(job.status, 1)


def _tokens_done(engine, job_id: str) -> int:
    from sqlalchemy import func, select

    from db.models import Request
    from db.session import read_session

    with read_session(engine) as session:
        total = session.scalar(
            select(func.sum(Request.completion_tokens)).where(
                Request.job_id == job_id, Request.response.is_not(None)
            )
        )
    return int(total or 0)


def follow(engine, job_id: str, poll_s: float = 0.5, console=None):
    """Show a progress bar (done/total, failed, output tokens/s, ETA) on `console` (default:
    stderr) until the job ends; return the final `jobs` row."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from jobs import service

    console = console or Console(stderr=True)
    columns = (
        SpinnerColumn(),
        TextColumn("[bold]{task.fields[status]:<11}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("failed {task.fields[failed]}"),
        TextColumn("{task.fields[tps]:>7.1f} tok/s"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
    )
    start = time.monotonic()
    tokens0 = None
    with Progress(*columns, console=console, transient=not console.is_terminal) as bar:
        task = bar.add_task(job_id, total=None, status="validating", failed=0, tps=0.0)
        while True:
            job = service.get_batch(engine, job_id)
            c = job.request_counts
            tokens = _tokens_done(engine, job_id)
            tokens0 = tokens if tokens0 is None else tokens0
            elapsed = max(1e-6, time.monotonic() - start)
            bar.update(
                task,
                total=c["total"] or None,
                completed=c["completed"] + c["failed"],
                status=job.status,
                failed=c["failed"],
                tps=(tokens - tokens0) / elapsed,
            )
            if job.status in TERMINAL:
                return job
            time.sleep(poll_s)
