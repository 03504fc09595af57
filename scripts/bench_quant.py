"""Weight-only int4/int8 kernels vs dense GEMMs per SmolLM2 linear shape and token count.

For each linear of SmolLM2-135M (qkv 576->960, o 576->576, gate_up 576->3072, down 1536->576,
lm_head 576->49152) and M = 1 .. 512 rows, times `x @ W.T` through:

    dense_fp32 / dense_bf16   F.linear on a float32 weight / a bfloat16 one as QuantLinear holds
                              its dense copy (`pack_dense`: oneDNN's blocked layout)
    int4_bf16 / int8_bf16     QuantLinear: _weight_int4pack_mm_for_cpu (group 32) /
                              _weight_int8pack_mm (per channel), bfloat16 activations
    quant_int4_fp32_in        QuantLinear int4 called with float32 activations (cast in and out)
    int4_fp32 / int8_fp32     the raw kernels with float32 activations and scales (small M only)
    gemv_int4_fp32            laneserve's C++ int4 GEMV (kernels/csrc/quant_gemv.cpp), float32 in and
                              out (rounded to int16 inside), the same int4 weight
    gemv_q8_0_fp32            its Q8_0 GEMV over per-channel scales, the GGUF's order
    gemv_q8_0_blocks_fp32     the same reading a copy in blocks of 16 groups where the build reads
                              it (AVX-512BW: what a tied LM head's int16 path runs; elsewhere
                              the GGUF's order again)

Variants are timed round-robin, many rounds per cell (the machine may be shared: read the
per-round ratios, not absolute times). Prints one JSON object: the CPU model and SIMD flags, torch
threads, per shape and M each variant's median microseconds and median time ratio to int4_bf16,
and per shape the smallest M from which dense bf16 is at least as fast as int4 bf16 (the routing
crossover `gpu_worker.quantization.DENSE_MIN_TOKENS` comes from), the largest M up to which the
C++ GEMV beats the torch kernel on float32 activations, and the smallest M from which the dense
float32 copy is at least as fast as the C++ GEMV (`crossover_m_fp32`: `DENSE_MIN_TOKENS_FP32`).

    python scripts/bench_quant.py [--ms 1,2,4,...] [--budget-s 0.1] [--shapes qkv,o] [--threads 1]

`--steps` instead times whole engine steps (`LLMEngine.step()`, sampling included) of the bundled
model: decodes at batch 1 / 8 / 64 and the prefill of one 512-token prompt, for `--quantization
none,auto,auto-nodense` (`--dtype`, default bf16; `auto-nodense` drops the dense bf16 copies, so
every call reads the 4-bit weights; `auto-nogemv` drops the C++ GEMV blocks used for few rows,
`auto-nolayergemv` only those of the decoder layers' linears, keeping the LM head's;
`auto-noamx` drops the AMX copies, kernels/csrc/amx_matmul.cpp, where the CPU has AMX), the
engines stepped alternately so load from other processes hits all alike; it reports each
model's weight bytes (quantized blocks, scales, dense copies) and load time:

    python scripts/bench_quant.py --steps [--batches 1,8,64] [--num-steps 30] [--prefill-reps 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

# the OpenMP wait policy the engine runs under, set before torch loads
from laneserve.gpu_worker.openmp import apply_openmp_policy  # isort: skip

apply_openmp_policy()
import torch  # noqa: E402  # isort: skip
import torch.nn.functional as F  # noqa: E402  # isort: skip

from benchlib import cpu_info, gemv_max_m, time_cells  # noqa: E402  # isort: skip
from laneserve.kernels import cpu_ext  # noqa: E402  # isort: skip
from laneserve.gpu_worker.gemv_blocks import GemvBlocks  # noqa: E402  # isort: skip
from laneserve.gpu_worker.gguf_blocks import int4_from_float, int8_from_float  # noqa: E402  # isort: skip
from laneserve.gpu_worker.quantization import (  # noqa: E402  # isort: skip
    QuantLinear,
    dense_linear,
    pack_dense,
)

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
PREFILL_TOKENS = 512  # the prompt of the prefill timing (--steps)
LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def variants(n: int, k: int) -> dict:
    """name -> (activation dtype, callable on x)."""
    w = torch.randn(n, k) * 0.05
    groups = int4_from_float(w)
    int4 = QuantLinear.from_int4(groups)
    q8, s8 = int8_from_float(w)
    int8 = QuantLinear.from_int8(q8, s8)
    gemv4 = GemvBlocks.from_int4(groups)
    gemv8 = GemvBlocks("q8_0", q8, s8[:, None].expand(n, k // 32).contiguous())
    # the raw kernels with float32 activations and scales (what QuantLinear avoids by casting)
    scales4_fp32, scales8_fp32 = int4.scales.float(), int8.scales.float()
    fns = {
        "dense_fp32": (torch.float32, lambda x, d=w: F.linear(x, d)),
        "dense_bf16": (torch.bfloat16, lambda x, d=pack_dense(w.bfloat16()): dense_linear(x, d)),
        "int4_bf16": (torch.bfloat16, int4),
        "int8_bf16": (torch.bfloat16, int8),
        "quant_int4_fp32_in": (torch.float32, int4),  # QuantLinear: cast to bf16 and back
        "int4_fp32": (
            torch.float32,
            lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, int4.weight, 32, scales4_fp32),
        ),
        "int8_fp32": (
            torch.float32,
            lambda x: torch.ops.aten._weight_int8pack_mm(x, int8.weight, scales8_fp32),
        ),
    }
    if cpu_ext.load():
        fns["gemv_int4_fp32"] = (torch.float32, gemv4)
        fns["gemv_q8_0_fp32"] = (torch.float32, gemv8)
        blocks8 = GemvBlocks("q8_0", q8, gemv8.scale, block_copy=True)
        blocks8.prepare()
        fns["gemv_q8_0_blocks_fp32"] = (torch.float32, blocks8)
    return fns


def crossover(ratio: dict[int, float]) -> int | None:
    """Smallest M from which the dense variant takes at most the quantized one's time (ratio =
    dense / quantized <= 1) at every larger M measured; None when the quantized one wins
    throughout."""
    ms = sorted(ratio)
    for i, m in enumerate(ms):
        if all(ratio[mm] <= 1.0 for mm in ms[i:]):
            return m
    return None


def build_engines(args) -> tuple[dict, dict]:
    """One `LLM` per mode in `--quantization` (`auto-nodense`: auto with its dense bf16 copies
    dropped, every call on the quantized kernels; `auto-nogemv`: without the C++ GEMV blocks,
    float32 activations on torch's kernels; both: `auto-nodense-nogemv`) and its memory
    figures."""
    from laneserve.gpu_worker import LLM
    from laneserve.gpu_worker.quantization import QuantLinear

    llms, memory = {}, {}
    for name in args.quantization.split(","):
        t0 = time.perf_counter()
        llm = LLM(
            model=args.model,
            dtype=args.dtype,
            quantization=name.split("-")[0],
            max_model_len=PREFILL_TOKENS + 64,
            num_blocks=max(max(args.batches_list) * 128, 2 * PREFILL_TOKENS + 128) // 16,
            enable_prefix_caching=False,
        )
        model = llm.engine.runner.model
        linears = [getattr(layer, f) for layer in model.layers for f in LINEARS]
        for drop in name.split("-")[1:]:  # "nodense", "nogemv", "nolayergemv", "noamx"
            for lin in [*linears, *([] if drop == "nolayergemv" else [model.lm_head])]:
                if not isinstance(lin, QuantLinear):
                    continue
                if drop == "noamx":
                    if lin.gemv is not None:
                        lin.gemv.use_amx, lin.gemv.amx_qs, lin.gemv.amx_scale = False, None, None
                elif drop == "nodense":
                    lin._dense = None
                else:  # torch's kernels only: their int8 weights made now, no tiles
                    lin.weight  # noqa: B018 (made on first read from Q8_0 blocks)
                    lin.gemv, lin.tiled = None, False
        llms[name] = llm
        memory[name] = {
            "load_s": round(time.perf_counter() - t0, 2),
            "weight_mb": round(model.weight_bytes() / 1e6, 1),
        }
    return llms, memory


def summarize(times: dict[str, list[float]]) -> dict:
    """Median ms per engine and the median per-round ratio of the first engine to each other."""
    cell = {name: round(statistics.median(ts), 2) for name, ts in times.items()}
    first, *others = times
    for name in others:
        ratios = [a / b for a, b in zip(times[first], times[name], strict=True)]
        cell[f"{first}_over_{name}"] = round(statistics.median(ratios), 2)
    return cell


def decode_step_ms(llms: dict, batch: int, num_steps: int) -> dict:
    """Median step time of `batch` running decodes (32-token prompts), engines alternating."""
    from laneserve.gpu_worker import SamplingParams

    params = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
    prompt = list(range(1000, 1032))
    for llm in llms.values():
        for i in range(batch):
            llm.engine.add_request(f"b{batch}-{i}", prompt_token_ids=prompt, sampling_params=params)
        for _ in range(3):  # the prefill step (batch x 32 tokens), then decodes
            llm.engine.step()
    times: dict[str, list[float]] = {name: [] for name in llms}
    for _ in range(num_steps):
        for name, llm in llms.items():
            t0 = time.perf_counter()
            llm.engine.step()
            times[name].append((time.perf_counter() - t0) * 1e3)
    for llm in llms.values():
        for i in range(batch):
            llm.engine.abort_request(f"b{batch}-{i}")
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
    return summarize(times)


def prefill_step_ms(llms: dict, reps: int) -> dict:
    """Median time of the one step that prefills a PREFILL_TOKENS-token prompt."""
    from laneserve.gpu_worker import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    prompt = [1000 + (i * 37) % 20000 for i in range(PREFILL_TOKENS)]
    times: dict[str, list[float]] = {name: [] for name in llms}
    for r in range(reps):
        for name, llm in llms.items():
            llm.engine.add_request(f"p{r}", prompt_token_ids=prompt, sampling_params=params)
            t0 = time.perf_counter()
            llm.engine.step()
            times[name].append((time.perf_counter() - t0) * 1e3)
            while llm.engine.has_unfinished_requests():
                llm.engine.step()
    return summarize(times)


def step_times(args) -> dict:
    """Decode and prefill step times of whole engine steps, per quantization mode."""
    llms, memory = build_engines(args)
    out: dict = {"memory": memory, "decode_step_ms": {}}
    for batch in args.batches_list:
        out["decode_step_ms"][str(batch)] = decode_step_ms(llms, batch, args.num_steps)
    out[f"prefill_{PREFILL_TOKENS}_step_ms"] = prefill_step_ms(llms, args.prefill_reps)
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
    ap.add_argument(
        "--quantization", default="none,auto,auto-nodense", help="modes to compare (--steps)"
    )
    ap.add_argument("--batches", default="1,8,64", help="decode batch sizes (--steps)")
    ap.add_argument("--num-steps", type=int, default=30, help="timed steps per batch (<= 90)")
    ap.add_argument("--prefill-reps", type=int, default=5, help="timed prefills (--steps)")
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
            if "gemv_int4_fp32" in fns:
                g = {
                    m: c["gemv_int4_fp32"]["ratio_to_quant_int4_fp32_in"] for m, c in cells.items()
                }
                d = {m: c["dense_fp32"]["ratio_to_quant_int4_fp32_in"] for m, c in cells.items()}
                result["shapes"][name].update(
                    gemv_int4_time_over_quant_int4_fp32_in={str(m): r for m, r in g.items()},
                    dense_fp32_time_over_quant_int4_fp32_in={str(m): r for m, r in d.items()},
                    gemv_max_m_fp32=gemv_max_m(g),
                    # from here the dense float32 copy is at least as fast as the C++ GEMV
                    crossover_m_fp32=crossover({m: d[m] / g[m] for m in d}),
                )
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
