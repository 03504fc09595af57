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
import json
import logging
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from laneserve.contracts import env
from laneserve.contracts.latency import percentile
from laneserve.demo_chats import ChatStats, run_chats
from laneserve.demo_report import (
    build_report,
    count_rows,
    cpu_kernel_state,
    kernel_note,
    lane_failures,
    phase_summary,
    print_report,
)

logger = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo", help="summarize + translate jobs with live chats, then the latency table"
    )
    parser.add_argument("--quick", action="store_true", help="12 lines instead of 104 (CI)")
    parser.add_argument(
        "--model",
        default=None,
        help="serve this model (alias, .gguf file or Hugging Face directory; as `up --model`) "
        "when the demo starts the stack; default: the bundled smollm2-135m",
    )
    parser.add_argument("--documents", type=int, default=None, help="documents to summarize")
    parser.add_argument("--sentences", type=int, default=None, help="sentences to translate")
    parser.add_argument("--target-lang", default="fr", help="translation target (default: fr)")
    parser.add_argument(
        "--summary-tokens",
        type=int,
        default=128,  # the bundled model's summaries of the demo's documents: 35-128 tokens
        help="max tokens per summary",
    )
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


# ------------------------------------------------------------------------------ stack


def start_stack(
    home: Path, no_dashboard: bool, console, keep: bool = False, model: str | None = None
) -> subprocess.Popen:
    """Run `laneserve up` as a child (stopped by the caller); return once it is ready.

    Raises:
        RuntimeError: it exited or did not become ready (the message has its log's tail).
    """
    from laneserve.commands.up_args import DEFAULT_API_PORT, DEFAULT_DASHBOARD_PORT
    from laneserve.commands.up_host import port_free
    from laneserve.stack import start_stack_process

    args = ["--api-port", str(DEFAULT_API_PORT if port_free(DEFAULT_API_PORT) else 0)]
    if model:
        args += ["--model", model]
    if no_dashboard:
        args.append("--no-dashboard")
    else:
        port = DEFAULT_DASHBOARD_PORT if port_free(DEFAULT_DASHBOARD_PORT) else 0
        args += ["--dashboard-port", str(port)]
    console.print(f"starting the stack in {home}: broker, worker, recorder, jobs runner, API ...")
    with console.status(
        "starting the stack (the worker loads the model; minutes on a first run) ..."
    ):
        proc, _ = start_stack_process(home, args, watch_parent=not keep)
    return proc


# ------------------------------------------------------------------------------ run


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from laneserve.commands.up import quiet_http_logs
    from laneserve.stack import laneserve_home, running_stack

    quiet_http_logs()
    # lines are not folded at 80 columns where the output is a file or a pipe, not a terminal
    console = Console(stderr=True, soft_wrap=not sys.stderr.isatty())
    home = laneserve_home().resolve()
    home.mkdir(parents=True, exist_ok=True)
    info = running_stack(home)
    args.kernels_at_start = cpu_kernel_state()
    proc = None
    if info is None:
        try:
            proc = start_stack(
                home, args.no_dashboard, console, keep=args.keep_running, model=args.model
            )
        except RuntimeError as exc:
            console.print(f"[red]laneserve demo: {exc}")
            return 1
        info = running_stack(home)
    else:
        console.print(f"using the running stack at {info['api_url']}")
        if args.model:
            console.print("[yellow]--model is for a stack the demo starts: serving what runs")
    console.print(f"stack ready: API {info['api_url']}, dashboard {info.get('dashboard_url')}")
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
                f"stop it with: laneserve down (or kill -INT {proc.pid})"
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
    _wait_for_rows(engine, t0, final, chats)
    summary = phase_summary(engine, t0 - 1.0, t1)
    files = _copy_results(engine, final, out)
    engine.dispose()
    report = build_report(final, chats, summary, files, t1 - t0, info, stops_after)
    at_end = cpu_kernel_state()
    report["cpu_kernels"] = {
        "at_start": args.kernels_at_start,
        "at_end": at_end,
        "note": kernel_note(args.kernels_at_start, at_end),
    }
    failures = problems + lane_failures(report)
    report["ok"], report["failures"] = not failures, failures
    (out / "summary.json").write_text(json.dumps(report, indent=2))
    from rich.console import Console

    stdout = Console(soft_wrap=not sys.stdout.isatty())
    print_report(report, final, files, chats, out, stdout)  # the report goes to stdout
    if failures:
        console.print("[bold red]laneserve demo failed:")
        for reason in failures:
            console.print(f"  - {reason}", style="red", soft_wrap=True, markup=False)
        return 1
    return 0


def _wait_for_rows(engine, since: float, final: dict, chats: ChatStats) -> None:
    """The recorder commits within about a second: wait (at most 30 s) for every job line's
    and every answered chat's row since `since` (unix s)."""
    total_lines = sum(j.request_counts["total"] for j in final.values())
    for _ in range(60):
        n_jobs, n_chats = count_rows(engine, since, [j.id for j in final.values()])
        if n_jobs >= total_lines and n_chats >= chats.done:
            return
        time.sleep(0.5)


def _submit_jobs(engine, inputs: dict[str, Path], args: argparse.Namespace) -> dict[str, Any]:
    """Create the summarize and translate jobs from their input files; {name: jobs row}."""
    from laneserve.jobs import service

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

    from laneserve.jobs import service

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
            _update_bars(engine, jobs, rows, bar, bars)
            ttft = percentile([x * 1000 for x in chats.ttft_s], 50)
            bar.update(
                chat_bar, completed=chats.done + len(chats.errors),
                note=f"TTFT P50 {ttft:.0f} ms" if ttft is not None else "",
            )  # fmt: skip
            if all(service.is_terminal(r.status) for r in rows.values()):
                break
            now = time.monotonic()
            if cancel_deadline is None and now > deadline:
                problems.append(_cancel_unfinished(engine, jobs, rows, args.timeout))
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


def _update_bars(engine, jobs: dict, rows: dict, bar, bars: dict) -> None:
    """Read each job's row into `rows` and show its counts on its progress bar."""
    from laneserve.jobs import service

    for name, job in jobs.items():
        rows[name] = row = service.get_batch(engine, job.id)
        c = row.request_counts
        note = row.status + (f", {c['failed']} failed" if c["failed"] else "")
        bar.update(
            bars[name], total=c["total"] or None, completed=c["completed"] + c["failed"],
            note=note,
        )  # fmt: skip


def _cancel_unfinished(engine, jobs: dict, rows: dict, timeout_s: float) -> str:
    """Cancel the jobs not done after `timeout_s` seconds; returns the problem to report."""
    from laneserve.jobs import service

    unfinished = [n for n, r in rows.items() if not service.is_terminal(r.status)]
    for name in unfinished:
        service.cancel_batch(engine, jobs[name].id)
    return f"{' and '.join(unfinished)} not done after {timeout_s:.0f} s; cancelled"


def _copy_results(engine, final: dict, out: Path) -> dict[str, str]:
    """Copy each job's output and error file next to the demo's inputs; {"NAME_KIND": path}."""
    from laneserve.jobs.files import copy_file_content

    files = {}
    for name, job in final.items():
        for kind, file_id in (("output", job.output_file_id), ("errors", job.error_file_id)):
            if file_id is not None:
                dest = out / f"{name}_{kind}.jsonl"
                copy_file_content(engine, file_id, dest)
                files[f"{name}_{kind}"] = str(dest)
    return files
