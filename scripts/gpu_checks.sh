#!/usr/bin/env bash
# One-shot kernel checks for a machine with a CUDA GPU (run from the repository root):
#  1. the kernel tests, with Triton compiled for the GPU (tests/kernels pick CUDA when present);
#  2. scripts/bench_kernels.py: decode attention GB/s vs SDPA, GPU correctness, decode step
#     time with and without CUDA graphs. JSON goes to ${OUT:-.}/bench_kernels.json.
set -euo pipefail
unset TRITON_INTERPRET LANESERVE_ATTENTION_BACKEND
out_dir="${OUT:-.}"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
python -m pytest tests/kernels -q -x -m "not slow" -p no:cacheprovider 2>&1 | tail -n 15
python scripts/bench_kernels.py "$@" | tee "$out_dir/bench_kernels.json"
