"""Compile every Triton kernel ahead of time for a CUDA architecture, without a GPU.

``python -m laneserve.kernels.triton.compile_check [--arch 90 80]`` lowers each kernel through Triton's full
pipeline (TTIR -> TTGIR -> LLVM -> PTX -> cubin with the ``ptxas`` bundled in the triton wheel) for
the shapes the engine uses (Llama-3-8B layer, SmolLM2-135M layer; bf16 and fp32) and prints one JSON
line per kernel with its shared-memory and register use. Exit status 1 if any kernel fails.
It catches what the interpreter cannot: type errors of the compiled dialect, integer widths,
shared-memory overflow. Run it with TRITON_INTERPRET unset.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

# Devices' shared memory per block (bytes), for the sm_XX we check.
SHARED_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}

_DT = {"bf16": "bf16", "fp32": "fp32"}


def _cases():
    from laneserve.kernels.triton import attention, cache, layer_ops

    # (num_q_heads, num_kv_heads, head_dim): Llama-3-8B and SmolLM2-135M
    for hq, hk, d in ((32, 8, 128), (9, 3, 64)):
        for dt in ("bf16", "fp32"):
            for max_query_len in (1, None):
                block_m, block_q, tile_n = attention._launch_config(
                    hq // hk, max_query_len, dt == "fp32"
                )
                sig = {n: f"*{dt}" for n in ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr")}
                sig.update(cu_seqlens_q_ptr="*i32", seq_lens_ptr="*i32", block_tables_ptr="*i32")
                sig.update(part_acc_ptr="*fp32", part_ml_ptr="*fp32")
                sig.update(num_seqs="i32", scale_log2="fp32", window="i32")
                for n in (
                    "q_t",
                    "q_h",
                    "o_t",
                    "o_h",
                    "k_b",
                    "k_s",
                    "k_h",
                    "v_b",
                    "v_s",
                    "v_h",
                    "bt",
                ):
                    sig[f"stride_{n}"] = "i32"
                consts = dict(
                    HEAD_DIM=d,
                    HEAD_PAD=d,
                    BLOCK_SIZE=16,
                    G=hq // hk,
                    BLOCK_M=block_m,
                    BLOCK_Q=block_q,
                    TILE_N=tile_n,
                    FP32_DOT=False,
                    IEEE_DOT=dt == "fp32",
                )
                segment_counts = (1, attention.SPLIT_KV_SEGMENTS) if max_query_len == 1 else (1,)
                windows = (False, True) if dt == "bf16" else (False,)  # sliding window
                for segments, window in itertools.product(segment_counts, windows):
                    name = (
                        f"attention[{dt},Hq={hq},Hk={hk},D={d},max_q={max_query_len},"
                        f"segments={segments},window={window}]"
                    )
                    consts_s = dict(consts, NUM_SEGMENTS=segments, USE_WINDOW=window)
                    yield name, attention._unified_attention_kernel, sig, consts_s
            sig = {"part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32", "out_ptr": f"*{dt}"}
            sig.update(num_q_heads="i32", stride_o_t="i32", stride_o_h="i32")
            consts = dict(HEAD_DIM=d, HEAD_PAD=d, NUM_SEGMENTS=attention.SPLIT_KV_SEGMENTS)
            name = f"attention_reduce[{dt},D={d}]"
            yield name, attention._reduce_segments_kernel, sig, consts

            sig = {n: f"*{dt}" for n in ("key_ptr", "value_ptr", "k_cache_ptr", "v_cache_ptr")}
            sig["slot_mapping_ptr"] = "*i64"
            for n in (
                "key_t",
                "key_h",
                "value_t",
                "value_h",
                "k_b",
                "k_s",
                "k_h",
                "v_b",
                "v_s",
                "v_h",
            ):
                sig[f"stride_{n}"] = "i32"
            heads_pad = 1 << (hk - 1).bit_length()
            consts = dict(
                NUM_KV_HEADS=hk, HEAD_DIM=d, HEADS_PAD=heads_pad, DIM_PAD=d, BLOCK_SIZE=16
            )
            yield f"reshape_and_cache[{dt},Hk={hk}]", cache._reshape_and_cache_kernel, sig, consts

    for dt in ("bf16", "fp32"):
        sig = {
            n: f"*{dt}"
            for n in ("x_ptr", "residual_ptr", "weight_ptr", "out_ptr", "new_residual_ptr")
        }
        sig.update(stride_x="i32", stride_r="i32", stride_o="i32", stride_nr="i32")
        sig.update(hidden="i32", eps="fp32")
        yield (
            f"rms_norm[{dt}]",
            layer_ops._rms_norm_kernel,
            sig,
            dict(HAS_RESIDUAL=True, BLOCK=4096),
        )
        sig = {
            "positions_ptr": "*i64",
            "q_ptr": f"*{dt}",
            "k_ptr": f"*{dt}",
            "cos_sin_ptr": "*fp32",
        }
        for n in ("q_t", "q_h", "k_t", "k_h", "cs"):
            sig[f"stride_{n}"] = "i32"
        consts = dict(
            NUM_Q_HEADS=32, NUM_KV_HEADS=8, Q_HEADS_PAD=32, KV_HEADS_PAD=8, HALF=64, HALF_PAD=64
        )
        yield f"rotary_embedding[{dt}]", layer_ops._rotary_kernel, sig, consts
        sig = {"x_ptr": f"*{dt}", "out_ptr": f"*{dt}", "stride_x": "i32", "stride_o": "i32"}
        sig["inter"] = "i32"
        yield f"silu_and_mul[{dt}]", layer_ops._silu_and_mul_kernel, sig, dict(BLOCK=1024)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Compile the Triton kernels for sm_XX, no GPU needed"
    )
    parser.add_argument("--arch", type=int, nargs="+", default=[90], help="compute capability x10")
    args = parser.parse_args(argv)

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if triton.knobs.runtime.interpret:
        print(json.dumps({"error": "unset TRITON_INTERPRET to compile"}))
        return 2
    failures = 0
    for arch in args.arch:
        target = GPUTarget("cuda", arch, 32)
        for name, fn, sig, consts in _cases():
            sig = {**sig, **dict.fromkeys(consts, "constexpr")}
            row = {"kernel": name, "arch": arch}
            try:
                compiled = triton.compile(ASTSource(fn, sig, consts), target=target)
                row["shared_bytes"] = compiled.metadata.shared
                limit = SHARED_LIMIT.get(arch)
                row["ok"] = limit is None or compiled.metadata.shared <= limit
            except Exception as exc:  # report every kernel, not only the first failure
                row.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[:2000]}")
            failures += not row["ok"]
            print(json.dumps(row), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
