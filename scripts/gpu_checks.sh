#!/usr/bin/env bash
# Everything a CUDA GPU must show, in one run (< 8 minutes on an H100/H200), from the repository root:
# kernel tests compiled, engine parity vs transformers (fp32 and bf16), CUDA graphs vs eager, offline
# throughput vs transformers, decode attention bandwidth (split-KV vs one pass), a short stack run.
# JSON goes to stdout and to ${OUT:-.}/gpu_checks.json. Without a GPU every step says it was skipped.
set -euo pipefail
unset TRITON_INTERPRET LANESERVE_ATTENTION_BACKEND
out_dir="${OUT:-.}"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
python -c "import torch" 2>/dev/null || python -m pip install -q torch==2.13.0
python -c "import laneserve" 2>/dev/null || python -m pip install -q -e ".[dev]"
laneserve model pull >/dev/null
python scripts/gpu_checks.py --out "$out_dir/gpu_checks.json" "$@"
