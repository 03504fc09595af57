"""Kernel routes: the row counts at which a CPU linear changes kernel, in one table.

A weight-only quantized linear picks its kernel per call by its row count (tokens) and the CPU's
features (`gpu_worker/quantization.py`, `gpu_worker/gemv_blocks.py`, `gpu_worker/kquant.py`). Every
crossover below was measured with `scripts/bench_quant.py` on the CPU named; the measurements,
machines and commands are in docs/benchmarks.md ("Kernel crossovers per CPU", "Where each
routing constant comes from" and the runs it cites). Re-measure there before changing a value.
Torch-free and import-free.
"""

from __future__ import annotations

# --- bf16 activations (a CPU with AVX512-BF16 or AMX) --------------------------------------------

# From this many rows a dense bf16 GEMM on the packed copy beats torch's int4 kernel
# (2-core EPYC with AVX512-BF16; docs/benchmarks.md "Kernel crossovers per CPU").
DENSE_MIN_TOKENS = 10
# laneserve's bf16 GEMV serves int4/Q8_0 calls of BF16_GEMV_MIN_TOKENS..BF16_GEMV_MAX_TOKENS rows;
# fewer run torch's int4 kernel (one 4-row pass), more go back to it (Run 9).
BF16_GEMV_MIN_TOKENS = 5  # = kBf16GemvMinRows in kernels/csrc/quant_gemv.cpp
BF16_GEMV_MAX_TOKENS = 7
# Dense (unquantized) bf16 linears: calls of 1..BF16_DENSE_GEMV_MAX_TOKENS rows run laneserve's
# bf16 GEMV (kernels/csrc/bf16_gemv.cpp) instead of torch's F.linear (2-core Xeon with AMX,
# Qwen3-0.6B's shapes; docs/benchmarks.md "Dense bf16 GEMV").
BF16_DENSE_GEMV_MAX_TOKENS = 2
# A Q8_0 linear leaves the bf16 GEMV for the int16 path only when the bf16 one measures this many
# times slower (`QuantLinear.bf16_gemv_pays`; "Where each routing constant comes from").
BF16_GEMV_SLOWER = 1.25
# AMX tile matmuls over the 4/8-bit weights serve AMX_MIN_TOKENS..AMX_MAX_TOKENS rows where they
# run (`gemv_blocks.amx_usable`); the dense copy keeps larger calls (Runs 19 and 20).
AMX_MIN_TOKENS = 5
AMX_MAX_TOKENS = 512

# --- dense copies -------------------------------------------------------------------------------

# A model's Q8_0 linears keep dense copies for big calls (above) only while all of them together
# take at most this many bytes (`quantization.dense_copies_fit`); a bigger model's run those calls
# on dequantized tiles instead. A Llama-3.2-1B shape's Q8_0 copies took 2.36 GB in bf16 beside
# its 1.31 GB file (docs/benchmarks.md Run 31); SmolLM2-135M's tied head 57 MB.
DENSE_COPY_MAX_BYTES = 1 << 30

# --- float32 activations (an AVX2-only CPU's dtype="auto") ---------------------------------------

# Up to GEMV_MAX_TOKENS rows the C++ GEMVs on the GGUF blocks, from DENSE_MIN_TOKENS_FP32 a dense
# float32 GEMM (2-core Zen 2 EPYC, AVX2 only, int4 GEMV in blocks of 8 groups: Run 14).
DENSE_MIN_TOKENS_FP32 = 96
# The same where the int4 GEMV keeps the GGUF order (`quantization.int4_blocked_cpu` False: an
# AVX-512BW build's pair loop; "Kernel crossovers per CPU").
DENSE_MIN_TOKENS_FP32_GGUF_ORDER = 48
# A tied Q8_0 LM head runs float32 calls on its dense copy only from this many rows where the int4
# GEMV reads the block order (Run 14).
Q8_0_HEAD_DENSE_MIN_TOKENS_FP32 = 128
GEMV_MAX_TOKENS = DENSE_MIN_TOKENS_FP32 - 1

# --- GGUF K-quants (Q4_K, Q5_K, Q6_K) ------------------------------------------------------------

# Calls of at most this many rows run the super-block GEMV, more dequantize tiles for a dense GEMM
# (rough single-thread timings on a 2-core Xeon, AVX-512 route: "Where each routing constant
# comes from").
KQUANT_GEMV_MAX_TOKENS = {"Q4_K": 32, "Q5_K": 16, "Q6_K": 8}
# The same limit for the int8 (Q8_K activation) GEMV, the default route, on its AVX2 route
# (`scripts/bench_kquant.py` on a 2-core AVX2 EPYC: "Where each routing constant comes from"). Its
# AVX-512 VNNI route takes every call (`kquant.q8k_max_tokens`): 512-bit registers, four outputs
# at a time and rows in tiles, it beat the tiles at every row count measured, 64 to 2,048 rows
# (a 2-core Zen 4: the tiles took 1.2-4.8x its time at Llama-3.2-1B's shapes: Run 33), and the
# x16 layout it now reads for parts of whole 16-output groups runs 1.5-3x faster again (Run 34).
KQUANT_Q8K_MAX_TOKENS = {"Q4_K": 64, "Q5_K": 32, "Q6_K": 32}
