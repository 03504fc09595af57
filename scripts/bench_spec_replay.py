#!/usr/bin/env python3
"""Speculative decoding replayed over recorded greedy outputs, under a stated step cost.

Timing speculation on a shared 2-core machine swings by 15-20 % between runs, more than most
changes to the proposer or the controller move it. This script takes the timing out: it records
each task's greedy outputs once (the demo corpus as `scripts/bench_spec.py` builds it: summarize,
translate, chat), then replays the engine's own `SpecController` (the n-gram proposer, the
acceptance estimates, the `YieldGuard`, the draft choice) over them. Each step every unfinished
sequence of a batch is one decoding request; its drafts are accepted while they equal the recorded
tokens (greedy verification emits exactly the recorded tokens, drafted or not), and the
controller is told that a step of `tokens` query tokens took `a + b * tokens` ms (`--cost a,b`:
a line through measured steps of the machine to model; the default is a 2-core Zen 4's bf16 batch-1
steps, 7.1 ms at one token and 1.7 ms per token more). The same outputs decoded without drafts
cost one step per token and sequence; the modelled speedup is that cost over the speculative one.

Prints one JSON object: per task and batch, for the adaptive controller and for `forced` (every
proposal verified: its tokens per sequence step is what speculation could reach on these outputs
at k if verification were free), decode steps, tokens per step (the batch's), tokens per
sequence step (per request and step it decoded in: 1.0 without drafts), drafts, accepted drafts,
acceptance and the modelled speedup; per task `lookup_ceiling_tokens_per_sequence_step`, the tokens
per sequence step if every step verified, for free, the best of all earlier n-gram matches' drafts
(`lookup_ceiling`: what no prompt-lookup proposer can beat at k, whatever the step cost); and the
machine. The first token of each output (the
prefill step's) is left out. Each request's `max_tokens` is its recorded output's length, so no
draft runs past the recorded end: for an output that ended at EOS the engine would also have
verified drafts beyond it (all rejected), which the replay does not charge.

    python scripts/bench_spec_replay.py [--tasks summarize,translate,chat] [--prompts 24]
        [--batches 1,8] [--k 4] [--cost 5.4,1.7] [--outputs FILE]

`--outputs FILE` reuses recorded outputs (written there on the first run), so two versions of the
controller can be compared on the same tokens (run the script from each checkout).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from laneserve.gpu_worker.openmp import apply_openmp_policy  # isort: skip

apply_openmp_policy()
import numpy as np  # noqa: E402
from benchlib import conversations, cpu_info  # noqa: E402

from laneserve.gpu_worker.config import SpeculativeConfig  # noqa: E402
from laneserve.gpu_worker.request import Request  # noqa: E402
from laneserve.gpu_worker.sampling_params import SamplingParams  # noqa: E402
from laneserve.gpu_worker.spec_decode import (  # noqa: E402
    SpecController,
    SpecRequest,
    TokenHistory,
    suffix_matches,
)

Recorded = list[tuple[list[int], list[int]]]  # (prompt ids, greedy output ids) per prompt


def record_outputs(tasks: list[str], prompts: int, max_tokens: int, dtype: str) -> dict:
    """Greedy outputs of the bundled model for `prompts` prompts of each task."""
    from laneserve.gpu_worker import LLM

    llm = LLM(model="smollm2-135m", dtype=dtype, max_model_len=1024)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    out = {}
    for task in tasks:
        outs = llm.chat(conversations(task, prompts, 0), params)
        out[task] = [(list(o.prompt_token_ids), list(o.token_ids)) for o in outs]
        print(f"recorded {task}: {len(outs)} outputs", file=sys.stderr)
    return out


def replay(
    seqs: Recorded,
    batch: int,
    config: SpeculativeConfig,
    cost: tuple[float, float],
) -> dict:
    """Replay the controller over `seqs`, `batch` sequences at a time (a group runs until all of
    its sequences end, as `bench_spec.py`'s batch cells do)."""
    a, b = cost
    ctl = SpecController(config)
    steps = row_steps = tokens = drafts = accepted = 0
    spec_ms = plain_ms = 0.0
    for g in range(0, len(seqs), batch):
        group = [(p, o) for p, o in seqs[g : g + batch] if len(o) >= 2]
        reqs, specs, wanted = [], {}, {}
        for i, (prompt, out) in enumerate(group):
            params = SamplingParams(max_tokens=len(out), temperature=0.0)
            req = Request(request_id=f"{g}-{i}", prompt_token_ids=prompt, sampling_params=params)
            req.output_token_ids = [out[0]]  # the prefill step's token
            req.num_computed_tokens = req.num_tokens - 1
            specs[req.request_id] = (SpecRequest(TokenHistory(prompt + out[:1])), params)
            wanted[req.request_id] = out
            reqs.append(req)
        # without drafts: one step per remaining token, each of as many rows as are unfinished
        lengths = sorted(len(o) - 1 for _, o in group)
        done = 0
        for i, n in enumerate(lengths):
            plain_ms += (n - done) * (a + b * (len(lengths) - i))
            done = n
        while reqs:
            ctl.propose(reqs, lambda r, specs=specs: specs[r.request_id], 1 << 30)
            runs, emitted, step_drafts = [], 0, 0
            for req in reqs:
                out = wanted[req.request_id]
                n_out = req.num_output_tokens
                d = req.spec_token_ids
                acc = 0
                while acc < len(d) and d[acc] == out[n_out + acc]:
                    acc += 1
                new = out[n_out : n_out + acc + 1]
                req.output_token_ids.extend(new)
                req.num_computed_tokens = req.num_tokens - 1
                specs[req.request_id][0].history.extend(new)
                emitted += len(new)
                if d:
                    step_drafts += len(d)
                    runs.append((req, specs[req.request_id][0], len(d), acc))
                    drafts += len(d)
                    accepted += acc
            ctl.record(runs)
            step_tokens = len(reqs) + step_drafts
            ms = a + b * step_tokens
            ctl.observe_step(step_tokens, ms)
            ctl.observe_wall(len(reqs), step_tokens, step_drafts, emitted, ms)
            steps += 1
            row_steps += len(reqs)
            tokens += emitted
            spec_ms += ms
            reqs = [r for r in reqs if r.num_output_tokens < len(wanted[r.request_id])]
    return {
        "decode_steps": steps,
        "tokens": tokens,
        "tokens_per_step": round(tokens / max(steps, 1), 3),
        "tokens_per_sequence_step": round(tokens / max(row_steps, 1), 3),
        "draft_tokens": drafts,
        "accepted_tokens": accepted,
        "acceptance_rate": round(accepted / drafts, 3) if drafts else None,
        "modelled_speedup": round(plain_ms / spec_ms, 3) if spec_ms else None,
    }


def lookup_ceiling(seqs: Recorded, k: int, min_n: int, max_n: int) -> float:
    """Tokens per sequence step if every step verified the best of all prompt-lookup drafts.

    At each decode step of each sequence every earlier occurrence of the sequence's suffix n-gram
    (`min_n <= n <= max_n`, in its prompt + output so far) proposes the k tokens that followed
    it; the step emits the longest accepted run among all of them plus the bonus token. No
    lookup proposer that picks one match per step (the engine's takes the longest, most recent
    one) can emit more, and verification is taken as free: the figure bounds what prompt lookup
    can reach on these outputs at k, whatever the step cost.
    """
    tokens = steps = 0
    for prompt, out in seqs:
        seq = np.asarray(list(prompt) + list(out), dtype=np.int64)
        start, pos = len(prompt), 1  # the first output token is the prefill step's
        while pos < len(out):
            n_ctx = start + pos  # seq[:n_ctx] is known; seq[n_ctx:] is what the step must emit
            ctx = seq[:n_ctx]
            cand, length = suffix_matches(ctx, max_n)
            cand = cand[length >= min_n]
            best = 0
            if cand.size:
                want = min(k, len(out) - pos - 1)  # drafts past the recorded end are not counted
                offs = np.arange(1, want + 1)
                src = cand[:, None] + offs[None, :]  # draft positions in ctx
                valid = src < n_ctx
                drafted = ctx[np.minimum(src, n_ctx - 1)]
                hit = valid & (drafted == seq[n_ctx : n_ctx + want][None, :])
                best = int(np.cumprod(hit, axis=1).sum(axis=1).max()) if want else 0
            pos += best + 1
            tokens += best + 1
            steps += 1
    return round(tokens / max(steps, 1), 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", default="summarize,translate,chat")
    ap.add_argument("--prompts", type=int, default=24, help="recorded outputs per task")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--lookup", default="2,5", help="prompt_lookup_min,prompt_lookup_max")
    ap.add_argument("--cost", default="5.4,1.7", help="a,b: a step of t tokens takes a + b t ms")
    ap.add_argument("--outputs", type=Path, help="recorded outputs: read, or written when absent")
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    tasks = args.tasks.split(",")
    a, b = (float(x) for x in args.cost.split(","))
    lookup_min, lookup_max = (int(x) for x in args.lookup.split(","))
    if args.outputs is not None and args.outputs.exists():
        recorded = json.loads(args.outputs.read_text())
    else:
        recorded = record_outputs(tasks, args.prompts, args.max_tokens, args.dtype)
        if args.outputs is not None:
            args.outputs.write_text(json.dumps(recorded))
    cells: list[dict[str, Any]] = []
    ceilings: dict[str, float] = {}
    for task in tasks:
        seqs = [(list(p), list(o)) for p, o in recorded[task]]
        ceilings[task] = lookup_ceiling(seqs, args.k, lookup_min, lookup_max)
        print(f"{task}: best of all lookup drafts {ceilings[task]} tokens per sequence step",
              file=sys.stderr)  # fmt: skip
        for batch in (int(x) for x in args.batches.split(",")):
            cell: dict[str, Any] = {"task": task, "batch": batch, "sequences": len(seqs)}
            for name, adaptive in (("adaptive", True), ("forced", False)):
                config = SpeculativeConfig(
                    num_speculative_tokens=args.k,
                    prompt_lookup_min=lookup_min,
                    prompt_lookup_max=lookup_max,
                    adaptive=adaptive,
                )
                cell[name] = replay(seqs, batch, config, (a, b))
            cells.append(cell)
            print(
                f"{task} B={batch}: adaptive {cell['adaptive']['modelled_speedup']}x, forced "
                f"{cell['forced']['modelled_speedup']}x "
                f"({cell['forced']['tokens_per_sequence_step']} tokens per sequence step)",
                file=sys.stderr,
            )
    print(json.dumps({
        "bench": "spec_replay",
        "k": args.k,
        "prompt_lookup": [lookup_min, lookup_max],
        "cost_ms": {"a": a, "b": b},
        "cpu": cpu_info(),
        "lookup_ceiling_tokens_per_sequence_step": ceilings,
        "cells": cells,
    }, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
