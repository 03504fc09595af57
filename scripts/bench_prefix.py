#!/usr/bin/env python
"""Prefix caching: requests sharing a long system prompt, cold vs warm TTFT.

The shared prefix is `--prefix-tokens` (default 1,500) tokens of real text (standard-library
docstrings, laneserve/demo_corpus.py, tokenized with the model's tokenizer). Each request is the
prefix + a short distinct question suffix, sent one at a time as a streamed /v1/completions.

- cold: every request has its own prefix (a different window of the text), so nothing is cached;
- warm: every request shares one prefix that an untimed first request has put in the cache.

Target (issue 10): warm TTFT <= 0.35x cold. Also reports `cached_tokens` from SQL. Prints JSON
and writes a PNG to `--out`.

    python scripts/bench_prefix.py --requests 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
from pathlib import Path

from benchlib import (  # noqa: E402
    add_stack_args,
    bench_stack,
    client_figures,
    first_model,
    log,
    machine,
    model_path,
    server_figures,
    server_rows,
    stream_completion,
)

TARGET_RATIO = 0.35


def text_tokens(model: str, n: int) -> list[int]:
    """At least `n` token ids of standard-library docstring text."""
    from laneserve.demo_corpus import build_corpus
    from laneserve.gpu_worker.model_loader import load_tokenizer

    tokenizer = load_tokenizer(model_path(model))
    docs = build_corpus(120, 0).documents
    ids: list[int] = []
    for _, text in docs:
        ids += tokenizer(text + "\n\n", add_special_tokens=False)["input_ids"]
        if len(ids) >= n:
            return ids
    raise ValueError(f"the corpus gives only {len(ids)} tokens, need {n}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefix-tokens", type=int, default=1500)
    parser.add_argument("--suffix-tokens", type=int, default=16)
    parser.add_argument("--requests", type=int, default=5, help="timed requests per mode")
    parser.add_argument("--output-tokens", type=int, default=8)
    add_stack_args(parser)
    args = parser.parse_args()
    n_cold = args.requests
    pool = text_tokens(args.model, args.prefix_tokens * (n_cold + 1) + 64)
    rng = random.Random(0)
    prefixes = [
        pool[i * args.prefix_tokens : (i + 1) * args.prefix_tokens] for i in range(n_cold + 1)
    ]

    def suffix() -> list[int]:
        return [rng.randrange(1000, 40000) for _ in range(args.suffix_tokens)]

    report = {
        "benchmark": "prefix",
        "machine": machine(),
        "config": {
            "prefix_tokens": args.prefix_tokens,
            "suffix_tokens": args.suffix_tokens,
            "requests_per_mode": n_cold,
            "output_tokens": args.output_tokens,
            "dtype": args.dtype,
        },
    }
    with bench_stack(args) as info:
        api = info["api_url"]

        async def run() -> tuple[list, list]:
            import httpx

            async with httpx.AsyncClient(timeout=None) as client:
                model = await first_model(client, api)
                await stream_completion(client, api, model, suffix(), 2)  # load / warm the worker
                cold = []
                for prefix in prefixes[:n_cold]:
                    cold.append(
                        await stream_completion(
                            client, api, model, prefix + suffix(), args.output_tokens
                        )
                    )
                shared = prefixes[n_cold]
                await stream_completion(client, api, model, shared + suffix(), 2)  # fills cache
                warm = []
                for _ in range(n_cold):
                    warm.append(
                        await stream_completion(
                            client, api, model, shared + suffix(), args.output_tokens
                        )
                    )
                return cold, warm

        log(f"{n_cold} cold then {n_cold} warm requests with a {args.prefix_tokens}-token prefix")
        cold, warm = asyncio.run(run())
        for name, results in (("cold", cold), ("warm", warm)):
            rows = server_rows(info["db_url"], [r.request_id for r in results if r.request_id])
            report[name] = {
                "client": client_figures(results, sum(r.total_s or 0 for r in results)),
                "server": server_figures(info["db_url"], results),
                "cached_tokens": [rows.get(r.request_id, {}).get("cached_tokens") for r in results],
            }
    cold_ttft = report["cold"]["client"]["ttft_ms"]["p50"]
    warm_ttft = report["warm"]["client"]["ttft_ms"]["p50"]
    ratio = round(warm_ttft / cold_ttft, 3) if cold_ttft and warm_ttft else None
    report["warm_over_cold_ttft_p50"] = ratio
    report["target"] = f"warm TTFT <= {TARGET_RATIO}x cold"
    report["target_met"] = ratio is not None and ratio <= TARGET_RATIO
    args.out.mkdir(parents=True, exist_ok=True)
    png = args.out / "bench_prefix.png"
    plot(cold, warm, png, args.prefix_tokens)
    report["plot"] = str(png)
    print(json.dumps(report, indent=2))
    return 0


def plot(cold, warm, path: Path, prefix_tokens: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, results in (("cold", cold), ("warm", warm)):
        ys = [r.ttft_s * 1000 for r in results if r.ttft_s is not None]
        ax.plot(range(1, len(ys) + 1), ys, "o-", label=name)
    ax.set(xlabel="request", ylabel="TTFT (ms)", title=f"{prefix_tokens}-token shared prefix")
    ax.set_ylim(bottom=0)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
