"""The measuring protocol every engine worker of `bench_offline.py --peers` follows (stdlib only).

Each engine runs in its own process (a peer's own virtual environment for vLLM and llama.cpp), so
this module imports nothing but the standard library. A worker builds an `Engine` adapter and
calls `run_worker`, which

1. times the first token: one request of one token, right after the engine loaded (the parent
   subtracts its own spawn timestamp to get process start -> first token);
2. in ``full`` mode, after a short warm-up: the offline run (every prompt, forced length, the
   engine's own batching), then single-stream decode (time for N tokens minus time for 1 token,
   i.e. without the prefill);
3. writes one JSON object to the ``--out`` file.

Spec (JSON file, written by the parent): ``prompts`` (token ids, chat-templated by the parent),
``max_tokens``, ``single_tokens``, ``mode`` (``full`` | ``start``), ``model`` (the path this
engine loads), ``threads``, ``max_model_len`` (default 2048), ``options`` (engine-specific).
The result holds ``peak_rss_mib`` beside the timings.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Engine:
    """One engine, as the protocol sees it.

    generate: ``(prompts, n_tokens) -> outputs``: every prompt gets exactly ``n_tokens`` new
        tokens (EOS ignored), greedy; returns the new token ids per prompt, in order.
    info: what the report shows about the engine (versions, dtype, threads, batching).
    """

    generate: Callable[[list[list[int]], int], list[list[int]]]
    info: dict[str, Any] = field(default_factory=dict)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="one engine's run for bench_offline.py --peers")
    ap.add_argument("--spec", required=True, help="JSON spec written by bench_offline.py")
    ap.add_argument("--out", required=True, help="where to write the JSON result")
    return ap.parse_args()


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def measure(engine: Engine, spec: dict[str, Any], loaded_at: float) -> dict[str, Any]:
    """Run the protocol on a loaded engine; returns the result fields (seconds, tok/s)."""
    prompts: list[list[int]] = spec["prompts"]
    result: dict[str, Any] = {"loaded_at": loaded_at}
    engine.generate([prompts[0]], 1)
    result["first_token_at"] = time.time()  # wall clock: compared with the parent's spawn time
    if spec["mode"] != "full":
        return result
    n, single = spec["max_tokens"], spec["single_tokens"]
    engine.generate(prompts[:2], 4)  # warm-up: first batched step, allocator, caches
    outs, offline_s = _timed(lambda: engine.generate(prompts, n))
    if any(len(o) != n for o in outs):
        lengths = sorted({len(o) for o in outs})
        raise RuntimeError(f"forced length not honoured: got lengths {lengths}, wanted {n}")
    tokens = len(prompts) * n
    _, prefill_s = _timed(lambda: engine.generate([prompts[0]], 1))
    one, full_s = _timed(lambda: engine.generate([prompts[0]], single))
    decode_s = max(full_s - prefill_s, 1e-9)
    result.update(
        offline={
            "tokens": tokens,
            "seconds": round(offline_s, 3),
            "tok_s": round(tokens / offline_s, 1),
        },
        single_stream_decode={
            "tokens": single,
            "prefill_s": round(prefill_s, 4),
            "seconds": round(decode_s, 3),
            "tok_s": round((single - 1) / decode_s, 1),
        },
        first_output_ids=one[0][:16],
    )
    return result


def peak_rss_mib() -> float:
    """This process's peak RSS (VmHWM), or a child's where one peaked higher (vLLM's engine core
    runs in its own process), in MiB."""
    import resource

    own = next(
        int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:")
    )
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # KiB on Linux
    return round(max(own, children) / 1024, 1)


def run_worker(build: Callable[[dict[str, Any]], Engine]) -> None:
    """Entry point of a worker script: read the spec, build the engine, measure, write JSON.

    Any failure is written as ``{"error": ...}`` (exit status 1) so the parent can report it.
    """
    args = parse_args()
    with open(args.spec) as f:
        spec = json.load(f)
    out: dict[str, Any] = {"python": platform.python_version()}
    status = 0
    try:
        engine = build(spec)
        out["engine"] = engine.info
        out.update(measure(engine, spec, time.time()))
        out["peak_rss_mib"] = peak_rss_mib()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which skips the peer
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["traceback"] = traceback.format_exc()[-4000:]
        status = 1
    with open(args.out, "w") as f:
        json.dump(out, f)
    sys.stdout.flush()
    sys.exit(status)
