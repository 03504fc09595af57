"""`laneserve demo [--quick]`: both lanes at once on real text, then the latency table.

1. Starts the stack (`laneserve up`) unless one is running under `$LANESERVE_HOME`, and stops it
   at the end if it started it.
2. Builds a real corpus from standard-library docstrings (laneserve/demo_corpus.py): documents to
   summarize and sentences to translate (>= 100 lines together; `--quick`: 12).
3. Submits a summarization job and a translation job (the task shorthand of `laneserve submit`)
   while a stream of interactive chat requests runs through the OpenAI client at the same time.
4. Shows progress bars (rich), then a per-lane, per-phase latency table (P50/P99 of TTFT, TPOT,
   queue, prefill, decode, e2e from the `requests` table), throughput, the output files and the
   dashboard URL. A JSON summary is written next to the outputs.
5. Judges both lanes (`lane_failures`): no interactive answer, chat errors beyond
   `ERROR_TOLERANCE`, a job that did not complete or lost lines beyond it, or a lane with no
   request in SQL is a failure: the reasons go to stderr and `summary.json` (`ok`, `failures`)
   and the exit code is 1. The table always has both lanes' columns.

Output lengths are kept modest (summaries 48 tokens, translations 32, chats 32) so the full
demo finishes in a few minutes on a 2-core CPU with the bundled 135M model.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from contracts import env
from contracts.latency import percentile

logger = logging.getLogger(__name__)

LANES = ("interactive", "batch")
PHASES = ("ttft_ms", "tpot_ms", "queue_ms", "prefill_ms", "decode_ms", "e2e_ms")
CHAT_QUESTIONS = (
    "In one sentence, what is Python's {m} module for?",
    "Name one function of Python's {m} module and say what it does.",
    "When would a programmer use the {m} module?",
)
CHAT_MODULES = (
    "json", "csv", "os", "re", "pathlib", "itertools", "collections", "datetime", "random",
    "math", "logging", "asyncio", "threading", "sqlite3", "argparse", "functools", "hashlib",
)  # fmt: skip
# Share of the chats sent, and of each job's lines, that may fail before the demo fails
# (rounded down: the quick demo's 6 chats and 4- and 8-line jobs tolerate none). A healthy
# stack fails none; the slack is for the full demo on a loaded machine.
ERROR_TOLERANCE = 0.1


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo", help="summarize + translate jobs with live chats, then the latency table"
    )
    parser.add_argument("--quick", action="store_true", help="12 lines instead of 104 (CI)")
    parser.add_argument("--documents", type=int, default=None, help="documents to summarize")
    parser.add_argument("--sentences", type=int, default=None, help="sentences to translate")
    parser.add_argument("--target-lang", default="fr", help="translation target (default: fr)")
    parser.add_argument("--summary-tokens", type=int, default=48, help="max tokens per summary")
    parser.add_argument(
        "--translation-tokens", type=int, default=32, help="max tokens per translation"
    )
    parser.add_argument("--chat-tokens", type=int, default=32, help="max tokens per chat answer")
    parser.add_argument("--chat-concurrency", type=int, default=2, help="chats in flight at once")
    parser.add_argument("--max-chats", type=int, default=None, help="default: 40 (quick: 6)")
    parser.add_argument("--no-dashboard", action="store_true", help="if the demo starts the stack")
    parser.add_argument("--out", type=Path, default=None, help="default: $LANESERVE_HOME/demo/TS")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds for the jobs")
    parser.add_argument(
        "--chat-timeout", type=float, default=120.0, help="seconds for one chat answer"
    )
    parser.add_argument(
        "--keep-running", action="store_true", help="leave a stack the demo started running"
    )
    parser.set_defaults(func=run)


# ------------------------------------------------------------------------------ statistics


def phase_summary(engine, since: float, until: float | None = None) -> dict[str, Any]:
    """Per-lane figures of the requests that arrived in [since, until] (unix seconds) from SQL.

    Returns `{lane: {"requests", "completion_tokens", "prompt_tokens", "cached_tokens",
    "errors", "<phase>": {"p50", "p99"}}}` for each phase in PHASES (milliseconds, as stored
    by the recorder)."""
    from sqlalchemy import select

    from db.models import Request
    from db.session import read_session

    cols = [getattr(Request, c) for c in PHASES]
    stmt = select(
        Request.lane,
        Request.error,
        Request.prompt_tokens,
        Request.cached_tokens,
        Request.completion_tokens,
        *cols,
    ).where(Request.arrival_at >= since, Request.finished_at.is_not(None))
    if until is not None:
        stmt = stmt.where(Request.arrival_at <= until)
    with read_session(engine) as session:
        rows = session.execute(stmt).all()
    out: dict[str, Any] = {}
    for lane in sorted({r[0] for r in rows}):
        mine = [r for r in rows if r[0] == lane]
        entry: dict[str, Any] = {
            "requests": len(mine),
            "errors": sum(1 for r in mine if r[1] is not None),
            "prompt_tokens": sum(r[2] or 0 for r in mine),
            "cached_tokens": sum(r[3] or 0 for r in mine),
            "completion_tokens": sum(r[4] or 0 for r in mine),
        }
        for i, phase in enumerate(PHASES):
            values = [r[5 + i] for r in mine if r[5 + i] is not None]
            entry[phase] = {"p50": percentile(values, 50), "p99": percentile(values, 99)}
        out[lane] = entry
    return out


def count_rows(engine, since: float, job_ids: list[str]) -> tuple[int, int]:
    """(finished rows of these jobs with timings, interactive rows since `since`)."""
    from sqlalchemy import func, select

    from db.models import Request
    from db.session import read_session

    with read_session(engine) as session:
        jobs = session.scalar(
            select(func.count()).where(Request.job_id.in_(job_ids), Request.e2e_ms.is_not(None))
        )
        chats = session.scalar(
            select(func.count()).where(
                Request.lane == "interactive",
                Request.arrival_at >= since,
                Request.e2e_ms.is_not(None),
            )
        )
    return int(jobs or 0), int(chats or 0)


# ------------------------------------------------------------------------------ chats


@dataclass(slots=True)
class ChatStats:
    """Client-side figures of the demo's interactive requests (seconds)."""

    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    tokens: int = 0
    errors: list[str] = field(default_factory=list)
    done: int = 0
    sample: tuple[str, str] | None = None
    fatal: str | None = None  # why the chat loop itself stopped (None: it ran to its end)


def run_chats(
    base_url: str,
    api_key: str,
    stop: threading.Event,
    stats: ChatStats,
    max_chats: int,
    concurrency: int,
    max_tokens: int,
    timeout_s: float = 120.0,
) -> None:
    """Send chat requests (streamed, OpenAI client, `timeout_s` seconds each) until `stop` is
    set or `max_chats` sent; the first `concurrency` are sent even when `stop` is already set,
    so the lanes always overlap. A failed chat is counted in `stats.errors`; anything that
    stops the loop itself (no client, no model listed) is recorded in `stats.fatal`."""

    async def main() -> None:
        import openai

        client = openai.AsyncOpenAI(
            base_url=base_url, api_key=api_key, max_retries=0, timeout=timeout_s
        )
        model = (await client.models.list()).data[0].id
        counter = iter(range(max_chats))

        async def one_loop() -> None:
            for i in counter:
                if stop.is_set() and i >= concurrency:
                    return
                module = CHAT_MODULES[i % len(CHAT_MODULES)]
                question = CHAT_QUESTIONS[i % len(CHAT_QUESTIONS)].format(m=module)
                await one_chat(client, model, question)

        await asyncio.gather(*(one_loop() for _ in range(concurrency)))
        await client.close()

    async def one_chat(client, model: str, question: str) -> None:
        start = time.perf_counter()
        ttft = None
        parts: list[str] = []
        tokens = 0
        try:
            stream = await client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": question}],
                max_tokens=max_tokens,
                temperature=0.7,
                stream=True,
                stream_options={"include_usage": True},
            )
            async for chunk in stream:
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
                for choice in chunk.choices:
                    if choice.delta.content:
                        ttft = ttft if ttft is not None else time.perf_counter() - start
                        parts.append(choice.delta.content)
        except Exception as exc:  # counted and reported: a failed chat fails the demo
            stats.errors.append(f"{type(exc).__name__}: {exc}")
            return
        total = time.perf_counter() - start
        stats.done += 1
        stats.tokens += tokens
        if ttft is not None:
            stats.ttft_s.append(ttft)
            if tokens > 1:
                stats.tpot_s.append((total - ttft) / (tokens - 1))
        if stats.sample is None and parts:
            stats.sample = (question, "".join(parts).strip())

    try:
        asyncio.run(main())
    except Exception as exc:  # reported as the interactive lane's failure, never dropped
        logger.debug("the chat loop stopped", exc_info=True)
        stats.fatal = f"{type(exc).__name__}: {exc}"


# ------------------------------------------------------------------------------ stack


def start_stack(home: Path, no_dashboard: bool, console, keep: bool = False) -> subprocess.Popen:
    """Run `laneserve up` as a child (stopped by the caller); return once it is ready.

    Raises:
        RuntimeError: it exited or did not become ready (the message has its log's tail).
    """
    from laneserve.commands.up import DEFAULT_API_PORT, DEFAULT_DASHBOARD_PORT, port_free
    from laneserve.stack import start_stack_process

    args = ["--api-port", str(DEFAULT_API_PORT if port_free(DEFAULT_API_PORT) else 0)]
    if no_dashboard:
        args.append("--no-dashboard")
    else:
        port = DEFAULT_DASHBOARD_PORT if port_free(DEFAULT_DASHBOARD_PORT) else 0
        args += ["--dashboard-port", str(port)]
    with console.status("starting the stack (the first run downloads the model) ..."):
        proc, _ = start_stack_process(home, args, watch_parent=not keep)
    return proc


# ------------------------------------------------------------------------------ run


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from laneserve.commands.up import quiet_http_logs
    from laneserve.stack import laneserve_home, running_stack

    quiet_http_logs()
    console = Console(stderr=True)
    home = laneserve_home().resolve()
    home.mkdir(parents=True, exist_ok=True)
    info = running_stack(home)
    proc = None
    if info is None:
        try:
            proc = start_stack(home, args.no_dashboard, console, keep=args.keep_running)
        except RuntimeError as exc:
            console.print(f"[red]laneserve demo: {exc}")
            return 1
        info = running_stack(home)
    else:
        console.print(f"using the running stack at {info['api_url']}")
    try:
        return _demo(
            args, home, info, console, stops_after=proc is not None and not args.keep_running
        )
    except KeyboardInterrupt:
        console.print("[yellow]interrupted")
        return 130
    finally:
        if proc is not None and args.keep_running and proc.poll() is None:
            console.print(
                f"the stack keeps running (supervisor pid {proc.pid}); "
                f"stop it with: kill -INT {proc.pid}"
            )
        elif proc is not None:
            from laneserve.stack import stop_stack_process

            with console.status("stopping the stack ..."):
                stop_stack_process(proc)
            console.print("stack stopped")


def _demo(
    args: argparse.Namespace, home: Path, info: dict, console, stops_after: bool = False
) -> int:
    from laneserve.commands.submit import open_engine
    from laneserve.demo_corpus import build_corpus, write_jsonl

    n_docs = args.documents if args.documents is not None else (4 if args.quick else 40)
    n_sents = args.sentences if args.sentences is not None else (8 if args.quick else 64)
    max_chats = args.max_chats if args.max_chats is not None else (6 if args.quick else 40)
    out = args.out or home / "demo" / time.strftime("%Y%m%d-%H%M%S")
    corpus = build_corpus(n_docs, n_sents)
    inputs = {
        "summarize": write_jsonl(out / "documents.jsonl", corpus.documents),
        "translate": write_jsonl(out / "sentences.jsonl", corpus.sentences),
    }
    console.print(
        f"corpus from the standard library's docstrings: {len(corpus.documents)} documents "
        f"to summarize, {len(corpus.sentences)} sentences to translate into {args.target_lang} "
        f"({out})"
    )
    engine = open_engine(None)  # the stack's db_url from stack.json
    t0 = time.time()
    jobs = _submit_jobs(engine, inputs, args)
    stop = threading.Event()
    chats = ChatStats()
    key = env.get("LANESERVE_API_KEY") or "none"
    chat_thread = threading.Thread(
        target=run_chats,
        args=(
            info["api_url"] + "/v1", key, stop, chats, max_chats,
            args.chat_concurrency, args.chat_tokens, args.chat_timeout,
        ),
        daemon=True,
    )  # fmt: skip
    chat_thread.start()
    final, problems = _follow(engine, jobs, chats, stop, chat_thread, max_chats, args, console)
    t1 = time.time()
    # The recorder commits within about a second; wait for every row (bounded).
    total_lines = sum(j.request_counts["total"] for j in final.values())
    for _ in range(60):
        n_jobs, n_chats = count_rows(engine, t0, [j.id for j in final.values()])
        if n_jobs >= total_lines and n_chats >= chats.done:
            break
        time.sleep(0.5)
    summary = phase_summary(engine, t0 - 1.0, t1)
    files = _copy_results(engine, final, out)
    engine.dispose()
    report = _report(final, chats, summary, files, t1 - t0, info, stops_after)
    failures = problems + lane_failures(report)
    report["ok"], report["failures"] = not failures, failures
    (out / "summary.json").write_text(json.dumps(report, indent=2))
    from rich.console import Console

    _print_report(report, final, files, chats, out, Console())  # the report goes to stdout
    if failures:
        console.print("[bold red]laneserve demo failed:")
        for reason in failures:
            console.print(f"  - {reason}", style="red", soft_wrap=True, markup=False)
        return 1
    return 0


def _submit_jobs(engine, inputs: dict[str, Path], args: argparse.Namespace) -> dict[str, Any]:
    """Create the summarize and translate jobs from their input files; {name: jobs row}."""
    from jobs import service

    options = {
        "summarize": {"max_tokens": args.summary_tokens},
        "translate": {"max_tokens": args.translation_tokens, "target_lang": args.target_lang},
    }
    jobs = {}
    for name, path in inputs.items():
        with path.open("rb") as f:
            file = service.create_file(engine, f, path.name)
        jobs[name] = service.create_batch(
            engine, file.id, "/v1/chat/completions", task=name, task_options=options[name]
        )
    return jobs


def _follow(
    engine, jobs: dict, chats: ChatStats, stop: threading.Event, chat_thread: threading.Thread,
    max_chats: int, args: argparse.Namespace, console,
) -> tuple[dict, list[str]]:  # fmt: skip
    """Progress bars until every job ends (or `args.timeout` seconds pass: the rest are
    cancelled), then stop the chats. Returns ({name: last jobs row}, problems seen)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from jobs import service

    columns = (
        TextColumn("{task.description:<34}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[note]}"),
        TimeElapsedColumn(),
    )
    deadline = time.monotonic() + args.timeout
    cancel_deadline = None  # set once the jobs are cancelled: how long to wait for that
    rows: dict[str, Any] = {}
    problems: list[str] = []
    with Progress(*columns, console=console) as bar:
        bars = {
            name: bar.add_task(f"{name} job {job.id[-8:]}", total=None, note="validating")
            for name, job in jobs.items()
        }
        chat_bar = bar.add_task("interactive chats (OpenAI client)", total=max_chats, note="")
        while True:
            for name, job in jobs.items():
                rows[name] = row = service.get_batch(engine, job.id)
                c = row.request_counts
                note = row.status + (f", {c['failed']} failed" if c["failed"] else "")
                bar.update(
                    bars[name], total=c["total"] or None, completed=c["completed"] + c["failed"],
                    note=note,
                )  # fmt: skip
            ttft = percentile([x * 1000 for x in chats.ttft_s], 50)
            bar.update(
                chat_bar, completed=chats.done + len(chats.errors),
                note=f"TTFT P50 {ttft:.0f} ms" if ttft is not None else "",
            )  # fmt: skip
            if all(service.is_terminal(r.status) for r in rows.values()):
                break
            now = time.monotonic()
            if cancel_deadline is None and now > deadline:
                unfinished = [n for n, r in rows.items() if not service.is_terminal(r.status)]
                for name in unfinished:
                    service.cancel_batch(engine, jobs[name].id)
                problems.append(
                    f"{' and '.join(unfinished)} not done after {args.timeout:.0f} s; cancelled"
                )
                cancel_deadline = now + 60.0
            elif cancel_deadline is not None and now > cancel_deadline:
                break  # the report shows the status they are stuck in
            time.sleep(0.5)
        stop.set()
        join_s = args.chat_timeout + 30.0  # an in-flight chat ends within its own timeout
        chat_thread.join(timeout=join_s)
        if chat_thread.is_alive():
            problems.append(f"interactive chats still running {join_s:.0f} s after the jobs")
        sent = chats.done + len(chats.errors)
        bar.update(chat_bar, completed=sent, total=sent)
    return rows, problems


def _copy_results(engine, final: dict, out: Path) -> dict[str, str]:
    """Copy each job's output and error file next to the demo's inputs; {"NAME_KIND": path}."""
    from jobs.files import copy_file_content

    files = {}
    for name, job in final.items():
        for kind, file_id in (("output", job.output_file_id), ("errors", job.error_file_id)):
            if file_id is not None:
                dest = out / f"{name}_{kind}.jsonl"
                copy_file_content(engine, file_id, dest)
                files[f"{name}_{kind}"] = str(dest)
    return files


def _report(
    final: dict, chats: ChatStats, summary: dict, files: dict, wall: float, info: dict,
    stops_after: bool,
) -> dict[str, Any]:  # fmt: skip
    """The demo's summary.json (without its verdict, `ok` and `failures`)."""
    return {
        "wall_s": round(wall, 2),
        "jobs": {n: {"id": j.id, "status": j.status, **j.request_counts} for n, j in final.items()},
        "chats": {
            "done": chats.done,
            "errors": len(chats.errors),
            "first_error": chats.errors[0] if chats.errors else None,
            "fatal": chats.fatal,
            "client_ttft_ms_p50": _ms(percentile(chats.ttft_s, 50)),
            "client_ttft_ms_p99": _ms(percentile(chats.ttft_s, 99)),
            "client_tpot_ms_p50": _ms(percentile(chats.tpot_s, 50)),
        },
        "lanes": summary,
        "throughput_tokens_per_s": {
            lane: round(s["completion_tokens"] / wall, 2) for lane, s in summary.items()
        },
        "files": files,
        "dashboard_url": info.get("dashboard_url"),
        "stack_stops_after_demo": stops_after,
    }


def lane_failures(report: dict[str, Any], tolerance: float = ERROR_TOLERANCE) -> list[str]:
    """Why the demo's run does not show both lanes working, one reason each ([]: it does).

    A lane fails, rather than reporting a figure, when: a job ended other than `completed`,
    or more than `tolerance` of its lines failed; no chat was answered, the chat loop itself
    stopped, or more than `tolerance` of the chats sent failed; or a lane that answered has
    no request with a TTFT in SQL (`report["lanes"]`, from the recorder). Shares round down."""
    reasons = []
    for name, job in report["jobs"].items():
        if job["status"] != "completed":
            reasons.append(f"{name} job {job['id']} ended {job['status']}")
        elif job["failed"] > int(tolerance * job["total"]):
            reasons.append(f"{name} job: {job['failed']} of {job['total']} lines failed")
    c = report["chats"]
    sent = c["done"] + c["errors"]
    first = f"; first error: {c['first_error']}" if c["first_error"] else ""
    if c["fatal"]:
        reasons.append(f"interactive chats stopped: {c['fatal']}")
    if c["done"] == 0:
        reasons.append(f"interactive lane: no chat answered ({sent} sent{first})")
    elif c["errors"] > int(tolerance * sent):
        reasons.append(f"interactive lane: {c['errors']} of {sent} chats failed{first}")
    answered = {
        "interactive": c["done"] > 0,
        "batch": any(j["completed"] > 0 for j in report["jobs"].values()),
    }
    for lane in LANES:
        s = report["lanes"].get(lane)
        if answered[lane] and (s is None or s["ttft_ms"]["p50"] is None):
            reasons.append(f"{lane} lane: answered, but SQL has no request with a TTFT")
    return reasons


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


def _print_report(report, final, files, chats: ChatStats, out: Path, console) -> None:
    from rich.table import Table

    table = Table(title="per-lane, per-phase latency (ms, from SQL)")
    table.add_column("phase")
    for lane in LANES:  # both lanes always: an empty lane shows as "-", and is named below
        table.add_column(f"{lane} P50", justify="right")
        table.add_column(f"{lane} P99", justify="right")
    empty = {"p50": None, "p99": None}
    for phase in PHASES:
        name = phase.removesuffix("_ms")
        name = name.upper() if name in ("ttft", "tpot") else name
        cells = []
        for lane in LANES:
            s = report["lanes"].get(lane, {}).get(phase, empty)
            cells += [_fmt(s["p50"]), _fmt(s["p99"])]
        table.add_row(name, *cells)
    console.print(table)
    for lane in LANES:
        s = report["lanes"].get(lane)
        if s is None:
            console.print(f"[bold red]{lane} lane: no request recorded in SQL")
        elif s["ttft_ms"]["p50"] is None:
            n, e = s["requests"], s["errors"]
            console.print(f"[bold red]{lane} lane: none of its {n} requests ({e} errors) answered")
    tp = Table(title=f"throughput over {report['wall_s']:.0f} s")
    for col in ("lane", "requests", "errors", "prompt tok", "cached", "output tok", "tok/s"):
        tp.add_column(col, justify="right" if col != "lane" else "left")
    for lane in LANES:
        s = report["lanes"].get(lane)
        if s is None:
            tp.add_row(lane, "0", "0", "0", "0", "0", "0.0")
            continue
        tp.add_row(
            lane, str(s["requests"]), str(s["errors"]), str(s["prompt_tokens"]),
            str(s["cached_tokens"]), str(s["completion_tokens"]),
            f"{report['throughput_tokens_per_s'][lane]:.1f}",
        )  # fmt: skip
    console.print(tp)
    for name, job in final.items():
        c = job.request_counts
        console.print(
            f"{name}: {job.status}, {c['completed']} completed, {c['failed']} failed of {c['total']}"
        )
    c = report["chats"]
    console.print(
        f"interactive chats: {c['done']} answered, {c['errors']} errors; client-side TTFT "
        f"P50 {_fmt(c['client_ttft_ms_p50'])} ms, P99 {_fmt(c['client_ttft_ms_p99'])} ms"
    )
    if chats.sample:
        console.print(f"  e.g. [bold]{chats.sample[0]}[/bold] -> {chats.sample[1][:200]}")
    for key, path in files.items():
        sample = _first_answer(Path(path)) if key.endswith("_output") else None
        console.print(f"{key}: {path}" + (f"\n  e.g. {sample[:200]}" if sample else ""))
    console.print(f"summary: {out / 'summary.json'}")
    if report["dashboard_url"]:
        note = ""
        if report["stack_stops_after_demo"]:
            note = " (live while the stack runs: `laneserve up` first, or --keep-running)"
        console.print(f"dashboard: {report['dashboard_url']}{note}")


def _first_answer(path: Path) -> str | None:
    try:
        line = json.loads(path.read_text().splitlines()[0])
        return line["response"]["body"]["choices"][0]["message"]["content"].strip()
    except (OSError, IndexError, KeyError, TypeError, json.JSONDecodeError):
        return None
