#!/usr/bin/env python
"""A bulk job through the stack against the offline engine on the same lines (issue 53).

For each size in `--lines` the same summarization lines (the stdlib documents of
`benchlib.sample_documents`, chat-templated, `--max-tokens` forced output tokens with
`ignore_eos`) run:

1. **offline**: the offline `LLM` (`llm.chat`, greedy) in a process of its own, with the engine
   options `laneserve up` gives a worker on this machine (`--offline-defaults`: the `LLM`'s own
   defaults instead);
2. **alone**: a fresh stack (`laneserve up`, defaults), the lines as an OpenAI batch file through
   `POST /v1/files` + `POST /v1/batches`, nothing else running;
3. **after_chat**: a fresh stack that answered one one-token chat ("Hi", `max_tokens` 1, as a
   health check or a greeting would) before the same job;
4. **beside_chats** (`--interactive-rate R`): a fresh stack that first answers `--chats` chats
   idle (their idle TTFT/TPOT), then runs the job while the same chats arrive at `R` per second
   (Poisson; a third one-token answers to "Hi", a third short prompts, a third of 200-400 words,
   32 forced tokens). Reported: the chats' TTFT P99 and TPOT P99 against the idle ones (P99 over
   idle P99: the same mix of prompt sizes on both sides; and over idle P50, and per class), and
   the job's rate against its ceiling beside them: the rate alone x (1 - the chats' own machine
   time per second), where a chat's machine time is its idle engine time (prefill + decode, from
   the idle phase, by class) -- the work the worker must spend on them whatever the scheduling;
5. **offline_at_step**: the offline engine again with `max_num_batched_tokens` set to the median
   token budget of the alone phase's batch-only steps: what the engine itself does at the step
   size the TTFT slack allows (the stack's loss beyond that is the path's, not the bound's);
6. **offline_worker_policy**: the offline engine under the OpenMP wait policy a worker of
   `laneserve up` runs with (``OMP_WAIT_POLICY=PASSIVE``, ``GOMP_SPINCOUNT=3000``: a short spin,
   since it shares the cores) instead of the `LLM`'s own (``ACTIVE``: it owns them), so the
   policy's share of the gap is told apart from the path's
   (``alone_over_offline_worker_policy``);
7. **alone_active**: the alone phase on a stack whose worker spins as the offline engine does
   (``OMP_WAIT_POLICY=ACTIVE``, which `laneserve up` passes on to its workers; `--spin-env`
   tries another policy, e.g. a longer spin that still sleeps when the worker idles);
8. **chats_only**: beside_chats without the job (the chats at `R` per second for
   `--chats-only-s` seconds): what the chats cost each other, apart from what the job costs them.

A job's rate is its lines' completion tokens over the job's own span (first line dispatched ->
last result written, from the `requests` rows), and also over in_progress -> completed. The
per-stage time of a line (medians, ms): runner queue (job in progress -> the line's dispatch),
queue (dispatch -> first scheduled: broker + engine queue), prefill, decode, and write-back (the
rest of e2e). Each worker writes a step trace (`LANESERVE_STEP_TRACE`); its batch-only steps'
budgets and rows are summarised (`steps`); the offline phases time each of their steps too, and
both sides report their steps by kind (`step_kinds`: with a prompt chunk, decode only; tokens and
ms a step, ms a token), so the cost of the job's step size reads beside the offline engine's
(its long prefill steps and pure decode ones). `--rounds N` repeats everything N times on fresh
stacks and reports medians. Prints one JSON object on stdout (progress on stderr).

    python scripts/bench_bulk.py --lines 256 --rounds 3
    python scripts/bench_bulk.py --lines 256 --interactive-rate 0.5 \\
        --phases offline,alone,beside_chats
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchlib import (  # noqa: E402
    add_stack_args,
    api_call,
    bench_stack,
    log,
    machine,
    model_path,
    pct,
    sample_documents,
    served_model,
    stream_request,
)

PHASES = (
    "offline", "alone", "after_chat", "beside_chats", "offline_at_step", "offline_worker_policy",
    "alone_active", "chats_only",
)  # fmt: skip
# The OpenMP wait policy of each phase's engine process (gpu_worker/openmp.py): the offline `LLM`
# owns the cores and spins at every barrier; a worker of `laneserve up` shares them and spins
# ~30 us before it sleeps. `offline_worker_policy` is the offline engine under the worker's
# policy, `alone_active` a job on a stack whose worker spins as the offline engine does: the
# policy's share of the gap, apart from the path's.
OMP_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
SPIN_ENV = {"OMP_WAIT_POLICY": "ACTIVE"}
SHORT_SPIN_ENV = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "3000"}
POLL_S = 1.0  # seconds between polls of the batch (4 a second cost the API 37 s of CPU over a
# 2,000-line job, docs/benchmarks.md Run 24)
SUMMARY_PROMPT = "Summarize in two sentences:\n\n{doc}"

# The offline engine in a process of its own: the lines' messages -> tok/s.
_OFFLINE = r"""
import json, os, sys, time
spec = json.loads(sys.stdin.read())
from laneserve.gpu_worker.openmp import apply_openmp_policy
apply_openmp_policy(exclusive=True)
from laneserve.gpu_worker import LLM, SamplingParams
opts = spec["options"]
llm = LLM(model=spec["model"], dtype=spec["dtype"], **opts)
params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0, ignore_eos=True)
llm.chat(spec["conversations"][:8], params)  # warm-up (first-call costs)
llm.engine.block_manager.reset_prefix_cache()
e = llm.engine
steps0, computed0 = e.num_steps, e.num_prefill_tokens + e.num_generated_tokens
shapes, step = [], e.step
def timed_step(*a, **k):  # each step's (tokens, a prefill chunk in it, ms): where time goes
    t = time.perf_counter()
    out = step(*a, **k)
    f = e.scheduler.last_features
    if f is not None:
        ms = round((time.perf_counter() - t) * 1e3, 3)
        shapes.append((f.tokens, f.prefill_pairs > 0, ms))
    return out
e.step = timed_step
t0 = time.perf_counter()
outs = llm.chat(spec["conversations"], params)
wall = time.perf_counter() - t0
tokens = sum(len(o.token_ids) for o in outs)
steps = e.num_steps - steps0
# positions computed: prompts (prefix hits excluded) and each output token fed back (not a
# line's last)
computed = e.num_prefill_tokens + e.num_generated_tokens - computed0 - len(outs)
omp = {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
print(json.dumps({"seconds": round(wall, 3), "completion_tokens": tokens,
                  "tok_s": round(tokens / wall, 1), "options": opts, "openmp": omp,
                  "steps": steps, "ms_per_step": round(1e3 * wall / max(steps, 1), 2),
                  "tokens_per_step": round(computed / max(steps, 1), 1),
                  "ms_per_token": round(1e3 * wall / max(computed, 1), 3),
                  "step_shapes": shapes}))
"""


def with_openmp(environ: dict[str, str], omp: dict[str, str]) -> dict[str, str]:
    """`environ` with `omp` as its whole OpenMP wait policy (an inherited `GOMP_SPINCOUNT` would
    win over `OMP_WAIT_POLICY`)."""
    out = {k: v for k, v in environ.items() if k not in OMP_VARS}
    return out | omp


def openmp_vars(text: str) -> dict[str, str]:
    """``"OMP_WAIT_POLICY=PASSIVE,GOMP_SPINCOUNT=100000"`` -> a dict of OpenMP wait variables.

    Raises:
        argparse.ArgumentTypeError: an item that is not NAME=VALUE with NAME in `OMP_VARS`.
    """
    out = {}
    for item in text.split(","):
        name, eq, value = item.strip().partition("=")
        if name not in OMP_VARS or not eq or not value:
            raise argparse.ArgumentTypeError(f"{item!r}: expected NAME=VALUE, NAME in {OMP_VARS}")
        out[name] = value
    return out


def conversations(n: int) -> list[list[dict[str, str]]]:
    return [
        [{"role": "user", "content": SUMMARY_PROMPT.format(doc=doc)}] for doc in sample_documents(n)
    ]


def batch_file(convs: list, model: str, max_tokens: int) -> bytes:
    lines = []
    for i, messages in enumerate(convs):
        body = {
            "model": model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        lines.append(
            json.dumps(
                {
                    "custom_id": f"l{i}",
                    "method": "POST",
                    "url": "/v1/chat/completions",
                    "body": body,
                }
            )
        )
    return ("\n".join(lines) + "\n").encode()


def worker_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options a `laneserve up` worker gets here (or the `LLM`'s own defaults)."""
    if args.offline_defaults:
        return {}
    from laneserve.gpu_worker.config import lane_profile

    profile = lane_profile(("interactive", "batch"), on_gpu=False, slo_control=True)
    return {
        "max_num_seqs": args.max_num_seqs or profile.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens or profile.max_num_batched_tokens,
    }


def run_offline(
    args: argparse.Namespace, convs: list, budget: int | None = None,
    omp: dict[str, str] | None = None,
) -> dict:  # fmt: skip
    """The offline engine on `convs` in a process of its own (`budget`: its
    `max_num_batched_tokens`; `omp`: OpenMP variables that replace the `LLM`'s own policy)."""
    options = worker_options(args)
    if budget:
        options["max_num_batched_tokens"] = budget
    spec = {
        "model": model_path(args.model),
        "dtype": args.dtype,
        "max_tokens": args.max_tokens,
        "conversations": convs,
        "options": options,
    }
    repo = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")]))
    if omp is not None:
        env = with_openmp(env, omp)
    proc = subprocess.run(
        [sys.executable, "-c", _OFFLINE], input=json.dumps(spec),
        capture_output=True, text=True, env=env, cwd=tempfile.gettempdir(), timeout=3600,
    )  # fmt: skip
    if proc.returncode != 0:
        return {"error": proc.stderr[-2000:]}
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["step_kinds"] = step_kinds(out.pop("step_shapes"))
    return out


def _shape(rec: dict[str, Any]) -> tuple[int, bool, float]:
    """A step trace line's (tokens, whether a prefill chunk is in it, measured ms)."""
    f = rec["features"]
    return f["tokens"], f["prefill_pairs"] > 0, rec["measured_ms"]


def step_kinds(shapes: list) -> dict[str, dict[str, Any]]:
    """Steps `(tokens, whether a prefill chunk of more than one token is in it, ms)` by kind,
    ``prefill`` and ``decode_only`` (a prompt's last token alone, as `step_features` counts no
    pairs for it, counts as a decode; a decode's speculative drafts count as its tokens), each
    with its count, tokens and ms a step and ms a token: the offline engine's few long prefill
    steps and many pure decode ones beside the job's mixed steps say what the step size costs
    (docs/benchmarks.md Run 36)."""
    out = {}
    for kind, picked in (
        ("prefill", [s for s in shapes if s[1]]),
        ("decode_only", [s for s in shapes if not s[1]]),
    ):
        tokens, ms = sum(s[0] for s in picked), sum(s[2] for s in picked)
        out[kind] = {
            "steps": len(picked),
            "tokens_per_step": round(tokens / len(picked), 1) if picked else None,
            "ms_per_step": round(ms / len(picked), 1) if picked else None,
            "ms_per_token": round(ms / tokens, 3) if tokens else None,
        }
    return out


# ----------------------------------------------------------------------------- the stack


def one_token_chat(api_url: str, model: str) -> None:
    import httpx

    with httpx.Client(base_url=api_url, timeout=120) as c:
        body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
        api_call(c, "POST", "/v1/chat/completions", json=body)


def run_job(info: dict[str, Any], data: bytes, model: str) -> dict[str, Any]:
    """Submit `data` as a batch through the API and wait for it; the batch object and wall s."""
    import httpx

    with httpx.Client(base_url=info["api_url"], timeout=120) as c:
        f = api_call(c, "POST", "/v1/files", files={"file": ("bulk.jsonl", data)},
                     data={"purpose": "batch"})  # fmt: skip
        t0 = time.time()
        b = api_call(c, "POST", "/v1/batches", json={
            "input_file_id": f["id"], "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        })  # fmt: skip
        while b["status"] not in ("completed", "failed", "cancelled", "expired"):
            # once a second: each poll costs the API a stats query over the job's lines, CPU
            # the worker's threads lose on a small machine (the job's rate comes from its rows,
            # not from when the poll saw it end)
            time.sleep(POLL_S)
            b = api_call(c, "GET", f"/v1/batches/{b['id']}")
        return {"batch": b, "wall_s": time.time() - t0}


def job_figures(db_url: str, batch: dict[str, Any]) -> dict[str, Any]:
    """The job's rate and per-stage times of its lines from SQL."""
    from sqlalchemy import create_engine, text

    engine = create_engine(db_url)
    deadline = time.monotonic() + 15.0  # the recorder commits within about a second
    while time.monotonic() < deadline:
        with engine.connect() as c:
            n = c.execute(
                text(
                    "SELECT count(*) FROM requests WHERE job_id = :id AND finished_at IS NOT NULL"
                ),
                {"id": batch["id"]},
            ).scalar()
        if n >= batch["request_counts"]["completed"]:
            break
        time.sleep(0.5)
    with engine.connect() as c:
        job = c.execute(
            text("SELECT in_progress_at, completed_at FROM jobs WHERE id = :id"),
            {"id": batch["id"]},
        ).one()
        rows = c.execute(
            text(
                "SELECT arrival_at, finished_at, completion_tokens, queue_ms, prefill_ms, "
                "decode_ms, e2e_ms FROM requests WHERE job_id = :id"
            ),
            {"id": batch["id"]},
        ).all()
    engine.dispose()
    done = [r for r in rows if r.completion_tokens and r.arrival_at and r.finished_at]
    if not done:
        return {"lines_completed": 0, "completion_tokens": 0, "tok_s": 0.0, "span_s": 0.0,
                "job_status": batch["status"], "job_errors": batch.get("errors")}  # fmt: skip
    tokens = sum(r.completion_tokens for r in done)
    first = min(r.arrival_at for r in done)
    last = max(r.finished_at for r in done)
    span = max(last - first, 1e-6)
    job_s = max((job.completed_at or last) - (job.in_progress_at or first), 1e-6)

    def med(values: list[float | None]) -> float | None:
        vals = [v for v in values if v is not None]
        return round(statistics.median(vals), 1) if vals else None

    stages = {
        "runner_queue_ms": med([(r.arrival_at - job.in_progress_at) * 1e3 for r in done]),
        "queue_ms": med([r.queue_ms for r in done]),
        "prefill_ms": med([r.prefill_ms for r in done]),
        "decode_ms": med([r.decode_ms for r in done]),
        "write_back_ms": med(
            [
                r.e2e_ms - (r.queue_ms or 0) - (r.prefill_ms or 0) - (r.decode_ms or 0)
                for r in done
                if r.e2e_ms is not None
            ]
        ),  # fmt: skip
    }
    return {
        "lines_completed": len(done),
        "completion_tokens": tokens,
        "tok_s": round(tokens / span, 1),
        "tok_s_in_progress_to_completed": round(tokens / job_s, 1),
        "span_s": round(span, 2),
        "stages_median": stages,
    }


def step_summary(trace: Path) -> dict[str, Any]:
    """Batch-only steps of the worker's step trace: budgets, rows, measured ms (medians, P10);
    and the interactive steps run between their layers (gpu_worker/interleave.py)."""
    steps = []
    interleaved = 0
    try:
        for line in trace.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:  # a line cut short by the worker's stop
                continue
            interleaved += (rec.get("plan") or {}).get("reason") == "interleaved"
            view = rec.get("view") or {}
            if view.get("interactive_running") or view.get("interactive_waiting_tokens"):
                continue
            if not view.get("batch_running"):
                continue
            steps.append(rec)
    except OSError:
        return {}
    if not steps:
        return {"batch_only_steps": 0, "interleaved_steps": interleaved}
    budgets = [s["plan"]["token_budget"] for s in steps]
    running = [s["view"]["batch_running"] for s in steps]
    tokens = [s["features"]["tokens"] for s in steps]
    below = sum(1 for b, r in zip(budgets, running, strict=True) if b < r)
    # the path keeps the engine fed: steps with no batch prompt left to prefill (none waiting in
    # the engine for a free seat), in the first 80 % of the job (its tail has none by nature)
    end = steps[0]["t"] + 0.8 * (steps[-1]["t"] - steps[0]["t"])
    early = [s for s in steps if s["t"] <= end]
    starved = sum(1 for s in early if not s["view"]["batch_prefill_tokens"])
    return {
        "batch_only_steps": len(steps),
        "budget_p10": pct(budgets, 10),
        "budget_p50": pct(budgets, 50),
        "running_p50": pct(running, 50),
        "tokens_p50": pct(tokens, 50),
        "measured_ms_p50": pct([s["measured_ms"] for s in steps], 50),
        # the engine's time per computed token (prompt and output), the offline phases'
        # `ms_per_token` beside it: a gap at the same tokens per step is the worker's own
        "ms_per_token": round(
            sum(s["measured_ms"] for s in steps) / max(sum(tokens), 1), 3
        ),  # fmt: skip
        "step_kinds": step_kinds([_shape(s) for s in steps]),
        "steps_with_budget_below_running": below,
        "steps_without_a_queued_prompt_first_80pct": starved,
        "steps_first_80pct": len(early),
        "interleaved_steps": interleaved,
    }


# ----------------------------------------------------------------------------- chats


def chat_prompt(rng: random.Random, words: int) -> str:
    vocab = "the of and to in is was for on that with as by at from it an be this are".split()
    return " ".join(rng.choice(vocab) for _ in range(words))


def chat_plan(rng: random.Random, n: int) -> list[tuple[str, int, str]]:
    """n chats: (class, max_tokens, text): tiny one-token ones, short and long prompts."""
    out = []
    for i in range(n):
        kind = ("tiny", "short", "long")[i % 3]
        if kind == "tiny":
            out.append((kind, 1, "Hi"))
        elif kind == "short":
            out.append((kind, 32, chat_prompt(rng, rng.randint(8, 64))))
        else:
            out.append((kind, 32, chat_prompt(rng, rng.randint(200, 400))))
    return out


async def stream_chat(client, model: str, text: str, max_tokens: int) -> dict[str, Any]:
    """One streamed chat (`benchlib.stream_request`, greedy, `ignore_eos`): TTFT (ms, the
    first content delta), TPOT, tokens; or ``{"error": ...}`` (an HTTP error, a failed
    connection, or an error event in the stream)."""
    body = {"model": model, "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens, "ignore_eos": True}  # fmt: skip
    res = await stream_request(client, "/v1/chat/completions", body)
    if res.error is not None or res.ttft_s is None:
        return {"error": res.error or "no content"}
    tpot = res.tpot_s
    return {"ttft_ms": res.ttft_s * 1e3, "tpot_ms": tpot * 1e3 if tpot else None,
            "tokens": res.tokens, "gaps_ms": [g * 1e3 for g in res.gaps_s()]}  # fmt: skip


def slowest_chats(results: list[tuple[str, dict]], n: int = 3) -> list[dict[str, Any]]:
    """The `n` chats of the highest TPOT, each with where its time between tokens went: the
    median gap, the longest, and the time in gaps over 3x the median (a prompt's prefill or a
    long step between two of its tokens) against the rest (paced steps)."""
    ranked = sorted((r for _, r in results if r["tpot_ms"]), key=lambda r: -r["tpot_ms"])
    out = []
    for r in ranked[:n]:
        gaps = r["gaps_ms"]
        med = statistics.median(gaps) if gaps else 0.0
        long = [g for g in gaps if g > 3 * med]
        out.append({
            "tpot_ms": round(r["tpot_ms"], 1), "tokens": r["tokens"],
            "median_gap_ms": round(med, 1), "max_gap_ms": round(max(gaps, default=0.0), 1),
            "long_gaps": len(long), "long_gaps_ms": round(sum(long), 1),
            "other_gaps_ms": round(sum(gaps) - sum(long), 1),
        })  # fmt: skip
    return out


async def chats_at_rate(api_url: str, model: str, plan, rate: float, stop: asyncio.Event, rng):
    """Send `plan`'s chats in a loop at Poisson `rate` until `stop`; their results by class."""
    import httpx

    results: list[tuple[str, dict]] = []
    tasks = []
    async with httpx.AsyncClient(base_url=api_url, timeout=300) as client:
        i = 0
        while not stop.is_set():
            kind, mt, text = plan[i % len(plan)]
            text = f"({i}) {text}"  # every chat its own prompt: no prefix-cache hit beyond the
            i += 1  # chat template's shared start, as with the idle ones

            async def one(kind=kind, mt=mt, text=text):
                results.append((kind, await stream_chat(client, model, text, mt)))

            tasks.append(asyncio.create_task(one()))
            try:
                await asyncio.wait_for(stop.wait(), timeout=rng.expovariate(rate))
            except TimeoutError:
                pass
        await asyncio.gather(*tasks)
    return results


async def chats_idle(api_url: str, model: str, plan) -> list[tuple[str, dict]]:
    import httpx

    out = []
    async with httpx.AsyncClient(base_url=api_url, timeout=300) as client:
        for i, (kind, mt, text) in enumerate(plan):
            out.append((kind, await stream_chat(client, model, f"(idle {i}) {text}", mt)))
    return out


def chat_machine_ms(db_url: str, since: float) -> dict[str, float]:
    """Median idle engine time (prefill + decode, ms) of the interactive requests since `since`
    by prompt class (told apart by completion tokens and prompt size)."""
    from sqlalchemy import create_engine, text

    engine = create_engine(db_url)
    with engine.connect() as c:
        rows = c.execute(
            text(
                "SELECT prompt_tokens, completion_tokens, prefill_ms, decode_ms FROM requests "
                "WHERE lane = 'interactive' AND arrival_at >= :t"
            ),
            {"t": since},
        ).all()
    engine.dispose()
    by: dict[str, list[float]] = {}
    for r in rows:
        kind = (
            "tiny" if r.completion_tokens == 1 else ("long" if r.prompt_tokens > 150 else "short")
        )
        by.setdefault(kind, []).append((r.prefill_ms or 0) + (r.decode_ms or 0))
    return {k: statistics.median(v) for k, v in by.items()}


def beside_chats(
    args, info, data: bytes, model: str, alone_tok_s: float | None, job_runs: bool = True
) -> dict:
    """The chats idle, then at `--interactive-rate` while the job runs (`job_runs`; else for
    `--chats-only-s` seconds with nothing beside them: what the chats cost each other)."""
    rng = random.Random(7)
    plan = chat_plan(rng, args.chats)
    t_idle = time.time()
    idle = asyncio.run(chats_idle(info["api_url"], model, plan))
    time.sleep(1.5)  # the recorder commits within about a second
    machine_ms = chat_machine_ms(info["db_url"], t_idle)
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    chat_task = loop.create_task(
        chats_at_rate(info["api_url"], model, plan, args.interactive_rate, stop, rng)
    )
    import threading

    box: dict[str, Any] = {}

    def job() -> None:
        try:
            if not job_runs:
                t0 = time.time()
                time.sleep(args.chats_only_s)
                box.update(span_s=time.time() - t0)
                return
            box.update(run_job(info, data, model))
        except Exception as exc:  # noqa: BLE001 (raised below, once the chats have stopped)
            box["error"] = exc
        finally:
            loop.call_soon_threadsafe(stop.set)

    th = threading.Thread(target=job)
    th.start()
    loop_results = loop.run_until_complete(chat_task)
    th.join()
    loop.close()
    if "error" in box:
        raise box["error"]
    figures = job_figures(info["db_url"], box["batch"]) if job_runs else {"span_s": box["span_s"]}
    errors = [r["error"] for _, r in idle + loop_results if "error" in r]
    idle = [(k, r) for k, r in idle if "error" not in r]
    loop_results = [(k, r) for k, r in loop_results if "error" not in r]
    idle_ttft = [r["ttft_ms"] for _, r in idle]
    idle_tpot = [r["tpot_ms"] for _, r in idle if r["tpot_ms"] is not None]
    load_ttft = [r["ttft_ms"] for _, r in loop_results]
    load_tpot = [r["tpot_ms"] for _, r in loop_results if r["tpot_ms"] is not None]
    # the chats' own machine time per second of the job
    busy_ms = sum(machine_ms.get(k, 0.0) for k, _ in loop_results)
    busy_frac = busy_ms / 1e3 / max(figures["span_s"], 1e-6)
    ceiling = alone_tok_s * max(0.0, 1 - busy_frac) if alone_tok_s else None
    by_class = {}
    for kind in ("tiny", "short", "long"):
        i_t = [r["ttft_ms"] for k, r in idle if k == kind]
        l_t = [r["ttft_ms"] for k, r in loop_results if k == kind]
        by_class[kind] = {"idle_ttft_p50_ms": pct(i_t, 50), "ttft_p99_ms": pct(l_t, 99),
                          "chats": len(l_t)}  # fmt: skip
    return {
        **figures,
        "chats": len(loop_results),
        "chat_errors": len(errors),
        "chat_error_examples": errors[:3],
        "idle_ttft_p99_ms": pct(idle_ttft, 99),
        "idle_tpot_p99_ms": pct(idle_tpot, 99),
        "ttft_p99_over_idle_p99": _ratio(pct(load_ttft, 99), pct(idle_ttft, 99)),
        "tpot_p99_over_idle_p99": _ratio(pct(load_tpot, 99), pct(idle_tpot, 99)),
        "ttft_by_class": by_class,
        "idle_ttft_p50_ms": pct(idle_ttft, 50),
        "idle_tpot_p50_ms": pct(idle_tpot, 50),
        "ttft_p99_ms": pct(load_ttft, 99),
        "tpot_p99_ms": pct(load_tpot, 99),
        "ttft_p99_over_idle_p50": _ratio(pct(load_ttft, 99), pct(idle_ttft, 50)),
        "tpot_p99_over_idle_p50": _ratio(pct(load_tpot, 99), pct(idle_tpot, 50)),
        "slowest_chats": slowest_chats(loop_results),
        "slowest_idle_chats": slowest_chats(idle, 1),
        "chat_machine_ms_by_class": {k: round(v, 1) for k, v in machine_ms.items()},
        "chats_busy_fraction": round(busy_frac, 3),
        "ceiling_tok_s": round(ceiling, 1) if ceiling else None,
        "tok_s_over_ceiling": _ratio(figures.get("tok_s"), ceiling),
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


# ----------------------------------------------------------------------------- main


def stack_phase(args, phase: str, convs: list, alone_tok_s: float | None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="lsbulk") as tmp:
        trace = Path(tmp) / "steps.jsonl"
        if args.keep_traces:
            args.keep_traces.mkdir(parents=True, exist_ok=True)
            trace = args.keep_traces / f"{phase}-{time.strftime('%H%M%S')}.jsonl"
        saved = dict(os.environ)
        os.environ["LANESERVE_STEP_TRACE"] = str(trace)
        if phase == "alone_active":  # `laneserve up` passes an explicit policy on to its workers
            for name in OMP_VARS:
                os.environ.pop(name, None)
            os.environ.update(args.spin_env)
        openmp = {name: os.environ.get(name) for name in OMP_VARS}  # None: up's own
        try:
            with bench_stack(args, args.up_args.split()) as info:
                model = served_model(info["api_url"])
                data = batch_file(convs, model, args.max_tokens)
                if phase == "after_chat":
                    one_token_chat(info["api_url"], model)
                before = cpu_seconds(info)
                if phase in ("beside_chats", "chats_only"):
                    job_runs = phase == "beside_chats"
                    out = beside_chats(args, info, data, model, alone_tok_s, job_runs)
                else:
                    job = run_job(info, data, model)
                    out = job_figures(info["db_url"], job["batch"])
                    out["client_wall_s"] = round(job["wall_s"], 2)
                out["cpu_s_by_process"] = cpu_delta(before, cpu_seconds(info))
        finally:
            os.environ.clear()
            os.environ.update(saved)
        out["steps"] = step_summary(trace)
        out["openmp"] = openmp
        return out


def cpu_seconds(info: dict[str, Any]) -> dict[str, float]:
    """CPU seconds (user + system) of each running process of the stack (the supervisor's
    children; not their own children)."""
    import psutil

    out = {}
    for name, pid in (info.get("children") or {}).items():
        if not pid:
            continue
        try:
            t = psutil.Process(pid).cpu_times()
        except psutil.Error:
            continue
        out[name] = t.user + t.system
    return out


def cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: round(after[k] - before.get(k, 0.0), 1) for k in after}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_stack_args(ap)
    ap.add_argument("--lines", default="256", help="comma-separated job sizes")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--phases", default="offline,alone,after_chat")
    ap.add_argument("--interactive-rate", type=float, default=None,
                    help="chats per second beside the job (adds the beside_chats phase)")  # fmt: skip
    ap.add_argument("--chats", type=int, default=12, help="chats of beside_chats' idle set")
    ap.add_argument(
        "--chats-only-s", type=float, default=120.0,
        help="chats_only: seconds of chats at --interactive-rate with no job beside them",
    )  # fmt: skip
    ap.add_argument("--up-args", default="",
                    help="more `laneserve up` flags, e.g. '--slo interactive:ttft=400'")  # fmt: skip
    ap.add_argument("--offline-defaults", action="store_true",
                    help="the offline LLM with its own defaults, not the worker's options")  # fmt: skip
    ap.add_argument("--spin-env", type=openmp_vars, default=SPIN_ENV,
                    help="the alone_active phase's worker policy, e.g. 'OMP_WAIT_POLICY=PASSIVE,"
                    "GOMP_SPINCOUNT=100000' (default OMP_WAIT_POLICY=ACTIVE)")  # fmt: skip
    ap.add_argument("--keep-traces", type=Path, default=None,
                    help="keep each stack's step trace in this folder")  # fmt: skip
    args = ap.parse_args()
    phases = [p for p in args.phases.split(",") if p]
    chat_phases = {"beside_chats", "chats_only"} & set(phases)
    if args.interactive_rate and not chat_phases:
        phases.append("beside_chats")
    if chat_phases and not (args.interactive_rate or 0) > 0:
        ap.error("the beside_chats and chats_only phases need --interactive-rate R (> 0)")
    bad = set(phases) - set(PHASES)
    if bad:
        ap.error(f"unknown phases {sorted(bad)}; choose from {PHASES}")
    report: dict[str, Any] = {"machine": machine(), "model": args.model, "dtype": args.dtype,
                              "max_tokens": args.max_tokens, "up_args": args.up_args,
                              "sizes": {}}  # fmt: skip
    for n in [int(x) for x in args.lines.split(",")]:
        convs = conversations(n)
        rounds: list[dict[str, Any]] = []
        for k in range(args.rounds):
            got: dict[str, Any] = {}
            for phase in phases:
                log(f"{n} lines, round {k + 1}/{args.rounds}: {phase}")
                if phase == "offline":
                    got[phase] = run_offline(args, convs)
                elif phase == "offline_worker_policy":
                    got[phase] = run_offline(args, convs, omp=SHORT_SPIN_ENV)
                elif phase == "offline_at_step":
                    budget = ((got.get("alone") or {}).get("steps") or {}).get("budget_p50")
                    if budget is None:
                        got[phase] = {"skipped": "needs the alone phase before it"}
                    else:
                        got[phase] = run_offline(args, convs, int(budget))
                else:
                    alone = (got.get("alone") or {}).get("tok_s")
                    got[phase] = stack_phase(args, phase, convs, alone)
                log(f"  {phase}: {json.dumps(got[phase])}")
            rounds.append(got)
        report["sizes"][str(n)] = summarize(rounds, phases)
    print(json.dumps(report, indent=1))
    return 0


def summarize(rounds: list[dict[str, Any]], phases: list[str]) -> dict[str, Any]:
    def med(phase: str, key: str) -> float | None:
        vals = [r[phase].get(key) for r in rounds if phase in r and r[phase].get(key) is not None]
        return round(statistics.median(vals), 3) if vals else None

    out: dict[str, Any] = {"rounds": rounds}
    offline = med("offline", "tok_s")
    for phase in phases:
        if phase == "offline":
            out["offline_tok_s_median"] = offline
            continue
        if phase == "offline_worker_policy":  # the policy's share, then the path's
            out["offline_worker_policy_tok_s_median"] = med(phase, "tok_s")
            out["offline_worker_policy_over_offline_median"] = _ratio(med(phase, "tok_s"), offline)
            out["alone_over_offline_worker_policy_median"] = _ratio(med("alone", "tok_s"),
                                                                    med(phase, "tok_s"))  # fmt: skip
            continue
        if phase == "offline_at_step":
            out["offline_at_step_tok_s_median"] = med(phase, "tok_s")
            out["alone_over_offline_at_step_median"] = _ratio(med("alone", "tok_s"),
                                                              med(phase, "tok_s"))  # fmt: skip
            continue
        out[f"{phase}_tok_s_median"] = med(phase, "tok_s")
        out[f"{phase}_over_offline_median"] = _ratio(med(phase, "tok_s"), offline)
    for chats in {"beside_chats", "chats_only"} & set(phases):
        for key in ("ttft_p99_over_idle_p99", "tpot_p99_over_idle_p99", "ttft_p99_over_idle_p50",
                    "tpot_p99_over_idle_p50", "tok_s_over_ceiling"):  # fmt: skip
            out[f"{chats}_{key}_median"] = med(chats, key)
    return out


if __name__ == "__main__":
    sys.exit(main())
