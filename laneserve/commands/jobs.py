"""`laneserve jobs list|show|watch|cancel|download ID`: bulk jobs over the HTTP API.

Finds the API like `laneserve submit` (laneserve/http_client.py: `--url` / `$LANESERVE_URL`, else
the running stack's stack.json; `--api-key` / `$LANESERVE_API_KEY`), on this host or any other.
`jobs list` fits the terminal's width (`list_table`); `--json` prints the API's objects.
`jobs show` prints a summary (status, counts, tokens, throughput, TTFT/e2e percentiles of the
job's lines, ETA, files) from `GET /v1/batches/{id}` and `GET /v1/batches/{id}/stats`.
`jobs watch` (and `submit --wait`) follows a job with a progress bar; Ctrl-C leaves the job
running and `jobs watch ID` re-attaches. While the API cannot answer (a connection error, or a
503 while its database is away) it says so on stderr and keeps waiting (`until_answered`).

Exit codes: 0 done; 1 the job does not exist or cannot be cancelled, or (watch) it ended
`failed`; 2 no usable API; watch: 3 cancelled, 4 expired, 124 --timeout passed first, 130
interrupted.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path
from typing import Any

from laneserve.http_client import (
    EXIT_NO_API,
    StackClient,
    StackError,
    add_api_arguments,
    client_for,
)
from laneserve.jobs.errors import error_text

EXIT_CODES = {"completed": 0, "failed": 1, "cancelled": 3, "expired": 4}
TERMINAL = tuple(EXIT_CODES)
EXIT_WATCH_TIMEOUT = 124  # as timeout(1): stopped watching, the job still runs
EXIT_INTERRUPTED = 130


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("jobs", help="list, show, watch, cancel or download bulk jobs")
    add_api_arguments(parser)
    sub = parser.add_subparsers(dest="jobs_command", metavar="ACTION", required=True)
    p_list = sub.add_parser("list", help="jobs, newest first")
    p_list.add_argument("--limit", type=int, default=20)
    p_list.add_argument("--json", action="store_true")
    p_show = sub.add_parser("show", help="one job's summary (--json: the OpenAI batch object)")
    p_show.add_argument("id")
    p_show.add_argument("--json", action="store_true", help="the batch object and its stats")
    p_watch = sub.add_parser("watch", help="follow a job with a progress bar (Ctrl-C: detach)")
    p_watch.add_argument("id")
    p_watch.add_argument(
        "--timeout", type=float, default=None, help="stop watching after this many seconds"
    )
    p_cancel = sub.add_parser("cancel", help="cancel a job (finished results are kept)")
    p_cancel.add_argument("id")
    p_dl = sub.add_parser("download", help="write a job's output and error files")
    p_dl.add_argument("id")
    p_dl.add_argument(
        "--output", type=Path, default=None, help="default: ./ID_output.jsonl; - for stdout"
    )
    p_dl.add_argument(
        "--errors", type=Path, default=None, help="default: ./ID_errors.jsonl; - for stdout"
    )
    for p in (p_list, p_show, p_watch, p_cancel, p_dl):  # also accepted after the action
        p.add_argument("--url", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        p.add_argument("--api-key", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        with client_for(args) as client:
            return ACTIONS[args.jobs_command](client, args)
    except StackError as exc:
        print(f"laneserve jobs: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:  # nothing to undo: every action is one request
        print(file=sys.stderr)
        return EXIT_INTERRUPTED


# `jobs list` columns from most to least useful; on a narrow terminal the last ones go first.
# The id is never shortened: it is what `show`, `cancel` and `download` take.
LIST_COLUMNS = ("id", "status", "lines", "failed", "kind", "created")


def _kind(batch: dict) -> str:
    """The task shorthand's name, else the endpoint without its /v1/ prefix."""
    return batch.get("task") or batch["endpoint"].removeprefix("/v1/")


def _list_rows(batches: list[dict]) -> list[dict[str, str]]:
    rows = []
    for b in batches:
        c = b["request_counts"]
        rows.append(
            {
                "id": b["id"],
                "status": b["status"],
                "lines": f"{c['completed'] + c['failed']}/{c['total']}",
                "failed": str(c["failed"]),
                "kind": _kind(b),
                "created": time.strftime("%m-%d %H:%M", time.localtime(b["created_at"])),
            }
        )
    return rows


def list_table(batches: list[dict], width: int):
    """The `jobs list` table (rich) of OpenAI batch objects fitted to `width` columns of text.

    Columns are dropped from the end of `LIST_COLUMNS` until the table fits (the id, status
    and line counts always stay; a caption names what was dropped). Cells are never cut: on a
    terminal too narrow even for those three, they fold onto a second line."""
    from rich.box import SIMPLE_HEAD
    from rich.console import Console
    from rich.table import Table

    rows = _list_rows(batches)
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


def _list(client: StackClient, args: argparse.Namespace) -> int:
    batches = client.list_batches(limit=args.limit)
    if args.json:
        print(json.dumps(batches))
        return 0
    from rich.console import Console

    console = Console()
    if not batches:
        print("no jobs", file=sys.stderr)
        return 0
    console.print(list_table(batches, console.width))
    return 0


# ---------------------------------------------------------------------------- show


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}"


def _when(unix_s: float | None) -> str:
    return "-" if unix_s is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(unix_s))


def _file_line(info: dict | None, name: bool = False) -> str:
    if not info:
        return "-"
    return f"{info['id']}  {info['filename'] + '  ' if name else ''}({info['bytes']} bytes)"


def failed_validation(batch: dict) -> bool:
    """Whether the job was refused before any line ran (its input failed validation): its
    line counts are all 0, and "0 of 0 lines" would hide why."""
    return batch["status"] == "failed" and batch["request_counts"]["total"] == 0


def summary_lines(batch: dict, stats: dict | None) -> list[str]:
    """The `jobs show` summary of an OpenAI batch object and its laneserve stats (None: the
    stack has no stats route, so only what the batch object says)."""
    c = batch["request_counts"]
    done = c["completed"] + c["failed"]
    if failed_validation(batch):
        counts = "(failed validation: no line ran)"
    else:
        counts = f"({done}/{c['total']} lines: {c['completed']} completed, {c['failed']} failed)"
    lines = [
        batch["id"],
        f"  status      {batch['status']}  {counts}",
        f"  kind        {_kind(batch)}   model {batch.get('model') or '-'}",
        f"  created     {_when(batch.get('created_at'))}",
    ]
    for err in (batch.get("errors") or {}).get("data") or []:
        lines.append(f"  error       {error_text(err)}")
    if stats is None:
        files = {"input": batch.get("input_file_id"), "output": batch.get("output_file_id"),
                 "errors": batch.get("error_file_id")}  # fmt: skip
        lines.append("  files       " + "   ".join(f"{k} {v or '-'}" for k, v in files.items()))
        return lines
    tps, lps = stats["output_tokens_per_s"], stats["lines_per_s"]
    if stats.get("cancelled_lines"):
        kind = "expiry" if batch["status"] == "expired" else "cancellation"
        lines[1] = lines[1][:-1] + f", {stats['cancelled_lines']} of them ended by the {kind})"
    ended = stats.get("ended_at") is not None
    lines += [
        f"  {'ran' if ended else 'running':<11} {_duration(stats['elapsed_s'])}"
        + ("" if ended else f"   ETA {_duration(stats['eta_s'])}"),
        f"  tokens      prompt {stats['prompt_tokens']}, completion {stats['completion_tokens']}"
        f" (cached {stats['cached_tokens']})",
        f"  throughput  {'-' if tps is None else f'{tps:.1f}'} output tok/s, "
        f"{'-' if lps is None else f'{lps:.2f}'} lines/s",
    ]
    for name, label in (("ttft_ms", "TTFT ms"), ("e2e_ms", "e2e ms")):
        q = stats["latency_ms"][name]
        lines.append(
            f"  {label:<11} p50 {_ms(q['p50'])}  p90 {_ms(q['p90'])}  p99 {_ms(q['p99'])}"
            f"  ({q['count']} lines)"
        )
    files = stats["files"]
    lines.append(f"  input       {_file_line(files.get('input'), name=True)}")
    lines.append(f"  output      {_file_line(files.get('output'))}")
    lines.append(f"  errors      {_file_line(files.get('errors'))}")
    return lines


def _show(client: StackClient, args: argparse.Namespace) -> int:
    batch = client.find_batch(args.id)
    stats = client.batch_stats(batch["id"])
    if args.json:
        print(json.dumps({**batch, "stats": stats}, indent=2))
    else:
        print("\n".join(summary_lines(batch, stats)))
    return 0


def _cancel(client: StackClient, args: argparse.Namespace) -> int:
    batch = client.cancel_batch(client.find_batch(args.id)["id"])
    print(f"{batch['id']}: {batch['status']}")
    return 0


def result_files(batch: dict) -> list[tuple[str, str, Path]]:
    """(kind, file id, default download path) of each result file the job has written:
    "output" -> ./ID_output.jsonl, "errors" -> ./ID_errors.jsonl (none before the job ends,
    and no error file when no line failed)."""
    files = (("output", batch.get("output_file_id")), ("errors", batch.get("error_file_id")))
    return [(kind, fid, Path(f"{batch['id']}_{kind}.jsonl")) for kind, fid in files if fid]


def _download(client: StackClient, args: argparse.Namespace) -> int:
    if str(args.output) == str(args.errors) == "-":
        print("laneserve jobs: only one of --output and --errors can be - (stdout)",
              file=sys.stderr)  # fmt: skip
        return 2
    batch = client.find_batch(args.id)
    files = result_files(batch)
    if not files:
        print(f"laneserve jobs: {batch['id']} is {batch['status']}; no files yet", file=sys.stderr)
        return 1
    # `-`: the file's bytes on stdout, and then what was written goes to stderr
    piped = "-" in (str(args.output), str(args.errors))
    for kind, file_id, default in files:
        dest = (args.output if kind == "output" else args.errors) or default
        if str(dest) == "-":
            n = client.download_file(file_id, sys.stdout.buffer)
            sys.stdout.flush()
        else:
            n = client.download_file(file_id, dest)
        print(f"{kind}: {'stdout' if str(dest) == '-' else dest} ({n} bytes)",
              file=sys.stderr if piped else sys.stdout)  # fmt: skip
    return 0


# ---------------------------------------------------------------------------- watch

RATE_WINDOW_S = 10.0  # tok/s is measured over the last seconds of polls
PLAIN_EVERY_S = 2.0  # without a terminal, one progress line at most this often


class _Rate:
    """Output tokens per second over the last `RATE_WINDOW_S` of samples."""

    def __init__(self) -> None:
        self.samples: collections.deque[tuple[float, int]] = collections.deque()

    def add(self, tokens: int) -> float | None:
        now = time.monotonic()
        self.samples.append((now, tokens))
        while len(self.samples) > 2 and now - self.samples[0][0] > RATE_WINDOW_S:
            self.samples.popleft()
        (t0, k0), (t1, k1) = self.samples[0], self.samples[-1]
        return (k1 - k0) / (t1 - t0) if t1 - t0 >= 1.0 else None


def _fields(batch: dict, stats: dict | None, rate: float | None) -> dict[str, Any]:
    """The progress fields of one poll: status, done/total, failed, tok/s, ETA (s or None)."""
    c = batch["request_counts"]
    ended = batch["status"] in TERMINAL
    if rate is None or ended:  # the job's own average until a live rate is measured
        rate = (stats or {}).get("output_tokens_per_s")
    return {
        "status": batch["status"],
        "done": c["completed"] + c["failed"],
        "total": c["total"],
        "failed": c["failed"],
        "tps": rate or 0.0,
        "eta": None if ended else (stats or {}).get("eta_s"),
    }


def plain_progress(job_id: str, f: dict[str, Any]) -> str:
    """One progress line (logs, pipes): `ID: STATUS done/total, N failed, X tok/s, ETA H:MM:SS`."""
    return (
        f"{job_id}: {f['status']} {f['done']}/{f['total'] or '?'}, {f['failed']} failed, "
        f"{f['tps']:.1f} tok/s, ETA {_duration(f['eta'])}"
    )


class _Display:
    """Where `follow` shows the figures: a rich progress bar on a terminal, else one
    `plain_progress` line whenever they change (at most every `PLAIN_EVERY_S`) and at the end."""

    def __init__(self, console, job_id: str) -> None:
        self.console, self.job_id = console, job_id
        self.bar = _bar(console) if console.is_terminal else None
        self.task = None
        self.last_line, self.last_at = "", None

    def __enter__(self) -> _Display:
        if self.bar is not None:
            self.bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()

    def show(self, f: dict[str, Any], final: bool) -> None:
        if self.bar is not None:
            shown = {"status": f["status"], "failed": f["failed"], "tps": f["tps"]}
            shown["eta"] = _duration(f["eta"])
            total = f["total"] or None
            if self.task is None:  # starts at the job's progress: no jump counted as speed
                self.task = self.bar.add_task(self.job_id, total=total, completed=f["done"],
                                              **shown)  # fmt: skip
            self.bar.update(self.task, total=total, completed=f["done"], **shown)
            return
        line, now = plain_progress(self.job_id, f), time.monotonic()
        due = self.last_at is None or now - self.last_at >= PLAIN_EVERY_S
        if line != self.last_line and (final or due):
            self.console.print(line, markup=False, highlight=False, soft_wrap=True)
            self.last_line, self.last_at = line, now


def _bar(console):
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    return Progress(
        SpinnerColumn(),
        TextColumn("[bold]{task.fields[status]:<11}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("failed {task.fields[failed]}"),
        TextColumn("{task.fields[tps]:>7.1f} tok/s"),
        TimeElapsedColumn(),
        TextColumn("ETA {task.fields[eta]}"),
        console=console,
    )


RETRYABLE_STATUSES = (429, 502, 503, 504)  # the API, or what it needs, is briefly away
WAIT_BACKOFF_S = (1.0, 10.0)  # first and longest pause between polls while it is away


def retryable(exc: StackError) -> bool:
    """A poll worth repeating: no answer at all (API restarting, connection refused or
    reset, timeout) or a retryable status (503 ``database_unavailable``, 429, ...). A 401,
    404 or other answer is final."""
    return exc.status in RETRYABLE_STATUSES or (exc.status is None and exc.exit_code == EXIT_NO_API)


def _answered(exc: StackError) -> bool:
    """A retryable answer (503 while its database is away, 429, ...) from an API that answered:
    repeated; no answer at all is not (yet)."""
    return exc.status in RETRYABLE_STATUSES


class _Outage:
    """`follow`'s pacing while the API cannot answer: one line on the console when it starts
    ("... still waiting, retrying"), one when it ends ("answers again after N s"), pauses
    doubling within `WAIT_BACKOFF_S` meanwhile."""

    def __init__(self, console) -> None:
        self.console = console
        self.since: float | None = None
        self.delay = WAIT_BACKOFF_S[0]

    def failed(self, exc: StackError) -> float:
        if self.since is None:
            self.since, self.delay = time.monotonic(), WAIT_BACKOFF_S[0]
            self.console.print(
                f"the API cannot answer now ({exc}); still waiting, retrying",
                markup=False,
                highlight=False,
                soft_wrap=True,
            )
        else:
            self.delay = min(self.delay * 2, WAIT_BACKOFF_S[1])
        return self.delay

    def ok(self) -> None:
        if self.since is not None:
            self.console.print(
                f"the API answers again after {time.monotonic() - self.since:.0f} s",
                markup=False,
                highlight=False,
            )
            self.since = None


def until_answered(
    call: Any, outage: _Outage, deadline: float | None = None, repeat: Any = retryable
) -> Any:
    """`call()` again and again while it raises a StackError that `repeat` (default: `retryable`)
    accepts, paced and told by `outage`, until it answers or monotonic `deadline` passes (then
    the error is raised)."""
    while True:
        try:
            result = call()
        except StackError as exc:
            if not repeat(exc) or (deadline is not None and time.monotonic() >= deadline):
                raise
            time.sleep(outage.failed(exc))
            continue
        outage.ok()
        return result


def retry_while_away(call: Any, timeout_s: float, console=None, repeat: Any = retryable) -> Any:
    """`until_answered` for `timeout_s` seconds, saying so on `console` (default: stderr) as
    `follow` does ("... still waiting, retrying", "answers again after N s")."""
    from rich.console import Console

    outage = _Outage(console or Console(stderr=True))
    return until_answered(call, outage, time.monotonic() + timeout_s, repeat)


def follow(
    client: StackClient,
    job_id: str,
    *,
    console=None,
    poll_s: float = 1.0,
    timeout_s: float | None = None,
) -> dict:
    """Show the job's progress (done/total, failed, output tok/s, ETA) on `console` (default:
    stderr; see `_Display`) until it ends or `timeout_s` seconds pass; return the last batch
    object. It only reads the API, so it can be stopped (Ctrl-C) and started again any time.
    While the API cannot answer (`retryable`: connection errors, 503 while its database is
    away) it says so on `console` and keeps polling, backing off up to 10 s; an API that never
    answered at all (a wrong `--url`) is an error at once.

    Raises:
        StackError: the API refused (unknown job, wrong key), or still could not answer when
            `timeout_s` passed.
    """
    from rich.console import Console

    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    rate = _Rate()
    console = console or Console(stderr=True)
    outage = _Outage(console)
    repeat = _answered  # an API never reached is a wrong --url: "cannot reach" at once
    with _Display(console, job_id) as display:
        while True:
            batch, stats = until_answered(
                lambda: (client.get_batch(job_id), client.batch_stats(job_id, latency=False)),
                outage,
                deadline,
                repeat,
            )
            repeat = retryable  # it answered: from now on ride out restarts and outages
            f = _fields(batch, stats, rate.add((stats or {}).get("completion_tokens", 0)))
            final = batch["status"] in TERMINAL
            final = final or (deadline is not None and time.monotonic() >= deadline)
            if not failed_validation(batch):  # no "failed 0/?" line: `watch` says why instead
                display.show(f, final)
            if final:
                return batch
            time.sleep(poll_s)


def watch(client: StackClient, job_id: str, timeout_s: float | None = None, console=None) -> int:
    """`follow` the job, then say how it ended on stderr; the exit code (module docstring)."""
    try:
        batch = follow(client, job_id, timeout_s=timeout_s, console=console)
    except KeyboardInterrupt:
        print(
            f"\nstopped watching; {job_id} keeps running (laneserve jobs watch {job_id} "
            "re-attaches)",
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED
    c = batch["request_counts"]
    if batch["status"] not in TERMINAL:
        print(
            f"{job_id}: still {batch['status']} after {timeout_s:g} s "
            f"({c['completed'] + c['failed']} of {c['total']} lines done); "
            f"laneserve jobs watch {job_id} re-attaches",
            file=sys.stderr,
        )
        return EXIT_WATCH_TIMEOUT
    errors = (batch.get("errors") or {}).get("data") or []
    if failed_validation(batch):
        print(f"{job_id}: failed validation, no line ran; why:", file=sys.stderr)
    else:
        print(
            f"{job_id}: {batch['status']} ({c['completed']} completed, {c['failed']} failed"
            f" of {c['total']})",
            file=sys.stderr,
        )
    for err in errors:
        print(f"  {error_text(err)}", file=sys.stderr)
    if c["failed"] and batch.get("error_file_id") and not errors:
        _print_failed_lines(client, batch, c["failed"])
    files = result_files(batch)
    if files:
        names = " and ".join(f"./{path}" for _, _, path in files)
        print(f"results: laneserve jobs download {job_id}  (writes {names})", file=sys.stderr)
    return EXIT_CODES.get(batch["status"], 1)


def _print_failed_lines(client: StackClient, batch: dict, failed: int, shown: int = 3) -> None:
    """The first `shown` lines of the job's error file on stderr: the line and why it failed."""
    try:
        head = client.head_lines(batch["error_file_id"], shown)
    except StackError as exc:
        print(f"  (its error file could not be read: {exc})", file=sys.stderr)
        return
    print(f"  failed line{'s' if failed > 1 else ''} ({min(shown, failed)} of {failed}):",
          file=sys.stderr)  # fmt: skip
    for raw in head:
        try:  # an error file line: {"id", "custom_id", "response": null, "error": {...}}
            line = json.loads(raw)
            text = f"{line['custom_id']}: {error_text(line['error'])}"
        except (ValueError, TypeError, KeyError, AttributeError):
            text = raw.decode("utf-8", "replace")[:300]
        print(f"    {text}", file=sys.stderr)


def _watch(client: StackClient, args: argparse.Namespace) -> int:
    from rich.console import Console

    deadline = None if args.timeout is None else time.monotonic() + args.timeout
    outage = _Outage(Console(stderr=True))
    # an API that never answered is a wrong --url (exit 2 at once); one that answers 503 is away
    batch = until_answered(lambda: client.find_batch(args.id), outage, deadline, _answered)
    return watch(client, batch["id"], args.timeout)


ACTIONS = {
    "list": _list,
    "show": _show,
    "watch": _watch,
    "cancel": _cancel,
    "download": _download,
}
