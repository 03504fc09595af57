#!/usr/bin/env python
"""Chunked prefill: running decodes while long prompts arrive, chunked (256 / 512) vs unchunked.

For each token budget (`--budgets`, default 256,512,0 where 0 = unchunked: the budget holds a
whole long prompt plus the decodes) a fresh stack runs with `--max-num-batched-tokens` set to it.
`--decodes` streams (32-token prompts, `ignore_eos`) start decoding; then `--long-prompts` prompts
of `--long-tokens` tokens (default 4,000) arrive `--gap` seconds apart. While the long prompts
are being prefilled (first long prompt sent -> last long prompt's first token), every gap between
consecutive tokens of the running streams is recorded:

- TPOT of the running streams in that window: P50 / P99 / max of those gaps (ms);
- throughput in that window: tokens computed per second (long-prompt prefill tokens + decode
  tokens) and output tokens per second;
- TTFT of the long prompts.

Small chunks keep the streams' TPOT low; large (or no) chunks finish the prefill sooner.
Prints JSON and writes a PNG to `--out`.

    python scripts/bench_chunking.py --long-tokens 4000 --long-prompts 2 --decodes 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path

import httpx  # noqa: E402
from benchlib import (  # noqa: E402
    RequestResult,
    add_stack_args,
    bench_stack,
    first_model,
    log,
    machine,
    pct,
    random_prompt,
    stream_completion,
)


async def run_mode(api: str, args: argparse.Namespace, rng: random.Random) -> dict:
    async with httpx.AsyncClient(timeout=None) as client:
        model = await first_model(client, api)
        await stream_completion(client, api, model, random_prompt(rng, 16), 2)  # warm up
        decodes: list[RequestResult] = [RequestResult() for _ in range(args.decodes)]

        async def decode(i: int) -> None:
            await stream_completion(
                client, api, model, random_prompt(rng, 32), args.decode_tokens, result=decodes[i]
            )

        tasks = [asyncio.create_task(decode(i)) for i in range(args.decodes)]
        # Wait until every stream has produced a token (they are decoding).
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not all(r.chunk_times for r in decodes):
            await asyncio.sleep(0.1)
        await asyncio.sleep(args.settle)
        window_start = time.perf_counter()
        longs: list[RequestResult] = []

        async def long_prompt() -> None:
            longs.append(
                await stream_completion(client, api, model, random_prompt(rng, args.long_tokens), 4)
            )

        long_tasks = []
        for _ in range(args.long_prompts):
            long_tasks.append(asyncio.create_task(long_prompt()))
            await asyncio.sleep(args.gap)
        await asyncio.gather(*long_tasks)
        window_end = max(
            (r.sent + r.ttft_s for r in longs if r.ttft_s is not None), default=window_start
        )
        for t in tasks:  # stop the decode streams (the server aborts them)
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return {"decodes": decodes, "longs": longs, "window": (window_start, window_end)}


def figures(raw: dict, args: argparse.Namespace) -> dict:
    w0, w1 = raw["window"]
    gaps = []
    tokens_in_window = 0
    for r in raw["decodes"]:
        times = [t for t in r.chunk_times if w0 <= t <= w1]
        tokens_in_window += len(times)
        # gaps whose later token falls in the window (includes the stall the prefill causes)
        gaps += [
            b - a for a, b in zip(r.chunk_times, r.chunk_times[1:], strict=False) if w0 < b <= w1
        ]
    window = max(1e-9, w1 - w0)
    longs = raw["longs"]
    prefill_tokens = args.long_tokens * len([r for r in longs if r.ttft_s is not None])
    return {
        "window_s": round(window, 2),
        "running_streams_tpot_ms": {
            "p50": pct(gaps, 50, 1000),
            "p99": pct(gaps, 99, 1000),
            "max": round(max(gaps) * 1000, 1) if gaps else None,
            "n": len(gaps),
        },
        "long_prompt_ttft_ms": [round(r.ttft_s * 1000, 1) for r in longs if r.ttft_s is not None],
        "decode_tokens_in_window": tokens_in_window,
        "throughput_tokens_per_s": round((prefill_tokens + tokens_in_window) / window, 1),
        "output_tokens_per_s": round(tokens_in_window / window, 2),
        "errors": [r.error for r in longs if r.error][:3],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budgets", default="256,512,0", help="token budgets; 0 = unchunked")
    parser.add_argument("--long-tokens", type=int, default=4000)
    parser.add_argument("--long-prompts", type=int, default=2)
    parser.add_argument("--gap", type=float, default=1.0, help="seconds between long prompts")
    parser.add_argument("--decodes", type=int, default=4, help="running decode streams")
    parser.add_argument("--decode-tokens", type=int, default=2000, help="cap per stream")
    parser.add_argument("--settle", type=float, default=2.0, help="seconds of plain decoding")
    add_stack_args(parser)
    args = parser.parse_args()
    report = {
        "benchmark": "chunking",
        "machine": machine(),
        "config": {
            k: getattr(args, k)
            for k in ("long_tokens", "long_prompts", "gap", "decodes", "dtype", "max_num_seqs")
        },
        "modes": [],
    }
    rng = random.Random(0)
    for budget in [int(b) for b in args.budgets.split(",")]:
        unchunked = budget == 0
        args.max_num_batched_tokens = (
            args.long_tokens * args.long_prompts + args.decodes + 64 if unchunked else budget
        )
        name = "unchunked" if unchunked else f"chunk {budget}"
        log(f"{name}: max_num_batched_tokens {args.max_num_batched_tokens}")
        with bench_stack(args) as info:
            raw = asyncio.run(run_mode(info["api_url"], args, rng))
        entry = {"mode": name, "max_num_batched_tokens": args.max_num_batched_tokens}
        entry.update(figures(raw, args))
        log(f"  {json.dumps(entry)}")
        report["modes"].append(entry)
    args.out.mkdir(parents=True, exist_ok=True)
    png = args.out / "bench_chunking.png"
    plot(report["modes"], png, args.long_tokens)
    report["plot"] = str(png)
    print(json.dumps(report, indent=2))
    return 0


def plot(modes: list[dict], path: Path, long_tokens: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [m["mode"] for m in modes]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    x = range(len(names))
    ax1.bar([i - 0.2 for i in x], [m["running_streams_tpot_ms"]["p99"] or 0 for m in modes],
            0.4, label="P99")  # fmt: skip
    ax1.bar([i + 0.2 for i in x], [m["running_streams_tpot_ms"]["max"] or 0 for m in modes],
            0.4, label="max")  # fmt: skip
    ax1.set_xticks(list(x), names)
    ax1.set(ylabel="ms", title="TPOT of running streams")
    ax1.legend()
    ax2.bar(list(x), [m["throughput_tokens_per_s"] for m in modes])
    ax2.set_xticks(list(x), names)
    ax2.set(ylabel="tokens/s (prefill + decode)", title="throughput")
    fig.suptitle(f"chunked prefill with {long_tokens}-token prompts arriving")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
