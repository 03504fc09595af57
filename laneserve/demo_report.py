"""The demo's figures and verdict: per-lane latency percentiles from SQL, the summary.json
report, the lane checks (`lane_failures`) and the printed tables (``laneserve demo``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from laneserve.contracts.latency import percentile
from laneserve.demo_chats import ChatStats
from laneserve.gpu_worker.model_files import DEFAULT_MODEL

LANES = ("interactive", "batch")
PHASES = ("ttft_ms", "tpot_ms", "queue_ms", "prefill_ms", "decode_ms", "e2e_ms")
# Share of the chats sent, and of each job's lines, that may fail before the demo fails
# (rounded down: the quick demo's 6 chats and 4- and 8-line jobs tolerate none). A healthy
# stack fails none; the slack is for the full demo on a loaded machine.
ERROR_TOLERANCE = 0.1


def phase_summary(engine, since: float, until: float | None = None) -> dict[str, Any]:
    """Per-lane figures of the requests that arrived in [since, until] (unix seconds) from SQL.

    Returns `{lane: {"requests", "completion_tokens", "prompt_tokens", "cached_tokens",
    "errors", "<phase>": {"p50", "p99"}}}` for each phase in PHASES (milliseconds, as stored
    by the recorder)."""
    from sqlalchemy import select

    from laneserve.db.models import Request
    from laneserve.db.session import read_session

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

    from laneserve.db.models import Request
    from laneserve.db.session import read_session

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


def build_report(
    final: dict, chats: ChatStats, summary: dict, files: dict, wall: float, info: dict,
    stops_after: bool,
) -> dict[str, Any]:  # fmt: skip
    """The demo's summary.json (without its verdict, `ok` and `failures`)."""
    return {
        "wall_s": round(wall, 2),
        "jobs": {
            n: {
                "id": j.id,
                "status": j.status,
                **j.request_counts,
                "cut_at_max_tokens": cut_answers(Path(files[f"{n}_output"]))
                if f"{n}_output" in files
                else 0,
            }
            for n, j in final.items()
        },  # fmt: skip
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
        "model": info.get("model"),
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


def cpu_kernel_state() -> str:
    """Where this machine's C++ CPU kernels stand (kernels/cpu_ext.py): "built", "not built"
    (a worker starting now compiles them in the background and serves on the slower PyTorch
    path meanwhile), "off" (LANESERVE_CPU_KERNELS=0) or "gpu" (a CUDA device serves instead)."""
    import torch

    from laneserve.contracts import env

    if torch.cuda.is_available():
        return "gpu"
    if not env.get("LANESERVE_CPU_KERNELS"):
        return "off"
    from laneserve.kernels import cpu_ext

    return "built" if cpu_ext.is_built() else "not built"


def kernel_note(at_start: str, at_end: str) -> str | None:
    """What the figures owe to the CPU kernels' state, or None when they ran throughout."""
    if at_start == "off":
        return "C++ CPU kernels off (LANESERVE_CPU_KERNELS=0): these are the PyTorch path's figures"
    if at_start != "not built":
        return None
    when = "still building for part of this run" if at_end == "built" else "not built in this run"
    return (
        f"the C++ CPU kernels were {when}: the worker served on the slower PyTorch path "
        "meanwhile, so these figures are (partly) the slow path's; run the demo again for the fast path"
    )


def print_report(report, final, files, chats: ChatStats, out: Path, console) -> None:
    """The demo's tables and notes (latency per lane and phase, throughput, jobs, chats,
    files, dashboard) on the rich `console`."""
    console.print(_latency_table(report))
    if report.get("cpu_kernels", {}).get("note"):
        console.print(f"[bold yellow]note: {report['cpu_kernels']['note']}")
    for lane in LANES:
        s = report["lanes"].get(lane)
        if s is None:
            console.print(f"[bold red]{lane} lane: no request recorded in SQL")
        elif s["ttft_ms"]["p50"] is None:
            n, e = s["requests"], s["errors"]
            console.print(f"[bold red]{lane} lane: none of its {n} requests ({e} errors) answered")
    console.print(_throughput_table(report))
    _print_outcomes(report, final, files, chats, out, console)


def _latency_table(report):
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
    return table


def _throughput_table(report):
    from rich.table import Table

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
    return tp


def _print_outcomes(report, final, files, chats: ChatStats, out: Path, console) -> None:
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
        cut = ""
        job = report["jobs"].get(key.removesuffix("_output")) if key.endswith("_output") else None
        if job and job["cut_at_max_tokens"]:  # counted once, in build_report
            flag = CUT_FLAGS.get(key.removesuffix("_output"), "max_tokens")
            cut = (f" ({job['cut_at_max_tokens']} of {job['completed']} answers cut at their "
                   f"max tokens: {flag} raises it)")  # fmt: skip
        # a path is never wrapped (a wrapped path cannot be copied): the terminal folds the line
        console.print(f"{key}: {path}{cut}", soft_wrap=True)
        if key == "translate_output" and report.get("model") == DEFAULT_MODEL:
            console.print(f"  {NO_TRANSLATION}")  # no sample: the small model does not translate
        elif sample:
            console.print(f"  e.g. {sample[:200]}")
    console.print(f"summary: {out / 'summary.json'}", soft_wrap=True)
    if report["dashboard_url"]:
        note = ""
        if report["stack_stops_after_demo"]:
            note = " (live while the stack runs: `laneserve up` first, or --keep-running)"
        console.print(f"dashboard: {report['dashboard_url']}{note}")


# Measured on the demo's sentences (docs/benchmarks.md, "The demo's tasks"): the bundled 135M
# model answers a translation prompt with garbled French or an explanation in English.
NO_TRANSLATION = (
    "the bundled 135M model does not translate (its answers are not shown): this job is the "
    "batch lane's load; `scripts/demo --model DIR` runs it on a model that translates"
)
# the demo flag that sets each job's max tokens per answer
CUT_FLAGS = {"summarize": "--summary-tokens", "translate": "--translation-tokens"}


def cut_answers(path: Path) -> int:
    """The answers of a job's output file that ended at their max tokens."""
    cut = 0
    try:
        for text in path.read_text().splitlines():
            choices = json.loads(text)["response"]["body"]["choices"]
            cut += choices[0].get("finish_reason") == "length"
    except (OSError, KeyError, IndexError, TypeError, json.JSONDecodeError):
        pass
    return cut


def _first_answer(path: Path) -> str | None:
    """The first answer of a job's output file that finished on its own (`finish_reason`
    "stop"), else its first answer: the example shown is a whole one when there is one (how many
    were cut is said beside it)."""
    try:
        choices = [
            json.loads(line)["response"]["body"]["choices"][0]
            for line in path.read_text().splitlines()
        ]
        whole = [c for c in choices if c.get("finish_reason") == "stop"]
        return (whole or choices)[0]["message"]["content"].strip()
    except (OSError, IndexError, KeyError, TypeError, json.JSONDecodeError):
        return None
