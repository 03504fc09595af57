#!/usr/bin/env python
"""Streaming load against the OpenAI-compatible API: a concurrency sweep (or a Poisson rate).

Each request is a streamed `/v1/completions` call with a fixed number of prompt token ids
(random ids, so no prefix-cache hits) and a fixed number of output tokens (`ignore_eos`). The
client is asyncio + httpx with SSE parsed by hand, so one process can hold hundreds of streams.

- TTFT: request sent -> first SSE chunk carrying non-empty text (never a role-only chunk).
- TPOT: (total - TTFT) / (tokens - 1), tokens from the final `usage`.
- Per level: median and P99 (numpy linear interpolation) of each, throughput (output tokens /
  wall seconds of the level), and the same requests' server-side figures read from SQL
  (`requests` table: ttft/tpot/queue/prefill/decode ms), with client - server TTFT.

By default a fresh stack is started with `laneserve up` in a temporary LANESERVE_HOME (no
dashboard) and stopped at the end; `--running` uses the stack of the current LANESERVE_HOME.
Prints one JSON object and writes a PNG plot to `--out` (a directory, default /tmp).

    python scripts/bench_serving.py --concurrency 1,2,4,8 --requests 8 --input-tokens 64 \\
        --output-tokens 32

The helpers it shares with the other benchmark scripts (`bench_stack`, `stream_completion`, ...)
live in scripts/benchlib.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
from pathlib import Path
from typing import Any

import httpx
from benchlib import (
    RequestResult,
    add_stack_args,
    bench_stack,
    client_figures,
    closed_loop,
    first_model,
    log,
    machine,
    random_prompt,
    server_figures,
    stream_completion,
    variants,
)

# Requests per level of a concurrency sweep, per client (`--requests` default). A level starts
# with all its clients sending at once: a burst of c prompts to prefill before any stream runs.
# With 2 per client (the default until 2026-12-03) half of a level's requests were that burst,
# and its TTFT P50 at 32 clients was the burst's (970 ms on a 2-core EPYC, against 450 ms over
# 5 per client, the same code and stack a minute later).
REQUESTS_PER_SEAT = 5


# ----------------------------------------------------------------------------- load


async def poisson(
    api_url: str, model: str, rate: float, prompts: list[list[int]], max_tokens: int, seed: int
) -> tuple[list[RequestResult], float]:
    """Open loop: requests arrive with exponential gaps (mean 1/rate s)."""
    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=None) as client:
        tasks = []
        start = time.perf_counter()
        for prompt in prompts:
            tasks.append(
                asyncio.create_task(stream_completion(client, api_url, model, prompt, max_tokens))
            )
            await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        wall = time.perf_counter() - start
    return list(results), wall


def plot(levels: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    xs = [lv["concurrency"] for lv in levels]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for key, style in (("ttft_ms", "o-"), ("tpot_ms", "s-")):
        for q, alpha in (("p50", 1.0), ("p99", 0.5)):
            ys = [lv["client"][key][q] for lv in levels]
            ax1.plot(xs, ys, style, alpha=alpha, label=f"{key.split('_')[0].upper()} {q.upper()}")
    ax1.set(xscale="log", yscale="log", xlabel="concurrent streams", ylabel="ms")
    ax1.set_xticks(xs, [str(x) for x in xs])
    ax1.legend()
    ax1.grid(alpha=0.3)
    ax2.plot(xs, [lv["client"]["throughput_tok_s"] for lv in levels], "o-")
    ax2.set(xscale="log", xlabel="concurrent streams", ylabel="output tokens/s")
    ax2.set_xticks(xs, [str(x) for x in xs])
    ax2.grid(alpha=0.3)
    for ax in (ax1, ax2):
        ax.xaxis.set_minor_formatter(NullFormatter())
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", default="1,2,4,8,16,32", help="comma-separated levels")
    parser.add_argument("--rate", type=float, default=None, help="Poisson req/s instead")
    parser.add_argument(
        "--requests",
        type=int,
        default=None,
        help="per level (default 5x c, >= 8: the first c arrive at once, a burst; the closed "
        "loop's steady state needs the waves after it)",
    )
    parser.add_argument("--input-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    add_stack_args(parser)
    args = parser.parse_args()
    report: dict[str, Any] = {
        "benchmark": "serving",
        "machine": machine(),
        "config": {
            "input_tokens": args.input_tokens,
            "output_tokens": args.output_tokens,
            "model": args.model,
            "dtype": args.dtype,
            "max_num_seqs": args.max_num_seqs,
            "slowdown": args.slowdown,
            "mode": f"poisson {args.rate} req/s" if args.rate else "closed loop",
        },
        "levels": [],
        "variants": {},
    }
    for name, extra in variants(args):
        log(f"variant {name}: laneserve up {' '.join(extra) or '(no extra flags)'}")
        report["variants"][name] = {
            "up_args": extra,
            "levels": sweep_stack(args, extra, random.Random(args.seed)),
        }
    report["levels"] = next(iter(report["variants"].values()))["levels"]
    if len(report["variants"]) > 1:
        report["side_by_side"] = {
            name: [
                {"concurrency": lv["concurrency"], "tok_s": lv["client"]["throughput_tok_s"],
                 "ttft_p50_ms": lv["client"]["ttft_ms"]["p50"]}
                for lv in v["levels"]
            ]
            for name, v in report["variants"].items()
        }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    png = args.out / "bench_serving.png"
    plot(report["levels"], png, f"laneserve serving ({args.input_tokens} in / "
         f"{args.output_tokens} out, {report['machine']['cores']} cores)")  # fmt: skip
    report["plot"] = str(png)
    print(json.dumps(report, indent=2))
    return 0


def sweep_stack(args: argparse.Namespace, extra: list[str], rng: random.Random) -> list[dict]:
    """One stack (`laneserve up` + `extra`), the whole sweep against it; its levels."""
    levels: list[dict] = []
    levels_c = [int(x) for x in args.concurrency.split(",") if x.strip()]
    with bench_stack(args, extra) as info:
        api = info["api_url"]

        async def warm() -> str:
            async with httpx.AsyncClient(timeout=None) as client:
                model = await first_model(client, api)
                await stream_completion(client, api, model, random_prompt(rng, 16), 4)
                return model

        model = asyncio.run(warm())
        sweep = [args.rate] if args.rate else levels_c
        for level in sweep:
            n = args.requests or max(8, REQUESTS_PER_SEAT * int(level))
            prompts = [random_prompt(rng, args.input_tokens) for _ in range(n)]
            log(f"level {level}: {n} requests")
            if args.rate:
                results, wall = asyncio.run(
                    poisson(api, model, level, prompts, args.output_tokens, args.seed)
                )
            else:
                results, wall = asyncio.run(
                    closed_loop(api, model, level, prompts, args.output_tokens)
                )
            entry = {
                "concurrency" if not args.rate else "rate": level,
                "client": client_figures(results, wall),
                "server": server_figures(info["db_url"], results),
                "load_avg_1m": round(os.getloadavg()[0], 2),  # other tenants of the machine
            }
            if args.rate:
                entry["concurrency"] = level
            levels.append(entry)
            c = entry["client"]
            log(
                f"  TTFT p50 {c['ttft_ms']['p50']} ms, TPOT p50 {c['tpot_ms']['p50']} ms, "
                f"{c['throughput_tok_s']} tok/s, errors {c['errors']}"
            )
    return levels


if __name__ == "__main__":
    raise SystemExit(main())
