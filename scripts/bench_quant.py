"""Weight-only int4/int8 kernels vs dense GEMMs per SmolLM2 linear shape and token count.

For each linear of SmolLM2-135M (qkv 576->960, o 576->576, gate_up 576->3072, down 1536->576,
lm_head 576->49152) and M = 1 .. 512 rows, times `x @ W.T` through:

    dense_fp32 / dense_bf16   F.linear on a float32 / bfloat16 weight
    int4_fp32 / int4_bf16     _weight_int4pack_mm_for_cpu (group 32), float32 / bfloat16 activations
    int8_fp32 / int8_bf16     _weight_int8pack_mm (per channel)

Variants are timed round-robin, many rounds per cell (the machine may be shared: read the
per-round ratios, not absolute times). Prints one JSON object: the CPU model and SIMD flags, torch
threads, per shape and M each variant's median microseconds and median time ratio to int4_bf16,
and per shape the smallest M from which dense bf16 is at least as fast as int4 bf16 (the routing
crossover `gpu_worker.quantization.DENSE_MIN_TOKENS` comes from).

    python scripts/bench_quant.py [--ms 1,2,4,...] [--budget-s 0.1] [--shapes qkv,o] [--threads 1]

`--steps` instead times whole engine decode steps (`LLMEngine.step()`, sampling included) of the
bundled model at batch 1 / 8 / 64 for `--quantization none,auto` (bf16 activations), the engines
stepped alternately so load from other processes hits both alike, and reports each model's weight
bytes and the process RSS growth while it loaded:

    python scripts/bench_quant.py --steps [--batches 1,8,64] [--num-steps 30]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time

# gpu_worker sets the OpenMP wait policy the engine runs under before torch loads
import gpu_worker  # noqa: F401  # isort: skip

import torch
import torch.nn.functional as F

from gpu_worker.quantization import QuantLinear, int4_from_float, int8_from_float

SHAPES = {  # name: (N out, K in)
    "qkv": (960, 576),
    "o": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "lm_head": (49152, 576),
}
MS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# torch's int4/int8 CPU kernels are vectorized for bf16 activations only; with float32 ones they
# run 10-100x slower than a dense fp32 GEMM, so those variants are timed for small M only.
FP32_QUANT_MAX_M = 4
SLOW_FP32 = ("int4_fp32", "int8_fp32")
SIMD_FLAGS = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512_bf16",
    "avx512_vnni",
    "amx_bf16",
    "amx_int8",
)


def cpu_info() -> dict:
    """CPU model name and the SIMD flags that matter here, from /proc/cpuinfo."""
    model, flags = "?", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model == "?":
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return {"model": model, "flags": [f for f in SIMD_FLAGS if f in flags]}


def time_cells(fns: dict, x32: torch.Tensor, budget_s: float, min_rounds: int = 9) -> dict:
    """Per variant: median microseconds per call, and per-round ratios to `int4_bf16`.

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
    ref = times.get("int4_bf16")
    out = {}
    for v, ts in times.items():
        cell = {"median_us": round(statistics.median(ts) * 1e6, 1)}
        if ref is not None:
            cell["ratio_to_int4_bf16"] = round(
                statistics.median(t / r for t, r in zip(ts, ref, strict=True)), 3
            )
        out[v] = cell
    return out


def variants(n: int, k: int) -> dict:
    """name -> (activation dtype, callable on x)."""
    w = torch.randn(n, k) * 0.05
    groups = int4_from_float(w)
    q8, s8 = int8_from_float(w)
    out = {}
    for dt, tag in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        dense = w.to(dt)
        out[f"dense_{tag}"] = (dt, lambda x, d=dense: F.linear(x, d))
        out[f"int4_{tag}"] = (dt, QuantLinear.from_int4(groups, dt))
        out[f"int8_{tag}"] = (dt, QuantLinear.from_int8(q8, s8, dt))
    return out


def crossover(ratio: dict[int, float]) -> int | None:
    """Smallest M from which dense bf16 takes at most the int4 kernel's time (ratio <= 1) at
    every larger M measured; None when the int4 kernel wins throughout."""
    ms = sorted(ratio)
    for i, m in enumerate(ms):
        if all(ratio[mm] <= 1.0 for mm in ms[i:]):
            return m
    return None


def rss_mb() -> float:
    """Resident set size of this process now (MB), from /proc/self/statm."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 1e6


def step_times(args) -> dict:
    """Decode step times of whole engine steps, per quantization mode and batch size."""
    from gpu_worker import LLM, SamplingParams

    llms, memory = {}, {}
    for mode in args.quantization.split(","):
        before = rss_mb()
        t0 = time.perf_counter()
        llms[mode] = LLM(
            model=args.model,
            dtype=args.dtype,
            quantization=mode,
            max_model_len=128,  # 32-token prompts + warm-up + timed steps
            num_blocks=max(args.batches_list) * 128 // 16,
            enable_prefix_caching=False,
        )
        memory[mode] = {
            "load_s": round(time.perf_counter() - t0, 2),
            "weight_mb": round(llms[mode].engine.runner.model.weight_bytes() / 1e6, 1),
            "rss_growth_mb": round(rss_mb() - before, 1),
        }
    params = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
    prompt = list(range(1000, 1032))  # 32 tokens
    out: dict = {"memory": memory, "decode_step_ms": {}}
    for batch in args.batches_list:
        for llm in llms.values():
            for i in range(batch):
                llm.engine.add_request(
                    f"b{batch}-{i}", prompt_token_ids=prompt, sampling_params=params
                )
            for _ in range(3):  # the prefill step (batch x 32 tokens), then decodes
                llm.engine.step()
        times: dict[str, list[float]] = {mode: [] for mode in llms}
        for _ in range(args.num_steps):
            for mode, llm in llms.items():
                t0 = time.perf_counter()
                llm.engine.step()
                times[mode].append((time.perf_counter() - t0) * 1e3)
        cell = {mode: round(statistics.median(ts), 2) for mode, ts in times.items()}
        first = next(iter(llms))
        for mode in llms:
            if mode != first:
                ratios = [a / b for a, b in zip(times[first], times[mode], strict=True)]
                cell[f"{first}_over_{mode}"] = round(statistics.median(ratios), 2)
        out["decode_step_ms"][str(batch)] = cell
        for llm in llms.values():
            for i in range(batch):
                llm.engine.abort_request(f"b{batch}-{i}")
            while llm.engine.has_unfinished_requests():
                llm.engine.step()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--budget-s", type=float, default=0.1, help="time per variant and M (s)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--steps", action="store_true", help="time engine decode steps instead")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", default="none,auto", help="modes to compare (--steps)")
    ap.add_argument("--batches", default="1,8,64", help="decode batch sizes (--steps)")
    ap.add_argument("--num-steps", type=int, default=30, help="timed steps per batch (<= 90)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    args.batches_list = [int(b) for b in args.batches.split(",")]
    ms = [int(m) for m in args.ms.split(",")]
    torch.manual_seed(0)
    result: dict = {"cpu": cpu_info(), "torch": torch.__version__}
    result["threads"] = torch.get_num_threads()
    if args.steps:
        result.update(step_times(args))
        print(json.dumps(result, indent=1))
        return
    result["shapes"] = {}
    with torch.inference_mode():
        for name in args.shapes.split(","):
            n, k = SHAPES[name]
            fns = variants(n, k)
            cells: dict[int, dict] = {}
            for m in ms:
                slow = m > FP32_QUANT_MAX_M
                run = {v: fv for v, fv in fns.items() if not (slow and v in SLOW_FP32)}
                cells[m] = time_cells(run, torch.randn(m, k), args.budget_s)
            ratio = {m: c["dense_bf16"]["ratio_to_int4_bf16"] for m, c in cells.items()}
            result["shapes"][name] = {
                "n": n,
                "k": k,
                "cells": {str(m): c for m, c in cells.items()},
                "dense_bf16_time_over_int4_bf16": {str(m): r for m, r in ratio.items()},
                "crossover_m_bf16": crossover(ratio),
            }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
