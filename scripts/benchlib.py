"""What the benchmark scripts share: the one CPU report (model, cores, flags, load), the host
counters every result JSON carries, and the serving benchmarks' parts: a fresh or running stack
(`add_stack_args`, `bench_stack`), streamed requests timed by the client (`stream_completion`,
`stream_chat`, `stream_request`, `closed_loop`), and their figures beside the server's rows in
SQL (`client_figures`, `server_figures`, `pct`); the offline and kernel benchmarks' parts: the
demo tasks' chat requests (`prompt_pool`, `conversations`), transformers `generate` in static
batches (`run_transformers`), round-robin kernel timing (`time_cells`, `gemv_max_m`), the peers'
virtual environments (`peer_python`), the streaming read bandwidth and a GGUF's step bytes
(`read_bandwidth`, `model_bytes`); and a `laneserve up` of a script's own in a fresh home
(`home_for`, `start_up`, `stop_up`, `stack_info`).

Torch-free at import (torch loads inside the functions that use it): a script that needs the
engines' OpenMP policy applies it itself before torch loads (`gpu_worker.openmp`). Its one side
effect: this checkout's root goes first on ``sys.path``, so ``laneserve`` is the checkout's
package whichever is installed.

Scripts import it by name (``from benchlib import cpu_info``): ``python scripts/NAME.py`` puts
scripts/ first on ``sys.path``, and ``tests/harness.load_script`` does the same while it loads
one; scripts import only this module (and the package), never each other.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import importlib
import json
import math
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import numpy as np  # noqa: E402

if TYPE_CHECKING:
    import torch


def cpu_info() -> dict[str, Any]:
    """CPU model, flags and core count from /proc/cpuinfo (Linux), plus the load average now."""
    model, flags = platform.processor() or platform.machine(), ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model in ("", platform.machine()):
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = value.strip()
    except OSError:
        pass
    simd = [f for f in flags.split() if f.startswith(("avx", "amx", "fma", "f16c", "sse4"))]
    return {
        "model": model,
        "cores": os.cpu_count(),
        "simd_flags": simd,
        "flags": flags,
        "load_avg_1_5_15": [round(x, 2) for x in os.getloadavg()],
    }


def cpu_times() -> list[int] | None:
    """The machine's CPU time counters (/proc/stat's first line, jiffies), or None off Linux."""
    try:
        return [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None


def steal_pct(before: list[int] | None, after: list[int] | None) -> float | None:
    """Percent of the CPU time between two `cpu_times` readings that the hypervisor gave other
    guests (steal, the 8th counter): on a shared virtual machine a run with a high figure ran
    on a slower machine than its neighbours in the same invocation."""
    if not before or not after or len(before) < 8 or len(after) < 8:
        return None
    total = sum(after[:8]) - sum(before[:8])
    return round(100.0 * (after[7] - before[7]) / total, 1) if total > 0 else None


def thread_settings() -> dict[str, Any]:
    """The OpenMP policy this run's torch engines start under (each engine's thread count is in
    its own entry)."""
    from laneserve.contracts import env

    return {name: env.get(name) for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}


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


# ----------------------------------------------------------------------------- batches


def api_call(client, method: str, path: str, **kw) -> dict[str, Any]:
    r = client.request(method, path, **kw)
    r.raise_for_status()
    return r.json()


def served_model(api_url: str) -> str:
    return httpx.get(f"{api_url}/v1/models", timeout=30).json()["data"][0]["id"]


# ----------------------------------------------------------------------------- prompts


STDLIB_MODULES = [
    "argparse",
    "asyncio",
    "base64",
    "bisect",
    "calendar",
    "collections",
    "colorsys",
    "contextlib",
    "copy",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "difflib",
    "enum",
    "fractions",
    "functools",
    "getopt",
    "gettext",
    "glob",
    "gzip",
    "hashlib",
    "heapq",
    "hmac",
    "html",
    "imaplib",
    "inspect",
    "io",
    "ipaddress",
    "json",
    "locale",
    "logging",
    "mailbox",
    "mimetypes",
    "numbers",
    "operator",
    "optparse",
    "pathlib",
    "pickle",
    "pprint",
    "queue",
    "random",
    "re",
    "sched",
    "secrets",
    "selectors",
    "shelve",
    "shlex",
    "shutil",
    "smtplib",
    "socket",
    "sqlite3",
    "statistics",
    "string",
    "struct",
    "subprocess",
    "tarfile",
    "tempfile",
    "textwrap",
    "threading",
    "timeit",
    "tokenize",
    "typing",
    "uuid",
    "wave",
    "weakref",
    "zipfile",
    "zlib",
]


def sample_documents(n: int, max_words: int = 160) -> list[str]:
    docs = []
    for name in STDLIB_MODULES:
        try:
            doc = importlib.import_module(name).__doc__ or ""
        except Exception:
            continue
        words = doc.split()
        if len(words) >= 20:
            docs.append(" ".join(words[:max_words]))
        if len(docs) == n:
            break
    while len(docs) < n:  # recycle with a marker so prompts stay distinct
        docs.append(f"(copy {len(docs)}) " + docs[len(docs) % max(1, len(docs))])
    return docs


# --- offline and kernel benchmarks: chat requests of the demo's tasks, transformers' `generate`,
# round-robin kernel timing, the peers' environments, memory bandwidth ------------------------------


@functools.cache
def prompt_pool(task: str) -> list[list[dict]]:
    """Every distinct chat request of `task` the demo's corpus gives (summaries: one document per
    standard-library module, ~130 on CPython 3.11)."""
    from laneserve.demo_chats import CHAT_MODULES, CHAT_QUESTIONS
    from laneserve.demo_corpus import build_corpus
    from laneserve.jobs.prompts import summarize_messages, translate_messages

    if task == "summarize":
        docs = build_corpus(100_000, 0, max_doc_chars=600, strict=False).documents
        return [summarize_messages(text) for _, text in docs]
    if task == "translate":
        sents = build_corpus(0, 100_000, strict=False).sentences
        return [translate_messages(text, "fr", "en") for _, text in sents]
    if task != "chat":
        raise ValueError(f"unknown task {task!r}")
    pairs = math.lcm(len(CHAT_QUESTIONS), len(CHAT_MODULES))
    return [
        [{"role": "user", "content": CHAT_QUESTIONS[i % len(CHAT_QUESTIONS)].format(
            m=CHAT_MODULES[i % len(CHAT_MODULES)])}]
        for i in range(pairs)
    ]  # fmt: skip


def conversations(task: str, count: int, offset: int) -> list[list[dict]]:
    """`count` chat requests of `task` from prompt `offset` on, wrapping around `prompt_pool`."""
    pool = prompt_pool(task)
    return [pool[(offset + i) % len(pool)] for i in range(count)]


def run_transformers(model, prompts, max_tokens, batch_size, pad_id):
    """transformers `generate` over `prompts` in static batches of `batch_size` (left padding with
    `pad_id`), greedy, exactly `max_tokens` new tokens each: (new ids per prompt, seconds)."""
    import torch

    outs = []
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i : i + batch_size]
        width = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for r, p in enumerate(chunk):  # left padding
            ids[r, width - len(p) :] = torch.tensor(p)
            mask[r, width - len(p) :] = 1
        with torch.inference_mode():
            gen = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=pad_id,
            )
        outs.extend(gen[:, width:].tolist())
    return outs, time.perf_counter() - start


def time_cells(
    fns: dict,
    x32: torch.Tensor,
    budget_s: float,
    min_rounds: int = 9,
    refs: tuple[str, ...] = ("int4_bf16", "quant_int4_fp32_in"),
) -> dict:
    """Per variant: median microseconds per call, and per-round ratios to each of `refs` timed.

    Variants are timed round-robin (one call each per round, until `budget_s` per variant is
    spent), so a burst of load from other processes hits every variant of a round alike; the
    per-round ratio's median is the robust figure on a shared machine.
    """
    inputs = {v: x32.to(dt) for v, (dt, _) in fns.items()}
    for v, (_, f) in fns.items():
        f(inputs[v])  # warm-up (first call packs / allocates)
    times: dict[str, list[float]] = {v: [] for v in fns}
    deadline = time.perf_counter() + budget_s * len(fns)
    rounds = 0
    while rounds < min_rounds or (time.perf_counter() < deadline and rounds < 2000):
        for v, (_, f) in fns.items():
            t0 = time.perf_counter()
            f(inputs[v])
            times[v].append(time.perf_counter() - t0)
        rounds += 1
    out = {}
    for v, ts in times.items():
        cell = {"median_us": round(statistics.median(ts) * 1e6, 1)}
        for ref_name in refs:
            ref = times.get(ref_name)
            if ref is not None:
                cell[f"ratio_to_{ref_name}"] = round(
                    statistics.median(t / r for t, r in zip(ts, ref, strict=True)), 3
                )
        out[v] = cell
    return out


def gemv_max_m(ratio: dict[int, float]) -> int | None:
    """Largest M up to which the C++ GEMV takes at most the time of what float32 activations
    run on otherwise (QuantLinear's torch kernel, ratio <= 1) at every smaller M measured."""
    best = None
    for m in sorted(ratio):
        if ratio[m] > 1.0:
            break
        best = m
    return best


DEFAULT_PEERS_DIR = Path.home() / ".cache" / "laneserve-peers"
VENV_PEERS = {"vllm": "vllm", "llamacpp": "llamacpp"}  # peer -> venv name under the peers dir
# llama.cpp's builds (scripts/setup_peers.sh LLAMACPP_ISA=...) -> their venvs under the peers dir
LLAMACPP_VENVS = {"avx2": "llamacpp", "avx512": "llamacpp-avx512"}


def peers_dir() -> Path:
    """Where scripts/setup_peers.sh puts the peers' virtual environments."""
    from laneserve.contracts import env

    return env.get("LANESERVE_PEERS_DIR") or DEFAULT_PEERS_DIR


def peer_python(peer: str) -> tuple[str | None, str | None]:
    """The interpreter that runs `peer`'s worker, or None and why it cannot run."""
    if peer not in VENV_PEERS:
        return sys.executable, None
    venv = peers_dir() / VENV_PEERS[peer]
    python = venv / "bin" / "python"
    if not python.exists():
        return (
            None,
            f"not installed: no virtual environment at {venv} (scripts/setup_peers.sh {peer})",
        )
    return str(python), None


def read_bandwidth(gib: float, threads: int, repeats: int) -> float:
    """GB/s of `torch.sum` over `gib` GiB of float32 with `threads` torch threads."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = torch.ones(int(gib * 2**30) // 4)
        x.sum()  # warm-up: the pages are touched by `ones`, the threads started here
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            x.sum()
            times.append(time.perf_counter() - t0)
        return x.numel() * 4 / statistics.median(times) / 1e9
    finally:
        torch.set_num_threads(before)


def _field(reader, key: str):
    field = reader.get_field(key)
    return None if field is None else field.contents()


def model_bytes(path: str) -> dict:
    """The GGUF's weight bytes as a decode step reads them, and its per-token KV elements."""
    import gguf

    reader = gguf.GGUFReader(path)
    arch = _field(reader, "general.architecture")
    layers = int(_field(reader, f"{arch}.block_count"))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    kv_heads = int(_field(reader, f"{arch}.attention.head_count_kv") or heads)
    head_dim = int(_field(reader, f"{arch}.attention.key_length") or hidden // heads)
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    embed = sizes.get("token_embd.weight", 0)
    tied = "output.weight" not in sizes
    vocab = next(int(t.shape[-1]) for t in reader.tensors if t.name == "token_embd.weight")
    experts = int(_field(reader, f"{arch}.expert_count") or 0)
    used = int(_field(reader, f"{arch}.expert_used_count") or 0)
    expert_bytes = sum(n for name, n in sizes.items() if "_exps." in name)
    step = sum(sizes.values()) - (0 if tied else embed)
    return {
        "file_bytes": os.path.getsize(path),
        "weight_bytes": sum(sizes.values()),
        # the embedding is read in full only when it is also the output head
        "step_weight_bytes": step,
        # a one-token MoE step reads only its top-k experts (expert_used_count of expert_count)
        "active_step_weight_bytes": step - expert_bytes + expert_bytes * used // max(experts, 1),
        "embedding_row_bytes": embed // vocab,
        "tied_embedding": tied,
        "kv_elements_per_token": 2 * layers * kv_heads * head_dim,  # K and V, every layer
    }


# --- a `laneserve up` of the script's own: a fresh home, started and stopped -------------------


def add_model_home(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--model-home",
        default=os.environ.get("LANESERVE_HOME"),
        help="LANESERVE_HOME holding the pulled model (default: $LANESERVE_HOME)",
    )


def home_for(model_home: str | None, model_needed: bool = True) -> Path:
    """A fresh home for the run, its models/ linked to `model_home`'s."""
    if not model_home and model_needed:
        raise SystemExit("set LANESERVE_HOME (or --model-home) to a home with the model pulled")
    return make_home(Path(model_home or tempfile.mkdtemp(prefix="lsnomodel")))


def make_home(src_home: Path) -> Path:
    """A fresh LANESERVE_HOME whose models/ links to `src_home`'s pulled files."""
    home = Path(tempfile.mkdtemp(prefix="lsrec"))
    models = home / "models"
    models.mkdir()
    for path in (src_home / "models").glob("*"):
        if not path.name.endswith(".lock"):
            (models / path.name).symlink_to(path.resolve())
    return home


def start_up(home: Path, extra: list[str]) -> tuple[subprocess.Popen, dict]:
    env = dict(os.environ, LANESERVE_HOME=str(home), PYTHONPATH=str(ROOT))
    env.pop("LANESERVE_DB_URL", None)
    argv = [sys.executable, "-m", "laneserve.commands.up", "--api-port", "0", "--no-dashboard"]
    log = open(home / "up.log", "ab")  # noqa: SIM115 - the child keeps it
    proc = subprocess.Popen(argv + extra, env=env, cwd=ROOT, stdout=log, stderr=log)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"laneserve up exited {proc.returncode}; see {home / 'up.log'}")
        info = stack_info(home)
        if info.get("state") == "ready" and info.get("supervisor_pid") == proc.pid:
            return proc, info
        time.sleep(0.3)
    raise SystemExit("laneserve up not ready in 600 s")


def stop_up(proc: subprocess.Popen, timeout_s: float = 120.0) -> None:
    """Stop `laneserve up` as Ctrl-C does (SIGKILL when it has not stopped in `timeout_s`)."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()


def stack_info(home: Path) -> dict:
    try:
        return json.loads((home / "stack.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}
