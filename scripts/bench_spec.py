#!/usr/bin/env python3
"""Speculative decoding (n-gram prompt lookup) off vs on, side by side, offline and through the stack.

Tasks: the demo's corpus (laneserve/demo_corpus.py) as `summarize` and `translate` chat requests
(the jobs runner's task prompts, jobs/prompts.py) and open-ended `chat` questions (the demo's
interactive lane, laneserve/demo_chats.py), where little is copied. For every task and batch size
(default 1, 8, 64) the same prompts run greedily through one engine per mode:

- `off`: no speculative_config (the default);
- `adaptive`: `{"method": "ngram", "num_speculative_tokens": K}` (the controller decides per step);
- `forced` (with ``--forced``): the same with `"adaptive": false` (every proposal verified).

The engines are built once and the runs interleave (off, adaptive, forced for one cell, then the
next), so a load change on a shared machine hits every mode alike. At batch 1 every prompt is a
round of its own, the modes alternating prompt by prompt. Prints one JSON object: per cell and
mode tok/s (output tokens / wall time), mean TPOT (ms, DESIGN definition), acceptance rate
(accepted / draft tokens), mean accepted length (vLLM's: 1 + accepted / verifications), the
proposer's cost per step (ms), the ratios to `off`, whether the outputs equal `off` token for
token, and the CPU model and flags.

`--paths offline,stack` (the default) also runs every cell through the stack: one fresh `laneserve
up` per mode (`--speculative-config` for `adaptive` / `forced`), all running at once and idle but
for the mode being measured, the cell's conversations sent as streamed `/v1/chat/completions`
(greedy, the same `--max-tokens`) by `--batch` concurrent clients (batch 1: one after another).
Per mode: tok/s (completion tokens from the responses' usage / wall time), the client's mean TPOT,
the server's (the `requests` table, DESIGN definition), acceptance from the table's
`spec_draft_tokens` / `spec_accepted_tokens`, the mean accepted length from its `spec_num_drafts`,
and whether the texts equal `off`'s.

`--control` adds the mode `control`: a second engine / stack configured as `off`, whose ratio to
`off` (an A/A comparison) shows how far two identical setups differ on this machine in the same
run, the floor below which a mode's ratio is not a finding. The stacks of `off` and `control` share
a start-up profile through the step-cost cache (their options are the same); `--fresh-profiles`
runs every stack with `LANESERVE_STEP_COST_CACHE=0`, so each profiles this machine itself and
the control's ratio also shows how much two start-up profiles differ (the JSON's
`step_cost_cache`; `stack_slo_targets` gives each stack's derived interactive TTFT / TPOT targets
after the warm-up and at the end, which follow its profile).

`--rounds N` runs every cell N times on new prompts each time (the modes interleaved within a
round, the first mode rotating from round to round so that none always runs first) and reports
the sums, the median TPOT and the median of the per-round ratios: one cell of 64 short answers
lasts about a second, and single cells moved by up to 20 % between runs minutes apart. Where the
rounds need more prompts of a task than the corpus has (~130 documents to summarize), prompts
repeat and every engine and stack runs without prefix caching (the JSON's `prefix_caching`).

    python scripts/bench_spec.py [--model smollm2-135m] [--batches 1,8,64]
        [--tasks summarize,translate,chat]
        [--max-tokens 64] [--k 4] [--forced] [--control] [--fresh-profiles]
        [--paths offline,stack] [--rounds 3] [--repetition-penalty 1.1 (offline only)]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import statistics
import sys
import time
from typing import Any

from laneserve.gpu_worker.openmp import apply_openmp_policy  # isort: skip

apply_openmp_policy()
import torch  # noqa: E402
from benchlib import conversations, cpu_info, prompt_pool, thread_settings  # noqa: E402

from laneserve.gpu_worker import LLM, SamplingParams  # noqa: E402


def run_cell(llm: LLM, convs: list[list[dict]], batch: int, *, params: SamplingParams) -> dict:
    before = llm.stats()
    started = time.perf_counter()
    if batch == 1:
        outs = [llm.chat([c], params)[0] for c in convs]
    else:
        outs = llm.chat(convs, params)
    wall = time.perf_counter() - started
    after = llm.stats()
    delta = {k: after[k] - before[k] for k in after if k.startswith(("spec_", "num_steps"))}
    tokens = sum(len(o.token_ids) for o in outs)
    tpots = [o.metrics["tpot_ms"] for o in outs if o.metrics.get("tpot_ms") is not None]
    drafts, accepted = delta["spec_draft_tokens"], delta["spec_accepted_tokens"]
    return {
        "tokens": tokens,
        "seconds": round(wall, 3),
        "tok_s": round(tokens / wall, 2),
        "tpot_ms": round(sum(tpots) / len(tpots), 2) if tpots else None,
        "draft_tokens": drafts,
        "accepted_tokens": accepted,
        "acceptance_rate": round(accepted / drafts, 3) if drafts else None,
        "verifications": delta["spec_num_drafts"],
        "mean_accepted_length": (
            round(1 + accepted / delta["spec_num_drafts"], 3) if delta["spec_num_drafts"] else None
        ),
        "propose_ms_per_step": round(delta["spec_propose_ms"] / max(delta["num_steps"], 1), 4),
        "_outputs": [o.token_ids for o in outs],
    }


def stack_cell(info: dict, convs: list[list[dict]], batch: int, *, max_tokens: int) -> dict:
    """One cell through a running stack: `convs` as streamed chat completions, `batch` at once."""
    import httpx
    from benchlib import closed_loop, first_model, server_rows, stream_chat

    async def run() -> tuple[list, float]:
        async with httpx.AsyncClient(timeout=None) as client:
            model = await first_model(client, info["api_url"])
        return await closed_loop(info["api_url"], model, batch, convs, max_tokens, stream_chat)

    results, wall = asyncio.run(run())
    errors = [r.error for r in results if r.error]
    if errors:
        raise RuntimeError(f"{len(errors)} of {len(results)} requests failed: {errors[0]}")
    rows = server_rows(info["db_url"], [r.request_id for r in results])
    tokens = sum(r.tokens for r in results)
    client_tpots = [r.tpot_s * 1e3 for r in results if r.tpot_s is not None]
    server_tpots = [row["tpot_ms"] for row in rows.values() if row["tpot_ms"] is not None]
    drafts = sum(row["spec_draft_tokens"] or 0 for row in rows.values())
    accepted = sum(row["spec_accepted_tokens"] or 0 for row in rows.values())
    verifications = sum(row["spec_num_drafts"] or 0 for row in rows.values())
    return {
        "tokens": tokens,
        "seconds": round(wall, 3),
        "tok_s": round(tokens / wall, 2),
        "tpot_ms": round(statistics.fmean(client_tpots), 2) if client_tpots else None,
        "server_tpot_ms": round(statistics.fmean(server_tpots), 2) if server_tpots else None,
        "server_rows": len(rows),
        "draft_tokens": drafts,
        "accepted_tokens": accepted,
        "acceptance_rate": round(accepted / drafts, 3) if drafts else None,
        "verifications": verifications,
        "mean_accepted_length": round(1 + accepted / verifications, 3) if verifications else None,
        "_outputs": [r.text for r in results],
    }


def merge_rounds(rounds: list[dict[str, dict]], modes: list[str]) -> dict[str, dict]:
    """One cell's rounds ({mode: figures} each, the same cell on new prompts) as one entry per
    mode: tokens, seconds and spec counts summed (tok_s and acceptance from the sums), TPOT and
    the proposer's cost the median of the rounds', and against `off` the median of the
    per-round ratios (`speedup_tok_s`, `tpot_ratio`, with `speedup_per_round`) and whether every
    round's outputs equal `off`'s."""
    out: dict[str, dict] = {}
    for name in modes:
        figs = [r[name] for r in rounds]
        tokens, seconds = sum(f["tokens"] for f in figs), sum(f["seconds"] for f in figs)
        drafts = sum(f["draft_tokens"] for f in figs)
        accepted = sum(f["accepted_tokens"] for f in figs)
        entry: dict[str, Any] = {
            "tokens": tokens,
            "seconds": round(seconds, 3),
            "tok_s": round(tokens / seconds, 2),
            "draft_tokens": drafts,
            "accepted_tokens": accepted,
            "acceptance_rate": round(accepted / drafts, 3) if drafts else None,
        }
        for key in ("tpot_ms", "server_tpot_ms", "propose_ms_per_step"):
            values = [f[key] for f in figs if f.get(key) is not None]
            if key in figs[0]:
                entry[key] = round(statistics.median(values), 4) if values else None
        if "verifications" in figs[0]:
            verifications = sum(f["verifications"] for f in figs)
            entry["verifications"] = verifications
            entry["mean_accepted_length"] = (
                round(1 + accepted / verifications, 3) if verifications else None
            )
        if "server_rows" in figs[0]:
            entry["server_rows"] = sum(f["server_rows"] for f in figs)
        if name != "off":
            offs = [r["off"] for r in rounds]
            # from tokens and the seconds as printed (not each round's rounded tok_s), so a one-round
            # cell's speedup is the ratio of its printed tok_s whatever the wall's length
            speedups = [
                (f["tokens"] / f["seconds"]) / (o["tokens"] / o["seconds"])
                for f, o in zip(figs, offs, strict=True)
            ]
            entry["speedup_tok_s"] = round(statistics.median(speedups), 3)
            entry["speedup_per_round"] = [round(x, 3) for x in speedups]
            tpots = [
                f["tpot_ms"] / o["tpot_ms"]
                for f, o in zip(figs, offs, strict=True)
                if f["tpot_ms"] and o["tpot_ms"]
            ]
            if tpots:
                entry["tpot_ratio"] = round(statistics.median(tpots), 3)
            entry["identical_to_off"] = all(
                f["_outputs"] == o["_outputs"] for f, o in zip(figs, offs, strict=True)
            )
        out[name] = entry
    return out


def plan(args: argparse.Namespace) -> list[tuple[str, int, list[list[list[dict]]]]]:
    """(task, batch, conversations of each round) per cell; distinct prompts in every cell and
    round (a repeated prompt would hit the prefix cache). At batch 1 every prompt is a round of
    its own (`--batch1-prompts` x `--rounds` of them): the modes alternate prompt by prompt, and
    the median ratio is taken over that many pairs."""
    cells = []
    for task in args.tasks.split(","):
        offset = 0
        for batch in (int(b) for b in args.batches.split(",")):
            count, num_rounds = batch, args.rounds
            if batch == 1:
                count, num_rounds = 1, args.batch1_prompts * args.rounds
            rounds = []
            for _ in range(num_rounds):
                rounds.append(conversations(task, count, offset))
                offset += count
            cells.append((task, batch, rounds))
    return cells


def prompts_repeat(args: argparse.Namespace) -> bool:
    """Whether `plan` needs more prompts of some task than `prompt_pool` has (then both paths run
    without prefix caching, so a repeated prompt is prefilled again)."""
    planned: dict[str, int] = {}
    for task, _, rounds in plan(args):
        planned[task] = planned.get(task, 0) + sum(len(r) for r in rounds)
    return any(n > len(prompt_pool(task)) for task, n in planned.items())


def run_cells(path: str, runners: dict, args: argparse.Namespace) -> list[dict]:
    """Every cell of `plan`, round by round, the modes' `runners` (mode -> fn(convs, batch))
    interleaved within each round, round r starting at the r-th mode."""
    cells = []
    for task, batch, rounds in plan(args):
        results = []
        for r, convs in enumerate(rounds):
            figs = {}
            names = list(runners)
            for name in names[r % len(names) :] + names[: r % len(names)]:
                figs[name] = runners[name](convs, batch)
                print(
                    f"{path} {task} B={batch} round {r + 1}/{len(rounds)} {name}: "
                    f"{figs[name]['tok_s']} tok/s",
                    file=sys.stderr,
                )
            results.append(figs)
        merged = merge_rounds(results, list(runners))
        cells.append({"path": path, "task": task, "batch": batch, "prompts": len(rounds[0]),
                      "rounds": len(rounds), **merged})  # fmt: skip
    return cells


def offline_cells(args: argparse.Namespace, modes: dict[str, dict[str, Any]]) -> tuple[list, Any]:
    """Every cell through one offline engine per mode; (cells, the `off` engine's model and
    dtype). The engines are freed on return, before any stack starts."""
    batches = [int(b) for b in args.batches.split(",")]
    from benchlib import model_path

    common = {
        "model": model_path(args.model),
        "dtype": args.dtype,
        "quantization": args.quantization,
        "max_model_len": 1024,
        "max_num_seqs": max(batches),
        "kv_cache_memory_bytes": 1 << 30,
        "enable_prefix_caching": not prompts_repeat(args),
    }
    engines = {name: LLM(**common, **kw) for name, kw in modes.items()}
    warm = conversations("chat", 1, 999)
    for llm in engines.values():
        llm.chat(warm, SamplingParams(max_tokens=8, temperature=0.0))
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=0.0, repetition_penalty=args.repetition_penalty
    )
    runners = {
        name: functools.partial(run_cell, llm, params=params) for name, llm in engines.items()
    }
    cells = run_cells("offline", runners, args)
    engine = engines["off"].engine
    return cells, {"model": engine.model_name, "dtype": str(engine.dtype)}


def slo_targets(info: dict) -> dict[str, float | None]:
    """The interactive TTFT / TPOT targets (ms) a stack's worker runs under now: derived from
    its start-up profile, then following the steps it measures (gpu_worker/step_budget.py)."""
    import httpx

    workers = httpx.get(info["api_url"] + "/status", timeout=10).json().get("workers") or []
    load = (workers[0].get("load") or {}) if workers else {}
    return {k: load.get(f"slo_interactive_{k}") for k in ("ttft_ms", "tpot_ms")}


def stack_cells(
    args: argparse.Namespace, modes: dict[str, dict[str, Any]]
) -> tuple[list, dict[str, dict]]:
    """Every cell through one fresh stack per mode, the stacks up at once, cells interleaved;
    and per mode the SLO targets its worker derived, after the warm-up and at the end."""
    from benchlib import bench_stack

    stack_args = argparse.Namespace(
        running=False, model=args.model, dtype=args.dtype, slowdown=None,
        max_num_seqs=max(int(b) for b in args.batches.split(",")), max_num_batched_tokens=None,
    )  # fmt: skip
    with contextlib.ExitStack() as stacks:
        infos = {}
        for name, kw in modes.items():
            spec = kw.get("speculative_config")
            extra = ["--speculative-config", json.dumps(spec)] if spec else []
            if prompts_repeat(args):
                extra.append("--no-enable-prefix-caching")
            infos[name] = stacks.enter_context(bench_stack(stack_args, extra))
        warm = conversations("chat", 1, 999)
        for info in infos.values():
            stack_cell(info, warm, 1, max_tokens=8)
        runners = {
            name: functools.partial(stack_cell, info, max_tokens=args.max_tokens)
            for name, info in infos.items()
        }
        targets = {name: {"start": slo_targets(info)} for name, info in infos.items()}
        cells = run_cells("stack", runners, args)
        for name, info in infos.items():
            targets[name]["end"] = slo_targets(info)
        return cells, targets


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--tasks", default="summarize,translate,chat")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument(
        "--batch1-prompts",
        type=int,
        default=2,
        help="prompts per round at B=1 (each its own round)",
    )
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--forced", action="store_true", help="also run adaptive=false")
    ap.add_argument(
        "--control",
        action="store_true",
        help="also run `control`, a second `off`: its ratio to off is the noise floor",
    )
    ap.add_argument(
        "--fresh-profiles",
        action="store_true",
        help="stacks profile their step cost at start-up instead of reading the cache",
    )
    ap.add_argument(
        "--repetition-penalty", type=float, default=1.0,
        help="offline path only: every request's repetition_penalty (bulk summarize and "
        "translate lines carry 1.1 by default, jobs/prompts.py; drafts copied from the prompt "
        "are penalized too)",
    )  # fmt: skip
    ap.add_argument(
        "--model", default="smollm2-135m",
        help="alias pulled into $LANESERVE_HOME, .gguf or Hugging Face directory (e.g. a "
        "Llama-3.2-1B shape made by scripts/make_test_model.py, quantized to Q4_K_M)",
    )  # fmt: skip
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--paths", default="offline,stack", help="offline, stack or both")
    ap.add_argument(
        "--rounds", type=int, default=1, help="each cell this many times, on new prompts each time"
    )
    args = ap.parse_args()
    paths = args.paths.split(",")
    if not set(paths) <= {"offline", "stack"}:
        ap.error(f"--paths takes offline and/or stack, not {args.paths!r}")
    if args.repetition_penalty != 1.0 and "stack" in paths:
        ap.error("--repetition-penalty runs on the offline path only (--paths offline)")
    spec = {"method": "ngram", "num_speculative_tokens": args.k}
    modes: dict[str, dict[str, Any]] = {"off": {}, "adaptive": {"speculative_config": spec}}
    if args.forced:
        modes["forced"] = {"speculative_config": spec | {"adaptive": False}}
    if args.control:
        modes["control"] = {}  # off again: its own engine / stack, the same configuration
    if args.fresh_profiles:  # inherited by every stack's worker
        os.environ["LANESERVE_STEP_COST_CACHE"] = "0"
    cells, engine_info, stack_targets = [], {}, None
    if "offline" in paths:
        cells, engine_info = offline_cells(args, modes)
    if "stack" in paths:
        more, stack_targets = stack_cells(args, modes)
        cells += more
    print(
        json.dumps(
            {
                "bench": "spec_decode",
                "model": args.model,  # the offline engine's own name for it, where it ran
                **engine_info,
                "quantization": args.quantization,
                "max_tokens": args.max_tokens,
                "repetition_penalty": args.repetition_penalty,
                "num_speculative_tokens": args.k,
                "rounds": args.rounds,
                "prefix_caching": not prompts_repeat(args),
                "step_cost_cache": not args.fresh_profiles,
                "torch_threads": torch.get_num_threads(),
                "threads": thread_settings(),
                "cpu": cpu_info(),
                "cells": cells,
                "stack_slo_targets": stack_targets,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
