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

Output lengths are kept modest (summaries 48 tokens, translations 32, chats 32) so the full
demo finishes in a few minutes on a 2-core CPU with the bundled 135M model.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
        "--keep-running", action="store_true", help="leave a stack the demo started running"
    )
    parser.set_defaults(func=run)


# ------------------------------------------------------------------------------ statistics


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100) with linear interpolation (numpy's default), None if empty."""
    import numpy as np

    return float(np.percentile(np.asarray(values, dtype=float), q)) if values else None


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


def run_chats(
    base_url: str,
    api_key: str,
    stop: threading.Event,
    stats: ChatStats,
    max_chats: int,
    concurrency: int,
    max_tokens: int,
) -> None:
    """Send chat requests (streamed, OpenAI client) until `stop` is set or `max_chats` sent."""
    import openai

    async def main() -> None:
        client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        model = (await client.models.list()).data[0].id
        counter = iter(range(max_chats))

        async def one_loop() -> None:
            for i in counter:
                if stop.is_set():
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
        except openai.APIError as exc:
            stats.errors.append(str(exc))
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

    asyncio.run(main())


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
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from jobs import service
    from jobs.files import copy_file_content
    from laneserve.commands.submit import open_engine
    from laneserve.demo_corpus import build_corpus, write_jsonl

    n_docs = args.documents if args.documents is not None else (4 if args.quick else 40)
    n_sents = args.sentences if args.sentences is not None else (8 if args.quick else 64)
    max_chats = args.max_chats if args.max_chats is not None else (6 if args.quick else 40)
    out = args.out or home / "demo" / time.strftime("%Y%m%d-%H%M%S")
    corpus = build_corpus(n_docs, n_sents)
    docs_path = write_jsonl(out / "documents.jsonl", corpus.documents)
    sents_path = write_jsonl(out / "sentences.jsonl", corpus.sentences)
    console.print(
        f"corpus from the standard library's docstrings: {len(corpus.documents)} documents "
        f"to summarize, {len(corpus.sentences)} sentences to translate into {args.target_lang} "
        f"({out})"
    )
    engine = open_engine(None)  # the stack's db_url from stack.json
    t0 = time.time()
    jobs = {}
    for name, path, task, options in (
        ("summarize", docs_path, "summarize", {"max_tokens": args.summary_tokens}),
        (
            "translate",
            sents_path,
            "translate",
            {"max_tokens": args.translation_tokens, "target_lang": args.target_lang},
        ),
    ):
        with path.open("rb") as f:
            file = service.create_file(engine, f, path.name)
        jobs[name] = service.create_batch(
            engine, file.id, "/v1/chat/completions", task=task, task_options=options
        )
    stop = threading.Event()
    chats = ChatStats()
    key = os.environ.get("LANESERVE_API_KEY") or "none"
    chat_thread = threading.Thread(
        target=run_chats,
        args=(
            info["api_url"] + "/v1", key, stop, chats, max_chats,
            args.chat_concurrency, args.chat_tokens,
        ),
        daemon=True,
    )  # fmt: skip
    chat_thread.start()
    columns = (
        TextColumn("{task.description:<34}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[note]}"),
        TimeElapsedColumn(),
    )
    deadline = time.monotonic() + args.timeout
    final = {}
    with Progress(*columns, console=console) as bar:
        bars = {
            name: bar.add_task(f"{name} job {job.id[-8:]}", total=None, note="validating")
            for name, job in jobs.items()
        }
        chat_bar = bar.add_task("interactive chats (OpenAI client)", total=max_chats, note="")
        while len(final) < len(jobs):
            for name, job in jobs.items():
                if name in final:
                    continue
                row = service.get_batch(engine, job.id)
                c = row.request_counts
                note = row.status + (f", {c['failed']} failed" if c["failed"] else "")
                bar.update(
                    bars[name], total=c["total"] or None, completed=c["completed"] + c["failed"],
                    note=note,
                )  # fmt: skip
                if service.is_terminal(row.status):
                    final[name] = row
            ttft = percentile([x * 1000 for x in chats.ttft_s], 50)
            bar.update(
                chat_bar, completed=chats.done + len(chats.errors),
                note=f"TTFT P50 {ttft:.0f} ms" if ttft is not None else "",
            )  # fmt: skip
            if time.monotonic() > deadline:
                for name, job in jobs.items():
                    if name not in final:
                        service.cancel_batch(engine, job.id)
                console.print(f"[red]jobs not done after {args.timeout:.0f}s; cancelled")
                stop.set()
                return 1
            time.sleep(0.5)
        stop.set()
        chat_thread.join(timeout=120)
        sent = chats.done + len(chats.errors)
        bar.update(chat_bar, completed=sent, total=sent)
    t1 = time.time()
    # The recorder commits within about a second; wait for every row (bounded).
    total_lines = sum(j.request_counts["total"] for j in final.values())
    for _ in range(60):
        n_jobs, n_chats = count_rows(engine, t0, [j.id for j in final.values()])
        if n_jobs >= total_lines and n_chats >= chats.done:
            break
        time.sleep(0.5)
    summary = phase_summary(engine, t0 - 1.0, t1)
    files = {}
    for name, job in final.items():
        for kind, file_id in (("output", job.output_file_id), ("errors", job.error_file_id)):
            if file_id is not None:
                dest = out / f"{name}_{kind}.jsonl"
                copy_file_content(engine, file_id, dest)
                files[f"{name}_{kind}"] = str(dest)
    engine.dispose()
    wall = t1 - t0
    report = {
        "wall_s": round(wall, 2),
        "jobs": {n: {"id": j.id, "status": j.status, **j.request_counts} for n, j in final.items()},
        "chats": {
            "done": chats.done,
            "errors": len(chats.errors),
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
    (out / "summary.json").write_text(json.dumps(report, indent=2))
    from rich.console import Console

    _print_report(report, final, files, chats, out, Console())  # the report goes to stdout
    ok = all(j.status == "completed" for j in final.values())
    return 0 if ok else 1


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


def _print_report(report, final, files, chats: ChatStats, out: Path, console) -> None:
    from rich.table import Table

    table = Table(title="per-lane, per-phase latency (ms, from SQL)")
    lanes = list(report["lanes"])
    table.add_column("phase")
    for lane in lanes:
        table.add_column(f"{lane} P50", justify="right")
        table.add_column(f"{lane} P99", justify="right")
    for phase in PHASES:
        name = phase.removesuffix("_ms")
        name = name.upper() if name in ("ttft", "tpot") else name
        cells = []
        for lane in lanes:
            s = report["lanes"][lane][phase]
            cells += [_fmt(s["p50"]), _fmt(s["p99"])]
        table.add_row(name, *cells)
    console.print(table)
    tp = Table(title=f"throughput over {report['wall_s']:.0f} s")
    for col in ("lane", "requests", "prompt tokens", "cached", "output tokens", "output tok/s"):
        tp.add_column(col, justify="right" if col != "lane" else "left")
    for lane, s in report["lanes"].items():
        tp.add_row(
            lane, str(s["requests"]), str(s["prompt_tokens"]), str(s["cached_tokens"]),
            str(s["completion_tokens"]), f"{report['throughput_tokens_per_s'][lane]:.1f}",
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
