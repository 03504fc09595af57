#!/usr/bin/env python
"""ATen ops and step time of one CPU decode step of a model, printed as one JSON object.

Figures:
- ``ops_batch1``: dispatcher ops of one batch-1 decode step (``torch.profiler``, CPU activity):
  ``top_level_ops`` the ops Python dispatches (``aten::`` and the C++ ``laneserve::`` ops of
  kernels/cpu_ext.py; what an op calls inside is not counted again), ``all_ops`` nested ones
  included (``aten::linear`` calling ``aten::t`` and ``aten::mm`` counts 3), ``aten_ops`` the
  ``aten::`` part of that; ``by_type`` / ``top_level_by_type`` per op name, most frequent first.
- ``step_ms``: median and quartiles of the decode step time at each ``--batches`` size, each
  sequence with a context between ``--context / 2`` and ``--context`` tokens (so the batch is
  ragged, as in serving), ``--repeats`` timed steps after ``--warmup``.
- ``cpu``: the CPU model, core count, torch threads and the SIMD flags in /proc/cpuinfo that
  oneDNN uses (avx2, avx512*, amx*), and the OpenMP variables in effect.

The step goes through ``ModelRunner.prepare_inputs`` + ``execute`` as the engine does (host-side
batch building included). The KV cache holds zeros: decode time does not depend on its values.

Usage: ``python scripts/bench_step_ops.py [--model PATH] [--dtype bfloat16] [--batches 1,8,64]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from laneserve.gpu_worker.openmp import apply_openmp_policy  # noqa: E402  (torch-free; before torch loads)

OPENMP_POLICY_APPLIED = apply_openmp_policy()

import torch  # noqa: E402
from benchlib import cpu_info  # noqa: E402

from laneserve.gpu_worker.model_loader import load_model_files  # noqa: E402
from laneserve.gpu_worker.model_runner import ModelRunner  # noqa: E402
from laneserve.gpu_worker.models.llama import LlamaForCausalLM  # noqa: E402
from laneserve.gpu_worker.quantization import resolve_mode  # noqa: E402

BLOCK_SIZE = 16
OP_NAMESPACES = ("aten::", "laneserve::")


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="GGUF file or HF directory (default: the bundled SmolLM2)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument(
        "--quantization",
        default="auto",
        choices=["auto", "none", "int8", "int4"],
        help="weights as `laneserve up` loads them (default auto: the GGUF's own formats)",
    )
    p.add_argument("--batches", default="1,8,64", help="comma-separated decode batch sizes")
    p.add_argument("--context", type=int, default=512, help="longest context per sequence, tokens")
    p.add_argument("--repeats", type=int, default=30, help="timed steps per batch size")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps per batch size")
    p.add_argument(
        "--threads",
        help="comma-separated torch thread counts to compare, interleaved step by step in one "
        "process (e.g. 1,2); default: the process's setting only",
    )
    return p.parse_args()


def default_model() -> Path:
    """The bundled model, from the test cache when it is there (no download), else pulled."""
    from laneserve.gpu_worker.model_files import BUNDLED_MODELS, DEFAULT_MODEL, pull_model

    cache = Path(os.environ.get("LANESERVE_TEST_CACHE") or Path.home() / ".cache/laneserve-test")
    cached = cache / "models" / BUNDLED_MODELS[DEFAULT_MODEL].filename
    return cached if cached.exists() else pull_model()


class DecodeBatch:
    """Decode steps for `batch` sequences of ragged context lengths on a runner."""

    def __init__(self, runner: ModelRunner, batch: int, context: int):
        self.runner = runner
        lo = max(1, context // 2)
        self.lens = [lo + (context - lo) * i // max(1, batch - 1) for i in range(batch)]
        per_seq = -(-context // BLOCK_SIZE)
        self.tables = [list(range(b * per_seq, (b + 1) * per_seq)) for b in range(batch)]

    def step(self) -> torch.Tensor:
        n = len(self.lens)
        inputs = self.runner.prepare_inputs(
            [[7]] * n, [length - 1 for length in self.lens], self.tables, [True] * n
        )
        return self.runner.execute(inputs)


def count_ops(decode: DecodeBatch) -> dict:
    """Dispatcher ops (``aten::`` and our ``laneserve::``) of one step, from the profiler."""
    from torch.profiler import ProfilerActivity, profile

    decode.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        decode.step()
    events = [e for e in prof.events() if e.name.startswith(OP_NAMESPACES)]
    ids = {e.id for e in events}
    top = [e for e in events if e.cpu_parent is None or e.cpu_parent.id not in ids]
    return {
        "aten_ops": sum(e.name.startswith("aten::") for e in events),
        "all_ops": len(events),
        "top_level_ops": len(top),
        "by_type": dict(Counter(e.name for e in events).most_common()),
        "top_level_by_type": dict(Counter(e.name for e in top).most_common()),
    }


def _summary(samples: list[float]) -> dict:
    q = statistics.quantiles(samples, n=4) if len(samples) > 1 else samples * 3
    return {
        "median": round(statistics.median(samples), 3),
        "p25": round(q[0], 3),
        "p75": round(q[2], 3),
        "repeats": len(samples),
    }


def time_steps(decode: DecodeBatch, warmup: int, repeats: int, threads: list[int]) -> dict:
    """Step times in ms per thread count, the counts taking turns step by step (so a change in
    the machine's load hits them alike)."""
    samples: dict[int, list[float]] = {n: [] for n in threads}
    for i in range(warmup + repeats):
        for n in threads:
            torch.set_num_threads(n)
            t0 = time.perf_counter()
            decode.step()
            if i >= warmup:
                samples[n].append((time.perf_counter() - t0) * 1e3)
    return {str(n): _summary(xs) for n, xs in samples.items()}


def main() -> None:
    args = _parse()
    batches = [int(b) for b in args.batches.split(",")]
    default_threads = torch.get_num_threads()
    threads = [int(n) for n in args.threads.split(",")] if args.threads else [default_threads]
    dtype = getattr(torch, args.dtype)
    quantization = resolve_mode(args.quantization, torch.device("cpu"), dtype)
    loaded = load_model_files(args.model or default_model(), quantization=quantization)
    model = LlamaForCausalLM(loaded.config, loaded.weights, dtype, "cpu", quantization)
    per_seq = -(-args.context // BLOCK_SIZE)
    runner = ModelRunner(model, block_size=BLOCK_SIZE, num_blocks=max(batches) * per_seq + 1)
    result = {
        "model": str(loaded.source),
        "dtype": args.dtype,
        "quantization": model.quantization,
        "context": args.context,
        "torch": torch.__version__,
        "cpu": cpu_info() | {"torch_threads": torch.get_num_threads()},
        "openmp": {
            k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")
        },
        "openmp_policy_applied": OPENMP_POLICY_APPLIED,
        "ops_batch1": count_ops(DecodeBatch(runner, 1, args.context)),
        "step_ms": {},
    }
    for batch in batches:
        times = time_steps(
            DecodeBatch(runner, batch, args.context), args.warmup, args.repeats, threads
        )
        result["step_ms"][str(batch)] = times if args.threads else times[str(default_threads)]
    torch.set_num_threads(default_threads)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
