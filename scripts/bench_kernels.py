#!/usr/bin/env python
"""Benchmark the laneserve kernels on a GPU and print one JSON object on stdout.

Figures:
- ``decode_attention``: Triton ``unified_attention`` on a pure-decode batch (default 64 sequences x
  2048 context, Llama-3-8B layer: 32 q heads, 8 KV heads, head_dim 128, bf16, block_size 16);
  achieved bandwidth = KV bytes read / time, next to PyTorch SDPA on the same data laid out dense,
  and as a share of the GPU's peak bandwidth (``--peak-gbps``, H200: 4800).
- ``correctness``: Triton vs the PyTorch reference on the GPU (a mixed prefill/decode batch, and
  the decode batch above) as max abs error.
- ``decode_step``: one decode step of a randomly initialised 8B-shaped stack
  (:mod:`laneserve.kernels.bench_stack`) with and without CUDA graphs (:mod:`laneserve.kernels.cuda_graphs`).

``--smoke`` runs tiny shapes on CPU under TRITON_INTERPRET=1 to check the script itself (its
timings mean nothing).

Usage: ``python scripts/bench_kernels.py [--batch 64 --context 2048] [--smoke]``
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--peak-gbps", type=float, default=4800.0, help="GPU memory bandwidth, GB/s")
    p.add_argument("--step-layers", type=int, default=32, help="layers of the decode-step stack")
    p.add_argument("--skip-step", action="store_true", help="skip the 8B decode-step figure")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (interpreter)")
    p.add_argument(
        "--sweep",
        action="store_true",
        help="only the decode-attention sweep: batch 1/8/64 x context 1k/8k/32k, split-KV vs not",
    )
    return p.parse_args()


ARGS = _parse()
if ARGS.smoke:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from laneserve.kernels import reference  # noqa: E402
from laneserve.kernels.bench_stack import PagedLlamaStack, StackConfig  # noqa: E402
from laneserve.kernels.cuda_graphs import DecodeGraphs, StaticInput  # noqa: E402
from laneserve.kernels.triton import unified_attention as triton_attention  # noqa: E402


def _time_ms(fn, device: str, iters: int = 20) -> float:
    """Median time of ``fn()`` in ms (CUDA events on GPU, perf_counter on CPU)."""
    fn()
    if device == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=10, rep=max(50, iters * 5)))
    samples = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return sorted(samples)[1]


def _decode_batch(batch, context, hq, hk, d, block_size, dtype, device, gen):
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq + 1
    perm = torch.randperm(num_blocks - 1, generator=gen) + 1  # scattered blocks, 0 unused
    kv_shape = (num_blocks, block_size, hk, d)
    return {
        "q": torch.randn(batch, hq, d, generator=gen).to(dtype).to(device),
        "k_cache": torch.randn(kv_shape, generator=gen).to(dtype).to(device),
        "v_cache": torch.randn(kv_shape, generator=gen).to(dtype).to(device),
        "cu_seqlens_q": torch.arange(batch + 1, dtype=torch.int32, device=device),
        "seq_lens": torch.full((batch,), context, dtype=torch.int32, device=device),
        "block_tables": perm.view(batch, blocks_per_seq).int().to(device),
        "softmax_scale": d**-0.5,
    }


def bench_decode_attention(device: str, gen: torch.Generator) -> tuple[dict, dict]:
    batch, context, bs = ARGS.batch, ARGS.context, ARGS.block_size
    hq, hk, d = (32, 8, 128) if not ARGS.smoke else (4, 2, 32)
    args = _decode_batch(batch, context, hq, hk, d, bs, torch.bfloat16, device, gen)
    kv_bytes = 2 * batch * context * hk * d * args["k_cache"].element_size()
    out = torch.empty_like(args["q"])
    t_triton = _time_ms(lambda: triton_attention(**args, out=out), device)

    # The same KV, dense [B, Hk, ctx, D], for SDPA (its best case: no paging).
    idx = args["block_tables"].long()
    k = args["k_cache"][idx].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()
    v = args["v_cache"][idx].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()
    q4 = args["q"].unsqueeze(2)  # [B, Hq, 1, D]

    def sdpa():
        return torch.nn.functional.scaled_dot_product_attention(
            q4, k, v, scale=args["softmax_scale"], enable_gqa=True
        )

    t_sdpa = _time_ms(sdpa, device)
    ref = sdpa().squeeze(2)
    err = (triton_attention(**args).float() - ref.float()).abs().max().item()
    gbps = kv_bytes / (t_triton * 1e-3) / 1e9
    sdpa_gbps = kv_bytes / (t_sdpa * 1e-3) / 1e9
    figures = {
        "shape": {
            "batch": batch,
            "context": context,
            "num_q_heads": hq,
            "num_kv_heads": hk,
            "head_dim": d,
            "block_size": bs,
            "dtype": "bfloat16",
        },
        "kv_bytes": kv_bytes,
        "triton_ms": round(t_triton, 4),
        "triton_gbps": round(gbps, 1),
        "triton_pct_of_peak": round(100 * gbps / ARGS.peak_gbps, 1),
        "sdpa_dense_ms": round(t_sdpa, 4),
        "sdpa_dense_gbps": round(sdpa_gbps, 1),
        "sdpa_pct_of_peak": round(100 * sdpa_gbps / ARGS.peak_gbps, 1),
        "peak_gbps": ARGS.peak_gbps,
    }
    return figures, {"decode_max_abs_err_vs_sdpa": err}


def sweep_decode_attention(device: str, gen: torch.Generator) -> list[dict]:
    """Decode attention GB/s at batch x context, one pass vs split-KV (Llama-3-8B heads, bf16)."""
    from laneserve.kernels.triton.attention import SPLIT_KV_SEGMENTS, choose_num_segments

    hq, hk, d = (32, 8, 128) if not ARGS.smoke else (4, 2, 32)
    grid = [(b, c) for b in (1, 8, 64) for c in (1024, 8192, 32768)]
    if ARGS.smoke:
        grid = [(1, 64), (4, 96)]
    rows = []
    for batch, context in grid:
        args = _decode_batch(
            batch, context, hq, hk, d, ARGS.block_size, torch.bfloat16, device, gen
        )
        kv_bytes = 2 * batch * context * hk * d * args["k_cache"].element_size()
        out = torch.empty_like(args["q"])
        row = {"batch": batch, "context": context, "kv_bytes": kv_bytes}
        row["auto_segments"] = choose_num_segments(torch.device(device), batch, hk, 1)
        results = {}
        for label, segments in (("one_pass", 1), ("split_kv", SPLIT_KV_SEGMENTS)):

            def run(a=args, o=out, n=segments):
                return triton_attention(**a, out=o, num_segments=n)

            ms = _time_ms(run, device)
            results[label] = triton_attention(**args, num_segments=segments).float()
            gbps = kv_bytes / (ms * 1e-3) / 1e9
            row[label] = {
                "ms": round(ms, 4),
                "gbps": round(gbps, 1),
                "pct_of_peak": round(100 * gbps / ARGS.peak_gbps, 1),
            }
        row["max_abs_diff"] = (results["one_pass"] - results["split_kv"]).abs().max().item()
        rows.append(row)
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def check_mixed(device: str, gen: torch.Generator) -> dict:
    """Triton vs reference on a mixed prefill/decode batch (bf16 and fp32)."""
    pairs = [(1, 37), (7, 7), (20, 45), (1, 200), (13, 13)]
    pairs += [(64, 300)] if not ARGS.smoke else []
    errs = {}
    for dtype in (torch.float32, torch.bfloat16):
        bs, hq, hk, d = (16, 32, 8, 128) if not ARGS.smoke else (16, 4, 2, 32)
        nbs = [-(-kv // bs) for _, kv in pairs]
        num_blocks = sum(nbs) + 3
        perm = torch.randperm(num_blocks, generator=gen)
        bt = torch.zeros(len(pairs), max(nbs), dtype=torch.int32)
        start = 0
        for s, n in enumerate(nbs):
            bt[s, :n] = perm[start : start + n]
            start += n
        qlens = [q for q, _ in pairs]
        args = {
            "q": torch.randn(sum(qlens), hq, d, generator=gen).to(dtype).to(device),
            "k_cache": torch.randn(num_blocks, bs, hk, d, generator=gen).to(dtype).to(device),
            "v_cache": torch.randn(num_blocks, bs, hk, d, generator=gen).to(dtype).to(device),
            "cu_seqlens_q": torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()])
            .int()
            .to(device),
            "seq_lens": torch.tensor([kv for _, kv in pairs], dtype=torch.int32, device=device),
            "block_tables": bt.to(device),
            "softmax_scale": d**-0.5,
        }
        got = triton_attention(**args).float()
        want = reference.unified_attention(**args).float()
        errs[f"mixed_max_abs_err_{str(dtype).removeprefix('torch.')}"] = (
            (got - want).abs().max().item()
        )
    return errs


def bench_decode_step(device: str) -> dict:
    """Decode step time of a random 8B-shaped stack, eager vs CUDA graphs."""
    if ARGS.smoke:
        cfg = StackConfig(
            vocab_size=97,
            hidden_size=64,
            intermediate_size=96,
            num_layers=2,
            num_q_heads=4,
            num_kv_heads=2,
            head_dim=16,
            max_position=4096,
        )
    else:
        cfg = StackConfig(num_layers=ARGS.step_layers)
    batch, context, bs = ARGS.batch, ARGS.context, ARGS.block_size
    blocks_per_seq = -(-(context + 1) // bs)
    model = PagedLlamaStack(cfg, batch * blocks_per_seq, bs, torch.bfloat16, device)
    block_tables = torch.arange(batch * blocks_per_seq, dtype=torch.int32, device=device)
    block_tables = block_tables.view(batch, blocks_per_seq)
    pos = torch.full((batch,), context, dtype=torch.int64, device=device)
    inputs = {
        "input_ids": torch.randint(0, cfg.vocab_size, (batch,), device=device),
        "positions": pos,
        "slot_mapping": (block_tables[:, context // bs].long() * bs + context % bs),
        "cu_seqlens_q": torch.arange(batch + 1, dtype=torch.int32, device=device),
        "seq_lens": (pos + 1).int(),
        "block_tables": block_tables,
    }
    result = {"num_layers": cfg.num_layers, "batch": batch, "context": context}
    result["eager_ms"] = round(_time_ms(lambda: model(**inputs), device, iters=5), 3)
    if device != "cuda":
        result["cuda_graph_ms"] = None
        return result
    specs = [
        StaticInput("input_ids", (), torch.int64),
        StaticInput("positions", (), torch.int64),
        StaticInput("slot_mapping", (), torch.int64, pad=-1),
        StaticInput("cu_seqlens_q", (), torch.int32, pad="arange", extra_rows=1),
        StaticInput("seq_lens", (), torch.int32, pad=1),
        StaticInput("block_tables", (blocks_per_seq,), torch.int32, pad=0),
    ]
    graphs = DecodeGraphs(model.forward, specs, [1, batch], device=device, enabled=True)
    t0 = time.perf_counter()
    graphs.capture()
    result["capture_s"] = round(time.perf_counter() - t0, 2)
    eager = model(**inputs)
    replay = graphs(**inputs).clone()
    result["graph_vs_eager_max_abs_logit_diff"] = (replay - eager).abs().max().item()
    result["cuda_graph_ms"] = round(_time_ms(lambda: graphs(**inputs), device, iters=5), 3)
    return result


def main() -> int:
    device = "cpu" if ARGS.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"error": "no CUDA device; run with --smoke to check the script"}))
        return 1
    if ARGS.smoke:
        ARGS.batch, ARGS.context = min(ARGS.batch, 4), min(ARGS.context, 64)
    os.environ.pop("LANESERVE_ATTENTION_BACKEND", None)
    if ARGS.smoke:
        os.environ["LANESERVE_ATTENTION_BACKEND"] = "triton"
    gen = torch.Generator().manual_seed(0)
    report = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (smoke)"}
    if ARGS.sweep:
        report["peak_gbps"] = ARGS.peak_gbps
        report["decode_attention_sweep"] = sweep_decode_attention(device, gen)
        print(json.dumps(report, indent=2))
        return 0
    report["decode_attention"], correctness = bench_decode_attention(device, gen)
    correctness.update(check_mixed(device, gen))
    report["correctness"] = correctness
    if not ARGS.skip_step:
        report["decode_step"] = bench_decode_step(device)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
