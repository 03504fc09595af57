#!/usr/bin/env python3
"""Speculative decoding (n-gram prompt lookup) off vs on, side by side, through the offline engine.

Tasks: the demo's corpus (laneserve/demo_corpus.py) as `summarize` and `translate` chat requests
(the jobs runner's task prompts, jobs/prompts.py) and open-ended `chat` questions (the demo's
interactive lane, laneserve/demo_chats.py), where little is copied. For every task and batch size
(default 1, 8, 64) the same prompts run greedily through one engine per mode:

- `off`: no speculative_config (the default);
- `adaptive`: `{"method": "ngram", "num_speculative_tokens": K}` (the controller decides per step);
- `forced` (with ``--forced``): the same with `"adaptive": false` (every proposal verified).

The engines are built once and the runs interleave (off, adaptive, forced for one cell, then the
next), so a load change on a shared machine hits every mode alike. A batch-1 cell runs its
prompts one after another. Prints one JSON object: per cell and mode tok/s (output tokens / wall
time), mean TPOT (ms, DESIGN definition), acceptance rate (accepted / draft tokens), mean accepted
length (vLLM's: 1 + accepted / verifications), the proposer's cost per step (ms), the ratios to
`off`, whether the outputs equal `off` token for token, and the CPU model and flags.

    python scripts/bench_spec.py [--batches 1,8,64] [--tasks summarize,translate,chat]
        [--max-tokens 64] [--k 4] [--forced]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_worker.openmp import apply_openmp_policy  # isort: skip

apply_openmp_policy()
import torch  # noqa: E402
from bench_offline import cpu_info, thread_settings  # noqa: E402

from gpu_worker import LLM, SamplingParams  # noqa: E402
from jobs.prompts import summarize_messages, translate_messages  # noqa: E402
from laneserve.demo_chats import CHAT_MODULES, CHAT_QUESTIONS  # noqa: E402
from laneserve.demo_corpus import build_corpus  # noqa: E402


def conversations(task: str, count: int, offset: int) -> list[list[dict]]:
    """`count` chat requests of `task`, starting at prompt `offset` (distinct per cell)."""
    if task == "summarize":
        docs = build_corpus(offset + count, 0, max_doc_chars=600).documents[offset:]
        return [summarize_messages(text) for _, text in docs]
    if task == "translate":
        sents = build_corpus(0, offset + count).sentences[offset:]
        return [translate_messages(text, "fr", "en") for _, text in sents]
    out = []
    for i in range(offset, offset + count):
        q = CHAT_QUESTIONS[i % len(CHAT_QUESTIONS)].format(m=CHAT_MODULES[i % len(CHAT_MODULES)])
        out.append([{"role": "user", "content": q}])
    return out


def run_cell(llm: LLM, convs: list[list[dict]], batch: int, params: SamplingParams) -> dict:
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
        "mean_accepted_length": (
            round(1 + accepted / delta["spec_num_drafts"], 3) if delta["spec_num_drafts"] else None
        ),
        "propose_ms_per_step": round(delta["spec_propose_ms"] / max(delta["num_steps"], 1), 4),
        "_outputs": [o.token_ids for o in outs],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--tasks", default="summarize,translate,chat")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batch1-prompts", type=int, default=2, help="prompts run one by one at B=1")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--forced", action="store_true", help="also run adaptive=false")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default="auto")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    tasks = args.tasks.split(",")
    spec = {"method": "ngram", "num_speculative_tokens": args.k}
    modes: dict[str, dict[str, Any]] = {"off": {}, "adaptive": {"speculative_config": spec}}
    if args.forced:
        modes["forced"] = {"speculative_config": spec | {"adaptive": False}}
    common = {
        "dtype": args.dtype,
        "quantization": args.quantization,
        "max_model_len": 1024,
        "max_num_seqs": max(batches),
        "kv_cache_memory_bytes": 1 << 30,
    }
    engines = {name: LLM(**common, **kw) for name, kw in modes.items()}
    warm = conversations("chat", 1, 999)
    for llm in engines.values():
        llm.chat(warm, SamplingParams(max_tokens=8, temperature=0.0))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    cells = []
    offset = 0
    for task in tasks:
        for batch in batches:
            count = args.batch1_prompts if batch == 1 else batch
            convs = conversations(task, count, offset)
            offset += count
            cell: dict[str, Any] = {"task": task, "batch": batch, "prompts": len(convs)}
            for name, llm in engines.items():
                cell[name] = run_cell(llm, convs, batch, params)
                print(f"{task} B={batch} {name}: {cell[name]['tok_s']} tok/s", file=sys.stderr)
            off = cell["off"]
            for name in modes:
                if name == "off":
                    continue
                cell[name]["speedup_tok_s"] = round(cell[name]["tok_s"] / off["tok_s"], 3)
                if off["tpot_ms"] and cell[name]["tpot_ms"]:
                    cell[name]["tpot_ratio"] = round(cell[name]["tpot_ms"] / off["tpot_ms"], 3)
                cell[name]["identical_to_off"] = cell[name]["_outputs"] == off["_outputs"]
            for name in modes:
                del cell[name]["_outputs"]
            cells.append(cell)
    engine = engines["off"].engine
    print(
        json.dumps(
            {
                "bench": "spec_decode",
                "model": engine.model_name,
                "dtype": str(engine.dtype),
                "quantization": args.quantization,
                "max_tokens": args.max_tokens,
                "num_speculative_tokens": args.k,
                "torch_threads": torch.get_num_threads(),
                "threads": thread_settings(),
                "cpu": cpu_info(),
                "cells": cells,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
