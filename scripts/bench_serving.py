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

The other benchmark scripts import the helpers below (`bench_stack`, `stream_completion`, ...).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import numpy as np  # noqa: E402

# Requests per level of a concurrency sweep, per client (`--requests` default). A level starts
# with all its clients sending at once: a burst of c prompts to prefill before any stream runs.
# With 2 per client (the default until 2026-12-03) half of a level's requests were that burst,
# and its TTFT P50 at 32 clients was the burst's (970 ms on a 2-core EPYC, against 450 ms over
# 5 per client, the same code and stack a minute later).
REQUESTS_PER_SEAT = 5

# Token ids drawn for synthetic prompts: ordinary BPE pieces of SmolLM2's 49,152-token vocabulary
# (the first ids are special and byte tokens).
TOKEN_ID_RANGE = (1_000, 40_000)


# ----------------------------------------------------------------------------- stack


def add_stack_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--running", action="store_true", help="use the running stack")
    parser.add_argument(
        "--model",
        default="smollm2-135m",
        help="model for a fresh stack (alias pulled into $LANESERVE_HOME, .gguf, HF dir)",
    )
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--out", type=Path, default=Path("/tmp"), help="directory for the PNG")
    parser.add_argument(
        "--slowdown",
        type=float,
        default=None,
        help="a fresh stack's model calls take this many times as long (LANESERVE_FAULT_SLOWDOWN, "
        "test-only: a machine that much slower, to show the SLO controller adapts)",
    )
    parser.add_argument(
        "--variants",
        default="default=",
        help="side-by-side stacks in one run, 'NAME=UP ARGS;NAME=UP ARGS', e.g. "
        "'slo=;fixed=--no-slo-control' (default: one stack, no extra flags)",
    )


def variants(args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    """`--variants` as [(name, extra `laneserve up` args)]."""
    out = []
    for item in args.variants.split(";"):
        if item.strip():
            name, _, extra = item.partition("=")
            out.append((name.strip(), extra.split()))
    return out


def model_path(model: str) -> str:
    """A local path for `model` (an alias is pulled into the current $LANESERVE_HOME once), so a
    fresh stack in a temporary home does not download it again."""
    from laneserve.gpu_worker.model_files import resolve_model_path

    return str(resolve_model_path(model))


@contextlib.contextmanager
def bench_stack(args: argparse.Namespace, extra_up_args: list[str] | None = None):
    """Yield the stack.json dict of the running stack (`--running`) or of a fresh one."""
    from laneserve.stack import require_stack, start_stack_process, stop_stack_process

    if args.running:
        yield require_stack()
        return
    up = ["--api-port", "0", "--no-dashboard", "--model", model_path(args.model)]
    up += ["--dtype", args.dtype]
    if args.max_num_seqs:
        up += ["--max-num-seqs", str(args.max_num_seqs)]
    if args.max_num_batched_tokens:
        up += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    up += extra_up_args or []
    with tempfile.TemporaryDirectory(prefix="lsbench") as home:
        log(f"starting a stack in {home}: laneserve up {' '.join(up)}")
        env = None
        if args.slowdown:
            env = dict(os.environ, LANESERVE_FAULT_SLOWDOWN=str(args.slowdown))
        proc, info = start_stack_process(Path(home), up, env=env)
        try:
            yield info
        finally:
            stop_stack_process(proc)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def machine() -> dict[str, Any]:
    import torch
    from benchlib import cpu_info  # the one CPU report (model, SIMD flags)

    info = cpu_info()
    return {
        "cpu": platform.processor() or platform.machine(),
        "cpu_model": info["model"],
        "simd_flags": info["simd_flags"],
        "cores": os.cpu_count(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


# ----------------------------------------------------------------------------- requests


@dataclass(slots=True)
class RequestResult:
    """One streamed request as the client saw it (seconds, from time.perf_counter)."""

    request_id: str | None = None
    sent: float = 0.0
    ttft_s: float | None = None
    total_s: float | None = None
    tokens: int = 0
    chunk_times: list[float] = field(default_factory=list)  # arrival of each content chunk
    cached_tokens: int | None = None
    error: str | None = None
    text: str = ""  # the streamed text, concatenated

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.total_s is None or self.tokens < 2:
            return None
        return (self.total_s - self.ttft_s) / (self.tokens - 1)

    def gaps_s(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:], strict=False)]


def random_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*TOKEN_ID_RANGE) for _ in range(n)]


async def stream_completion(
    client: httpx.AsyncClient,
    api_url: str,
    model: str,
    prompt_ids: list[int],
    max_tokens: int,
    *,
    ignore_eos: bool = True,
    headers: dict[str, str] | None = None,
    result: RequestResult | None = None,
) -> RequestResult:
    """POST a streamed /v1/completions (greedy) and time it (never raises: errors land in
    `.error`).

    `result`, when given, is filled in place as chunks arrive (live progress for the caller)."""
    body = {
        "model": model,
        "prompt": prompt_ids,
        "max_tokens": max_tokens,
        "ignore_eos": ignore_eos,
    }
    return await stream_request(client, api_url + "/v1/completions", body, headers, result)


async def stream_chat(
    client: httpx.AsyncClient,
    api_url: str,
    model: str,
    messages: list[dict],
    max_tokens: int,
    *,
    result: RequestResult | None = None,
) -> RequestResult:
    """POST a streamed /v1/chat/completions (greedy, stopping at EOS) and time it, as
    `stream_completion`."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens}
    return await stream_request(client, api_url + "/v1/chat/completions", body, None, result)


def _chunk_text(choice: dict) -> str:
    """A streamed choice's new text: `text` (completions) or `delta.content` (chat)."""
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


async def stream_request(
    client: httpx.AsyncClient,
    url: str,
    body: dict,
    headers: dict[str, str] | None = None,
    result: RequestResult | None = None,
) -> RequestResult:
    """POST `body` streamed at temperature 0 with usage in the last chunk, timing each chunk
    that carries text (never a role-only chunk) and collecting the text."""
    body = body | {"temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    res = result if result is not None else RequestResult()
    res.sent = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body, headers=headers, timeout=None) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                now = time.perf_counter()
                res.request_id = res.request_id or chunk.get("id")
                if chunk.get("error"):
                    res.error = str(chunk["error"])[:300]
                    return res
                text = "".join(_chunk_text(c) for c in chunk.get("choices") or [])
                if text:
                    res.text += text
                    res.chunk_times.append(now)
                    if res.ttft_s is None:
                        res.ttft_s = now - res.sent
                usage = chunk.get("usage")
                if usage:
                    res.tokens = usage.get("completion_tokens") or 0
                    details = usage.get("prompt_tokens_details") or {}
                    res.cached_tokens = details.get("cached_tokens")
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
        return res
    res.total_s = time.perf_counter() - res.sent
    return res


async def first_model(client: httpx.AsyncClient, api_url: str) -> str:
    resp = await client.get(api_url + "/v1/models")
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]


# ----------------------------------------------------------------------------- figures


def pct(values: list[float], q: float, scale: float = 1.0) -> float | None:
    """q-th percentile (numpy linear interpolation) of values * scale, rounded; None if empty."""
    vals = [v for v in values if v is not None]
    return round(float(np.percentile(vals, q)) * scale, 2) if vals else None


def p50_p99(values: list[float], scale: float = 1.0) -> dict[str, float | None]:
    return {"p50": pct(values, 50, scale), "p99": pct(values, 99, scale), "n": len(values)}


def client_figures(results: list[RequestResult], wall_s: float) -> dict[str, Any]:
    ok = [r for r in results if r.error is None and r.total_s is not None]
    tokens = sum(r.tokens for r in ok)
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "error_sample": next((r.error for r in results if r.error), None),
        "ttft_ms": p50_p99([r.ttft_s for r in ok], 1000),
        "tpot_ms": p50_p99([r.tpot_s for r in ok if r.tpot_s is not None], 1000),
        "itl_ms": p50_p99([g for r in ok for g in r.gaps_s()], 1000),
        "output_tokens": tokens,
        "wall_s": round(wall_s, 3),
        "throughput_tok_s": round(tokens / wall_s, 2) if wall_s > 0 else None,
        "requests_per_s": round(len(ok) / wall_s, 3) if wall_s > 0 else None,
    }


def server_rows(db_url: str, ids: list[str], timeout_s: float = 20.0) -> dict[str, dict]:
    """`requests` rows (id -> dict of timing columns) for these ids, waiting for the recorder."""
    from sqlalchemy import create_engine, select

    from laneserve.db.models import Request

    cols = ("id", "ttft_ms", "tpot_ms", "queue_ms", "prefill_ms", "decode_ms", "e2e_ms",
            "cached_tokens", "completion_tokens", "preemptions", "prefill_chunks",
            "spec_draft_tokens", "spec_accepted_tokens", "spec_num_drafts")  # fmt: skip
    engine = create_engine(db_url)
    rows: dict[str, dict] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            with engine.connect() as conn:
                stmt = select(*[getattr(Request, c) for c in cols]).where(Request.id.in_(ids))
                rows = {r[0]: dict(zip(cols, r, strict=True)) for r in conn.execute(stmt)}
            if len(rows) >= len(ids) or time.monotonic() > deadline:
                return rows
            time.sleep(0.5)
    finally:
        engine.dispose()


def server_figures(db_url: str, results: list[RequestResult]) -> dict[str, Any]:
    """Server-side P50/P99 from SQL for these requests, and client - server TTFT."""
    ids = [r.request_id for r in results if r.request_id and r.error is None]
    rows = server_rows(db_url, ids)
    out: dict[str, Any] = {"rows": len(rows)}
    for col in ("ttft_ms", "tpot_ms", "queue_ms", "prefill_ms", "decode_ms"):
        out[col] = p50_p99([row[col] for row in rows.values() if row[col] is not None])
    diffs = [
        r.ttft_s * 1000 - rows[r.request_id]["ttft_ms"]
        for r in results
        if r.request_id in rows and r.ttft_s is not None and rows[r.request_id]["ttft_ms"]
    ]
    out["client_minus_server_ttft_ms"] = p50_p99(diffs)
    return out


# ----------------------------------------------------------------------------- load


async def closed_loop(
    api_url: str, model: str, concurrency: int, prompts: list, max_tokens: int, send=None
) -> tuple[list[RequestResult], float]:
    """`concurrency` streams at a time over `prompts`, each sent by `send(client, api_url,
    model, prompt, max_tokens)` (default `stream_completion`); returns (results in the order of
    `prompts`, wall seconds)."""
    send = send or stream_completion
    queue = list(enumerate(prompts))[::-1]
    results: list[RequestResult] = [RequestResult()] * len(prompts)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=None) as client:

        async def worker() -> None:
            while queue:
                i, prompt = queue.pop()
                results[i] = await send(client, api_url, model, prompt, max_tokens)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return results, wall


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
