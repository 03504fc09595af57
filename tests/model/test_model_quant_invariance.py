"""The engine's invariance scenarios that change the quantized kernels' row counts
(tests/engine/test_engine_invariance.py: batch composition, chunked prefill, prefix caching,
preemption) on the quantized path, held to the bf16 path's tolerance. The long-prefill threshold,
a 64-token budget and block size 8 are scheduler and KV-layout properties, not quantization ones
(the KV cache is not quantized; both the kernels' small-row and large-row routes are reached by the
7-token budget and the batch of 16): they are held to exact equality in
tests/engine/test_engine_invariance.py.

Exact equality does not carry over: the float32 dense path is not bitwise chunk-invariant (a
7-token chunk changes logits by ~5e-5: other GEMM/attention shapes), which never flips a greedy
token there, but the quantized kernels take bf16 inputs, and rounding to bf16 turns a 1-ulp float32
difference into a 1-ulp bf16 one now and then. The kernels themselves are row-invariant
(tests/kernels/test_kernels_quant.py::test_rows_do_not_depend_on_the_batch). So each scenario's
greedy tokens are compared with every prompt run alone, for the quantized path (float32 and bf16
activations) and for today's bf16 dense path; the quantized paths must agree at least as well as
bf16 dense does, less one token per prompt on average with float32 activations (see MARGIN for bf16
activations). The figures are printed (`pytest -s`).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from laneserve.gpu_worker import LLM

pytestmark = pytest.mark.slow


def _engine_invariance_module():
    path = Path(__file__).parents[1] / "engine" / "test_engine_invariance.py"
    spec = importlib.util.spec_from_file_location("engine_invariance_for_quant", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_inv = _engine_invariance_module()
GREEDY = _inv.GREEDY
SCENARIOS = {  # name: LLM options (the engine tests' settings)
    "batch_of_16": {},
    "chunked_budget_7": {"max_num_batched_tokens": 7, "max_num_seqs": 8},
    "preemption_14_blocks": {"num_blocks": 14, "max_model_len": 224},
}
PATHS = {  # name: (model fixture, dtype, quantization)
    "bf16_dense": ("smollm2_dir", "bfloat16", "none"),
    "fp32_quantized": ("smollm2_gguf", "float32", "auto"),
    "bf16_quantized": ("smollm2_gguf", "bfloat16", "auto"),
}


def make(model: Path, dtype: str, quantization: str, **kwargs) -> LLM:
    kwargs.setdefault("max_model_len", 1024)
    kwargs.setdefault("num_blocks", 1024 // kwargs.get("block_size", 16) * 8)
    kwargs.setdefault("enable_prefix_caching", False)
    return LLM(model=str(model), dtype=dtype, quantization=quantization, **kwargs)


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))


def agreement(outs: list[list[int]], alone: list[list[int]]) -> float:
    """Mean common-prefix length with the alone run, as a fraction of the tokens generated."""
    pairs = list(zip(outs, alone, strict=True))
    return sum(common_prefix(a, b) for a, b in pairs) / sum(len(b) for _, b in pairs)


@pytest.fixture(scope="module")
def results(request) -> dict[str, dict[str, float]]:
    """path -> scenario -> agreement with prompts run alone (prefix cache off)."""
    out: dict[str, dict[str, float]] = {}
    for path, (fixture, dtype, quantization) in PATHS.items():
        model = request.getfixturevalue(fixture)
        base = make(model, dtype, quantization)
        prompts = _inv.mixed_prompts(base.tokenizer)
        alone = [base.generate([p], GREEDY)[0].token_ids for p in prompts]
        scores = {}
        for name, options in SCENARIOS.items():
            llm = base if not options else make(model, dtype, quantization, **options)
            scores[name] = agreement([o.token_ids for o in llm.generate(prompts, GREEDY)], alone)
            llm.check_integrity()
        cached = make(model, dtype, quantization, enable_prefix_caching=True)
        preamble = base.tokenizer(" ".join(_inv.SEEDS))["input_ids"][:70]
        shared = [preamble + p[:9] for p in prompts[:6]]
        expect = [base.generate([p], GREEDY)[0].token_ids for p in shared]
        cached.generate(shared, GREEDY)
        again = cached.generate(shared, GREEDY)
        assert all(o.num_cached_tokens >= 64 for o in again)
        scores["prefix_cache_hits"] = agreement([o.token_ids for o in again], expect)
        out[path] = scores
    print("\ngreedy agreement with each prompt run alone (fraction of tokens before divergence):")
    for path, scores in out.items():
        print(f"  {path:15s} " + " ".join(f"{k}={v:.3f}" for k, v in scores.items()))
    return out


# How far below bf16 dense each path may fall. float32 activations: one token per prompt on
# average. bf16 activations: also the kernel choice by phase, which is not batch-invariant by design
# (a step of >= DENSE_MIN_TOKENS rows runs the dense bf16 GEMM, a smaller one the int4 kernel, and
# on a CPU with AMX one of AMX_MIN_TOKENS..AMX_MAX_TOKENS rows the AMX matmuls; they round
# differently), so a prompt batched with others runs other kernels than alone; measured 0.82-0.93
# where bf16 dense scores 0.83-0.98. The bound still fails for a broken path (agreement near 0).
MARGIN = {"fp32_quantized": 1 / GREEDY.max_tokens, "bf16_quantized": 0.2}


@pytest.mark.parametrize("path", ["fp32_quantized", "bf16_quantized"])
def test_quantized_invariance_within_bf16_tolerance(results, path):
    for scenario, score in results[path].items():
        floor = results["bf16_dense"][scenario] - MARGIN[path]
        assert score >= floor, (path, scenario, score, results["bf16_dense"][scenario])
