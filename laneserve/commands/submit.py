"""`laneserve submit FILE`: create a bulk job over the HTTP API and (with --wait) follow it.

The file is uploaded (`POST /v1/files`) and the job created (`POST /v1/batches`) on the stack's
API, found like every CLI command finds it (laneserve/http_client.py): `--url` /
`$LANESERVE_URL`, else the running stack's `api_url` in `$LANESERVE_HOME/stack.json`; the key
is `--api-key` / `$LANESERVE_API_KEY`. Nothing is written to the stack's database or files
directly, so this works from any host. While the API or its database is away (503
`database_unavailable`, 429, connection refused) the upload and the job creation are sent again,
saying so on stderr as `--wait` does, for at most `--timeout` seconds (default 300).

Input: OpenAI Batch JSONL (endpoint from the first line's `url` unless --endpoint), or with
`--task summarize|translate|extract|embed` the shorthand `{"id", "text"}` per line (extract:
`--schema fields.json`, outputs constrained to that schema, parsed in `message.parsed`; embed: a
/v1/embeddings job, one output line per document holding its vector); a `.txt` file is one
document per line (`--txt-mode line`, the default) or one document (`--txt-mode file`).

Exit codes: 0 submitted (with --wait: completed, failed lines included), 1 failed, 3 cancelled,
4 expired, 2 rejected input or no usable API, 130 interrupted (the job keeps running;
`laneserve jobs watch ID` re-attaches).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

from laneserve.commands.jobs import RETRYABLE_STATUSES, retry_while_away, watch
from laneserve.http_client import EXIT_NO_API, StackError, add_api_arguments, client_for


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("submit", help="submit a bulk job (JSONL or task shorthand)")
    parser.add_argument("file", type=Path, help="input .jsonl (OpenAI Batch or {id, text}) or .txt")
    parser.add_argument(
        "--task", choices=("summarize", "translate", "extract", "embed"), default=None
    )
    parser.add_argument(
        "--schema", type=Path, default=None, help="extract: a JSON schema file of the fields"
    )
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
    parser.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="seconds to keep retrying the upload and job creation while the API or its "
        "database is away (503, connection refused)",
    )
    parser.add_argument("--json", action="store_true", help="print the batch object as JSON")
    add_api_arguments(parser)
    parser.set_defaults(func=run)


def open_engine(explicit: str | None):
    """A migrated engine on the local stack's database (`--db`, else stack.json's `db_url`, else
    db.session's default), for `laneserve demo`, which starts and reads a stack on this host.
    The submit/jobs/status/chat commands never use it: they talk HTTP."""
    from laneserve.db import migrate
    from laneserve.db.session import make_engine
    from laneserve.stack import read_stack

    url = explicit or (read_stack() or {}).get("db_url") or None
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


def _task_endpoint(task: str) -> str:
    """The endpoint of a task shorthand job: embeddings for `embed`, chat for the others."""
    return "/v1/embeddings" if task == "embed" else "/v1/chat/completions"


def _fail(msg: str, code: int = 2) -> int:
    print(f"laneserve submit: {msg}", file=sys.stderr)
    return code


def _batch_body(args: argparse.Namespace, file_id: str) -> dict:
    """The `POST /v1/batches` body (laneserve's extra fields: `model`, `task`, `task_options`)."""
    metadata = dict(item.split("=", 1) for item in args.metadata)
    body: dict = {
        "input_file_id": file_id,
        "endpoint": args.endpoint
        or (_task_endpoint(args.task) if args.task else _endpoint_of(args.file)),
        "completion_window": args.completion_window,
    }
    if metadata:
        body["metadata"] = metadata
    if args.model:
        body["model"] = args.model
    if args.task:
        body["task"] = args.task
        options = {"target_lang": args.target_lang, "source_lang": args.source_lang}
        options["max_tokens"] = args.max_tokens
        if args.schema is not None:
            schema = json.loads(args.schema.read_text(encoding="utf-8"))  # checked before
            options["schema"] = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
        options = {k: v for k, v in options.items() if v is not None}
        if options:
            body["task_options"] = options
    return body


def _check_args(args: argparse.Namespace) -> str | None:
    if not args.file.is_file():
        return f"{args.file}: no such file"
    if args.file.suffix == ".txt" and args.task is None:
        return ".txt input needs --task summarize|translate"
    if args.task == "translate" and not args.target_lang:
        return "--task translate needs --target-lang"
    if (args.task == "extract") != (args.schema is not None):
        return "--task extract and --schema go together"
    if args.schema is not None:
        try:
            json.loads(args.schema.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            return f"--schema {args.schema}: {exc}"
    bad = [m for m in args.metadata if "=" not in m]
    if bad:
        return f"--metadata {bad[0]!r}: expected KEY=VALUE"
    if args.task is None and _looks_like_task_lines(args.file):
        return (
            f'{args.file}: its first line is a document ({{"id", "text"}}), not an OpenAI '
            "Batch request (custom_id, method, url, body): add --task "
            "summarize|translate|extract|embed"
        )
    return None


def _looks_like_task_lines(path: Path) -> bool:
    """True when the file's first line is a JSON object with `text` and no `custom_id`."""
    try:
        with path.open("rb") as f:
            line = json.loads(f.readline(1 << 20) or b"null")
    except (OSError, ValueError):
        return False  # the stack names what is wrong with the line
    return isinstance(line, dict) and "text" in line and "custom_id" not in line


def unanswered(exc: StackError) -> bool:
    """Worth sending again: the API refused for now (503 ``database_unavailable``, 429, ...) or
    the request never reached it. A request sent whose answer was lost (a timeout, a reset) is
    not: the file or job may exist already."""
    return exc.status in RETRYABLE_STATUSES or (exc.status is None and not exc.sent)


def _retried(args: argparse.Namespace, call):
    """`call()`, sent again while the API or its database is away (`unanswered`), for at most
    `--timeout` seconds, saying so on stderr as ``--wait`` does."""
    return retry_while_away(call, args.timeout, repeat=unanswered)


def _upload(client, path: Path) -> dict:
    with path.open("rb") as f:  # read afresh by each try
        return client.upload_file(f, path.name)


def run(args: argparse.Namespace) -> int:
    problem = _check_args(args)
    if problem:
        return _fail(problem)
    try:
        with client_for(args) as client:
            if args.file.suffix == ".txt":
                data = _txt_as_jsonl(args.file, args.txt_mode)
                file = _retried(args, lambda: client.upload_file(data, args.file.name))
            else:
                file = _retried(args, lambda: _upload(client, args.file))
            try:
                body = _batch_body(args, file["id"])
                job = _retried(args, lambda: client.create_batch(body))
            except StackError:  # refused: the upload would be left behind, unused
                with contextlib.suppress(StackError):
                    client.delete_file(file["id"])
                raise
            print(json.dumps(job) if args.json else job["id"], flush=True)
            if not args.wait:
                print(f"follow it with: laneserve jobs watch {job['id']}", file=sys.stderr)
                return 0
            return watch(client, job["id"])
    except StackError as exc:
        rejected = exc.status in (400, 404, 409, 413)  # the input (or its file) was refused
        return _fail(str(exc), EXIT_NO_API if rejected else exc.exit_code)
    except KeyboardInterrupt:  # before the job exists (the watcher handles its own)
        print(file=sys.stderr)
        return 130
