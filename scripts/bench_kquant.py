"""K-quant GEMV routes at real shapes: the int8 route against the fp32 one and the tile GEMM.

For each weight shape of a Llama-3.2-1B Q4_K_M file (default: q/o 2048 -> 2048 Q4_K, gate/up
2048 -> 8192 Q4_K, down 8192 -> 2048 Q6_K, output 2048 -> 128256 Q6_K; random super-blocks of the
file's type) and M rows of float32 activations, times `x @ W.T` through:

    q8k     torch.ops.laneserve.kquant_gemv_q8k (kernels/csrc/kquant_q8k.cpp): activations
            quantized to Q8_K, integer dot products (the widest route built; `--route` picks one)
    fp32    torch.ops.laneserve.kquant_gemv (kernels/csrc/kquant_gemv.cpp): super-blocks unpacked
            to float32, fp32 dot products (up to `--fp32-max-m` rows)
    tiles   KQuantLinear's GEMM route: 512 outputs dequantized at a time, dense float32 GEMM

Variants are timed round-robin (`benchlib.time_cells`), so load from other processes hits
them alike: read the per-round ratios (`ratio_to_q8k`). Prints one JSON object: the CPU, torch
threads, the q8k routes built, per shape and M each variant's median microseconds and its ratio
to q8k, q8k's weight bytes per second at each M, and per shape the largest M up to which q8k is
at least as fast as the tiles at every smaller M (`q8k_max_m`: what
`gpu_worker.kquant.KQUANT_Q8K_MAX_TOKENS` comes from).

    python scripts/bench_kquant.py [--ms 1,2,4,8,16,32,64] [--shapes q,gate,down,output]
        [--budget-s 0.2] [--threads 2] [--route 0] [--cold-mib 512]

`--cold-mib 512` reads each shape's weights from DRAM, as a model's decode step does: a matrix
timed again and again stays in the caches when it fits (9 MB for `gate`), and a kernel can look
twice as fast there as it runs in a model (Run 31: Q4_K 17 against 9 GB/s before the kernel
prefetched its weights).

`--decode` instead times single-stream decode steps of a whole model (`ModelRunner.execute`, no
sampler or scheduler) of Llama-3.2-1B's shape in a GGUF with llama.cpp's Q4_K_M type mix (Q4_K,
Q6_K for `output` and for `attn_v` / `ffn_down` in the layers llama.cpp gives more bits) and
random super-blocks, written once to `--gguf` (~0.8 GB): after a `--prompt`-token prefill, steps
alternate between the int8 route and the fp32 one (``LANESERVE_KQUANT_INT8`` 1 / 0), so load
from other processes hits both alike; reports each route's median step time and tokens/s. On the
AVX-512 VNNI route the model's parts load in the x16 layout, which the fp32 GEMV does not read
(its steps there run the tiles; the GEMV timings without `--decode` compare the routes).

    python scripts/bench_kquant.py --decode [--gguf llama-1b-q4_k_m-random.gguf] [--steps 16]

`--llama-quantize IN.gguf OUT.gguf [TYPE]` writes OUT as llama.cpp's quantizer does (TYPE Q4_K_M by
default, or Q5_K_M, Q6_K, Q8_0, Q4_0), run in the llama.cpp peer's virtual environment
(scripts/setup_peers.sh llamacpp): with `scripts/make_test_model.py`'s F32 GGUF, the real file to
serve and to compare with llama.cpp (`scripts/bench_offline.py --peers llamacpp --model OUT`):

    python scripts/make_test_model.py llama 3.2-1b OUT/llama-3.2-1b   # OUT/llama-3.2-1b.gguf
    python scripts/bench_kquant.py --llama-quantize OUT/llama-3.2-1b.gguf OUT/llama-3.2-1b-q4_k_m.gguf
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

from laneserve.gpu_worker.openmp import apply_openmp_policy  # isort: skip

apply_openmp_policy()
import numpy as np  # noqa: E402  # isort: skip
import torch  # noqa: E402  # isort: skip

from benchlib import cpu_info, gemv_max_m, time_cells  # noqa: E402  # isort: skip  (scripts/ is on sys.path)
from laneserve.gpu_worker.gguf_blocks import GGUFQuantTensor  # noqa: E402  # isort: skip
from laneserve.gpu_worker.kquant import Q8K_VNNI_ROUTE, QTYPE_IDS, KQuantLinear, random_blocks  # noqa: E402  # isort: skip
from laneserve.kernels import cpu_ext  # noqa: E402  # isort: skip

# name -> (qtype, outputs N, inputs K): Llama-3.2-1B's linears as llama.cpp's Q4_K_M writes them
SHAPES = {
    "q": ("Q4_K", 2048, 2048),
    "gate": ("Q4_K", 8192, 2048),
    "down": ("Q6_K", 2048, 8192),
    "output": ("Q6_K", 128256, 2048),
    "q5": ("Q5_K", 2048, 2048),  # Q5_K_M's type, for comparison
}


def variants(qtype: str, n: int, k: int, route: int, cold_mib: int = 0) -> tuple[dict, int]:
    """name -> (activation dtype, callable on x), and the weight's bytes. With `cold_mib`, each
    call reads the next of enough copies of the weights to fill that many MiB, so they come
    from DRAM as a model's do (one matrix read again and again stays in the caches)."""
    rng = np.random.default_rng(0)
    blocks = random_blocks(qtype, n, k, rng, scale=1e-3)
    # the int8 GEMV reads what a model's linear holds (the x16 layout where `x16_enabled`, on
    # the VNNI route), the fp32 GEMV and the tiles the file's layout
    x16 = route in (0, Q8K_VNNI_ROUTE)

    def make(b: np.ndarray, repack: bool) -> KQuantLinear:
        return KQuantLinear([GGUFQuantTensor("w", qtype, b, (n, k))], repack=repack)

    linear = make(blocks, x16)
    copies = max(1, -(-cold_mib * 2**20 // linear.nbytes()))
    linears = [linear] + [make(blocks.copy(), x16) for _ in range(copies - 1)]
    plain = linears
    if x16:  # the file's layout for the fp32 GEMV and the tiles
        plain = [make(blocks, False)] + [make(blocks.copy(), False) for _ in range(copies - 1)]
    nxt = itertools.cycle(range(copies)).__next__

    def q8k(x: torch.Tensor) -> torch.Tensor:
        lin = linears[nxt()]
        return torch.ops.laneserve.kquant_gemv_q8k(x, lin.blocks[0], lin.qtypes[0], route)

    t = QTYPE_IDS[qtype]
    fns = {
        "q8k": (torch.float32, q8k),
        "fp32": (
            torch.float32,
            lambda x: torch.ops.laneserve.kquant_gemv(x, plain[nxt()].rows[0], t, 0),
        ),
        "tiles": (torch.float32, lambda x: plain[nxt()]._gemm(x, 0)),
    }
    return fns, linear.nbytes()


# Llama-3.2-1B: hidden, intermediate, heads, KV heads, layers, vocabulary
LLAMA_1B = (2048, 8192, 32, 8, 16, 128256)


def more_bits(i: int, layers: int) -> bool:
    """llama.cpp's `use_more_bits`: the layers whose attn_v / ffn_down Q4_K_M writes as Q6_K."""
    return i < layers // 8 or i >= 7 * layers // 8 or (i - layers // 8) % 3 == 2


def write_q4_k_m(path: Path, shape: tuple[int, ...] = LLAMA_1B) -> None:
    """A Llama GGUF of `shape` with the Q4_K_M mix of random super-blocks (no tokenizer)."""
    import gguf

    h, inter, heads, kv_heads, layers, vocab = shape
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    for add, value in [
        (writer.add_block_count, layers),
        (writer.add_context_length, 4096),
        (writer.add_embedding_length, h),
        (writer.add_feed_forward_length, inter),
        (writer.add_head_count, heads),
        (writer.add_head_count_kv, kv_heads),
        (writer.add_rope_freq_base, 500000.0),
        (writer.add_layer_norm_rms_eps, 1e-5),
        (writer.add_vocab_size, vocab),
        (writer.add_rope_dimension_count, h // heads),
        (writer.add_eos_token_id, 2),
    ]:
        add(value)
    kv = h // heads * kv_heads
    tensors = {"token_embd.weight": ("Q4_K", vocab, h), "output.weight": ("Q6_K", vocab, h)}
    for i in range(layers):
        big = "Q6_K" if more_bits(i, layers) else "Q4_K"
        tensors |= {
            f"blk.{i}.attn_q.weight": ("Q4_K", h, h),
            f"blk.{i}.attn_k.weight": ("Q4_K", kv, h),
            f"blk.{i}.attn_v.weight": (big, kv, h),
            f"blk.{i}.attn_output.weight": ("Q4_K", h, h),
            f"blk.{i}.ffn_gate.weight": ("Q4_K", inter, h),
            f"blk.{i}.ffn_up.weight": ("Q4_K", inter, h),
            f"blk.{i}.ffn_down.weight": (big, h, inter),
        }
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", np.ones(h, dtype=np.float32))
    writer.add_tensor("output_norm.weight", np.ones(h, dtype=np.float32))
    for name, (qtype, rows, cols) in tensors.items():
        blocks = random_blocks(qtype, rows, cols, rng, scale=2e-4)
        writer.add_tensor(name, blocks, raw_dtype=gguf.GGMLQuantizationType[qtype])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def decode_steps(args: argparse.Namespace) -> dict:
    """Single-stream decode step times of the Q4_K_M-mix GGUF, int8 and fp32 routes alternating."""
    import os
    import statistics
    import time

    import gguf

    from laneserve.gpu_worker.gguf_loader import config_from_gguf, load_gguf_weights
    from laneserve.gpu_worker.model_runner import ModelRunner
    from laneserve.gpu_worker.models.llama import LlamaForCausalLM

    path = Path(args.gguf)
    if not path.exists():
        write_q4_k_m(path)
    t0 = time.perf_counter()
    reader = gguf.GGUFReader(str(path))
    config = config_from_gguf(reader, path)
    weights = load_gguf_weights(reader, config, path, keep_quantized=True)
    model = LlamaForCausalLM(config, weights, torch.float32, "cpu", quantization="auto")
    load_s = time.perf_counter() - t0
    block, total = 16, args.prompt + 2 * args.steps + 2
    runner = ModelRunner(model, block_size=block, num_blocks=total // block + 2)
    table = list(range(total // block + 2))
    ids = [int(i) for i in np.random.default_rng(1).integers(0, config.vocab_size, args.prompt)]
    logits = runner.execute(runner.prepare_inputs([ids], [0], [table], [True]))
    times: dict[str, list[float]] = {"q8k": [], "fp32": []}
    done = len(ids)
    for step in range(2 * args.steps + 2):
        route = ("q8k", "fp32")[step % 2]
        os.environ["LANESERVE_KQUANT_INT8"] = "1" if route == "q8k" else "0"
        token = int(logits[-1].argmax())
        t0 = time.perf_counter()
        logits = runner.execute(runner.prepare_inputs([[token]], [done], [table], [True]))
        if step >= 2:  # the first step of each route warms it
            times[route].append(time.perf_counter() - t0)
        done += 1
    os.environ.pop("LANESERVE_KQUANT_INT8")
    out = {"model": str(path), "weight_bytes": model.weight_bytes(), "load_s": round(load_s, 2)}
    for route, ts in times.items():
        ms = statistics.median(ts) * 1e3
        out[route] = {"median_step_ms": round(ms, 1), "tok_s": round(1e3 / ms, 2)}
        out[route]["weight_gb_s"] = round(model.weight_bytes() / ms / 1e6, 2)
    out["q8k_speedup"] = round(out["fp32"]["median_step_ms"] / out["q8k"]["median_step_ms"], 2)
    return out


# llama.cpp's `llama_ftype` numbers of the types `--llama-quantize` writes
LLAMA_FTYPES = {"Q4_0": 2, "Q8_0": 7, "Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18}


def llama_quantize(src: str, dst: str, kind: str = "Q4_K_M") -> None:
    """Quantize GGUF `src` into `dst` with llama.cpp's own quantizer (the peer's llama_cpp)."""
    import subprocess

    from benchlib import LLAMACPP_VENVS, VENV_PEERS, peer_python

    if kind not in LLAMA_FTYPES:
        raise SystemExit(f"--llama-quantize: type {kind!r} is not one of {sorted(LLAMA_FTYPES)}")
    python, why = peer_python("llamacpp")
    if python is None:  # either build quantizes alike: the AVX-512 one (LLAMACPP_ISA=avx512)
        VENV_PEERS["llamacpp"] = LLAMACPP_VENVS["avx512"]
        python = peer_python("llamacpp")[0]
    if python is None:
        raise SystemExit(f"--llama-quantize: llama.cpp {why}")
    code = (
        "import ctypes, sys, llama_cpp\n"
        "p = llama_cpp.llama_model_quantize_default_params()\n"
        "p.ftype = int(sys.argv[3])\n"
        "rc = llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(p))\n"
        "sys.exit(rc)\n"
    )
    rc = subprocess.run([python, "-c", code, src, dst, str(LLAMA_FTYPES[kind])]).returncode
    if rc != 0:
        raise SystemExit(f"--llama-quantize: llama.cpp's quantizer failed (exit {rc})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ms", default="1,2,4,8,16,32,64")
    ap.add_argument("--shapes", default="q,gate,down,output")
    ap.add_argument("--budget-s", type=float, default=0.2, help="time per variant and M (s)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--route", type=int, default=0, help="q8k route (0: the widest built)")
    ap.add_argument("--fp32-max-m", type=int, default=16, help="time the fp32 route up to this M")
    ap.add_argument(
        "--cold-mib", type=int, default=0,
        help="cycle through copies of each weight filling this many MiB (e.g. 512), so they "
        "stream from DRAM as in a model; default 0: one copy, cache-resident when it fits",
    )  # fmt: skip
    ap.add_argument("--decode", action="store_true", help="time whole decode steps instead")
    ap.add_argument("--gguf", default="llama-1b-q4_k_m-random.gguf", help="--decode's model file")
    ap.add_argument("--steps", type=int, default=16, help="--decode: timed steps per route")
    ap.add_argument("--prompt", type=int, default=32, help="--decode: prompt tokens")
    ap.add_argument("--llama-quantize", nargs="+", metavar="IN OUT [TYPE]")
    args = ap.parse_args()
    if args.llama_quantize:
        if len(args.llama_quantize) not in (2, 3):
            raise SystemExit("--llama-quantize takes IN.gguf OUT.gguf [TYPE]")
        llama_quantize(*args.llama_quantize)
        return
    if not cpu_ext.load():
        raise SystemExit(
            "the C++ CPU kernels are not built (LANESERVE_CPU_KERNELS=0 or no compiler)"
        )
    if args.threads:
        torch.set_num_threads(args.threads)
    result: dict = {"cpu": cpu_info(), "torch": torch.__version__}
    result["threads"] = torch.get_num_threads()
    result["q8k_routes"] = list(torch.ops.laneserve.kquant_q8k_routes())
    result["cold_mib"] = args.cold_mib
    if args.decode:
        with torch.inference_mode():
            result["decode"] = decode_steps(args)
        print(json.dumps(result, indent=1))
        return
    result["shapes"] = {}
    with torch.inference_mode():
        for name in args.shapes.split(","):
            qtype, n, k = SHAPES[name]
            fns, nbytes = variants(qtype, n, k, args.route, args.cold_mib)
            cells: dict[int, dict] = {}
            for m in map(int, args.ms.split(",")):
                run = {v: f for v, f in fns.items() if v != "fp32" or m <= args.fp32_max_m}
                cells[m] = time_cells(run, torch.randn(m, k), args.budget_s, refs=("q8k",))
                cells[m]["q8k"]["weight_gb_s"] = round(
                    nbytes / cells[m]["q8k"]["median_us"] / 1e3, 2
                )
            tiles = {m: 1.0 / c["tiles"]["ratio_to_q8k"] for m, c in cells.items()}
            result["shapes"][name] = {
                "qtype": qtype,
                "n": n,
                "k": k,
                "weight_bytes": nbytes,
                "cells": {str(m): c for m, c in cells.items()},
                "q8k_max_m": gemv_max_m(tiles),
            }
            print(json.dumps({name: result["shapes"][name]}), flush=True)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
