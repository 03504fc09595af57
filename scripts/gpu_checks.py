#!/usr/bin/env python
"""Everything a GPU must show, in one run, as one JSON object (``scripts/gpu_checks.sh`` runs it).

Steps (each in its own process with its own time limit, so one hang or crash does not lose the
others' figures; ``--only a,b`` picks some):

- ``kernel_tests``: ``tests/kernels`` with Triton compiled for the GPU (not interpreted).
- ``parity``: the engine's greedy continuations vs transformers on the same GPU, float32 (must be
  token-identical) and bfloat16 (agreement and mean common prefix reported).
- ``cuda_graphs``: greedy tokens with CUDA graphs vs ``enforce_eager`` (must be equal).
- ``throughput``: offline tok/s of the engine vs transformers ``generate`` on the GPU (bf16, the
  same prompts and forced lengths).
- ``int4``: ``quantization="int4"`` (torch's CUDA int4 kernel on the GGUF's own Q4_1 values) vs
  the dequantized bf16 model: greedy agreement and mean common prefix on the prompts, and tok/s of
  both at batch 1 and 64.
- ``decode_attention``: ``scripts/bench_kernels.py --sweep``: decode attention bandwidth as a share
  of the device's peak at batch 1/8/64 and context 1k/8k/32k, split-KV vs one pass.
- ``stack``: ``scripts/bench_lanes.py`` with the GPU worker (interactive TTFT/TPOT idle and under a
  bulk job).

Without a CUDA device every step is reported as skipped with the reason, and the exit code is 0,
so CI can check that the script and every step's imports work (``tests/kernels/test_gpu_checks.py``).

    python scripts/gpu_checks.py [--only parity,cuda_graphs] [--out gpu_checks.json]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = "smollm2-135m"
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Translate to German: the weather is nice today.",
    "Summarize: Paged attention stores the KV cache in fixed-size blocks.",
    "Once upon a time",
    "List three prime numbers:",
    "Water boils at",
    "The quick brown fox",
]

# step name -> (time limit in seconds, modules its process imports)
STEPS: dict[str, tuple[float, tuple[str, ...]]] = {
    "kernel_tests": (240.0, ("pytest", "laneserve.kernels.triton")),
    "parity": (150.0, ("transformers", "laneserve.gpu_worker")),
    "cuda_graphs": (120.0, ("laneserve.gpu_worker", "laneserve.kernels.cuda_graphs")),
    "throughput": (150.0, ("transformers", "laneserve.gpu_worker")),
    "int4": (150.0, ("laneserve.gpu_worker", "laneserve.gpu_worker.quantization")),
    "decode_attention": (150.0, ("laneserve.kernels.triton",)),
    "stack": (240.0, ("openai", "laneserve.broker.client")),
}


def _prompt_ids() -> list[list[int]]:
    """The prompts as token ids (the same ids go to both engines, so tokenization cannot differ)."""
    from transformers import AutoTokenizer

    return [AutoTokenizer.from_pretrained(_hf_dir())(p).input_ids for p in PROMPTS]


def _hf_dir() -> str:
    from laneserve.gpu_worker.model_files import resolve_model_path
    from laneserve.gpu_worker.model_loader import convert_gguf

    return str(convert_gguf(resolve_model_path(MODEL)))


def _generate(dtype: str, enforce_eager: bool, max_tokens: int) -> list[list[int]]:
    from laneserve.gpu_worker import LLM, SamplingParams

    llm = LLM(MODEL, dtype=dtype, device="cuda", enforce_eager=enforce_eager)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate(_prompt_ids(), params)
    ids = [list(o.token_ids) for o in outs]
    del llm
    import torch

    torch.cuda.empty_cache()
    return ids


def _hf(dtype: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_dir = _hf_dir()
    torch_dtype = torch.float32 if dtype == "float32" else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch_dtype).to("cuda").eval()
    return model, AutoTokenizer.from_pretrained(hf_dir)


def _hf_greedy(model, max_tokens: int) -> list[list[int]]:
    """transformers' greedy continuations, each ending at its EOS or after `max_tokens`. No
    `min_new_tokens`: that masks EOS to -inf, so where EOS is the argmax transformers picks the
    runner-up (the first GPU run, 4 December 2026: prompt 0, token 29, EOS 21.82 vs 19.11)."""
    import torch

    out = []
    for prompt_ids in _prompt_ids():  # one at a time: no padding, so the comparison is exact
        ids = torch.tensor([prompt_ids], device="cuda")
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=max_tokens, do_sample=False)
        out.append(gen[0, ids.shape[1] :].tolist())
    return out


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def step_parity() -> dict:
    result = {}
    for dtype in ("float32", "bfloat16"):
        ours = _generate(dtype, enforce_eager=False, max_tokens=32)  # ignore_eos: 32 tokens
        model, _ = _hf(dtype)
        theirs = _hf_greedy(model, 32)
        del model
        ours = [a[: len(b)] for a, b in zip(ours, theirs, strict=True)]  # up to transformers' EOS
        prefixes = [_common_prefix(a, b) for a, b in zip(ours, theirs, strict=True)]
        result[dtype] = {
            "identical": sum(a == b for a, b in zip(ours, theirs, strict=True)),
            "prompts": len(PROMPTS),
            "mean_common_prefix": sum(prefixes) / len(prefixes),
            "tokens_compared": sum(len(b) for b in theirs),
        }
    result["ok"] = result["float32"]["identical"] == len(PROMPTS)
    return result


def step_cuda_graphs() -> dict:
    graphs = _generate("bfloat16", enforce_eager=False, max_tokens=48)
    eager = _generate("bfloat16", enforce_eager=True, max_tokens=48)
    same = sum(a == b for a, b in zip(graphs, eager, strict=True))
    return {"identical": same, "prompts": len(PROMPTS), "ok": same == len(PROMPTS)}


def step_throughput() -> dict:
    import torch

    prompts = [f"{p} (request {i})" for i in range(8) for p in PROMPTS]  # 64 prompts
    max_tokens = 128
    from laneserve.gpu_worker import LLM, SamplingParams

    llm = LLM(MODEL, dtype="bfloat16", device="cuda")
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:4], params)  # warm-up: graph capture, kernel compile
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    ours_s = time.perf_counter() - t0
    ours_tokens = sum(len(o.token_ids) for o in outs)
    del llm
    torch.cuda.empty_cache()

    model, tok = _hf("bfloat16")
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    batch = tok(prompts, return_tensors="pt", padding=True).to("cuda")
    kwargs = dict(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
    with torch.no_grad():
        model.generate(**{k: v[:4] for k, v in batch.items()}, **kwargs)  # warm-up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        gen = model.generate(**batch, **kwargs)
        torch.cuda.synchronize()
    hf_s = time.perf_counter() - t0
    hf_tokens = (gen.shape[1] - batch["input_ids"].shape[1]) * len(prompts)
    ours, theirs = ours_tokens / ours_s, hf_tokens / hf_s
    return {
        "prompts": len(prompts),
        "max_tokens": max_tokens,
        "laneserve_tok_s": round(ours, 1),
        "transformers_tok_s": round(theirs, 1),
        "ratio": round(ours / theirs, 2),
        "target_ratio": 3.0,
    }


def _tok_s(llm, prompts: list[str], max_tokens: int) -> float:
    from laneserve.gpu_worker import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:2], params)  # warm-up: graph capture, kernel compile
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0)


def step_int4() -> dict:
    import torch

    from laneserve.gpu_worker import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    prompts64 = [f"{p} (request {i})" for i in range(8) for p in PROMPTS]
    result: dict = {}
    ids = {}
    for mode in ("none", "int4"):
        llm = LLM(MODEL, dtype="bfloat16", device="cuda", quantization=mode)
        ids[mode] = [list(o.token_ids) for o in llm.generate(_prompt_ids(), params)]
        result[f"{mode}_tok_s_batch1"] = round(_tok_s(llm, PROMPTS[:1], 128), 1)
        result[f"{mode}_tok_s_batch64"] = round(_tok_s(llm, prompts64, 128), 1)
        del llm
        torch.cuda.empty_cache()
    prefixes = [_common_prefix(a, b) for a, b in zip(ids["int4"], ids["none"], strict=True)]
    result["identical"] = sum(a == b for a, b in zip(ids["int4"], ids["none"], strict=True))
    result["prompts"] = len(PROMPTS)
    result["mean_common_prefix"] = sum(prefixes) / len(prefixes)
    result["ok"] = result["mean_common_prefix"] >= 8  # same weights, different kernel rounding
    return result


def _subprocess_json(argv: list[str], timeout_s: float) -> dict:
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        return {"ok": False, "rc": proc.returncode, "stderr_tail": proc.stderr[-2000:]}
    start = proc.stdout.find("{")
    return json.loads(proc.stdout[start:]) if start >= 0 else {"stdout_tail": proc.stdout[-2000:]}


def step_kernel_tests() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET",)}
    argv = [sys.executable, "-m", "pytest", "tests/kernels", "-q", "-m", "not slow"]
    argv += ["-p", "no:cacheprovider"]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, env=env, timeout=230)
    tail = proc.stdout.strip().splitlines()[-1:] or [""]
    return {"ok": proc.returncode == 0, "rc": proc.returncode, "summary": tail[0]}


def step_decode_attention() -> dict:
    return _subprocess_json([sys.executable, "scripts/bench_kernels.py", "--sweep"], 145)


def step_stack() -> dict:
    argv = [sys.executable, "scripts/bench_lanes.py", "--interactive", "8", "--bulk-lines", "64"]
    return _subprocess_json(argv, 235)


def _run_step(name: str) -> dict:
    """Run one step in this process (the child side of :func:`main`)."""
    return globals()[f"step_{name}"]()


def _skip_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=",".join(STEPS), help="comma list of steps")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("--step", default=None, help=argparse.SUPPRESS)  # child process
    args = ap.parse_args()
    if args.step:
        print(json.dumps(_run_step(args.step)))
        return 0
    names = [n for n in args.only.split(",") if n]
    unknown = sorted(set(names) - set(STEPS))
    if unknown:
        ap.error(f"unknown steps {unknown}; known: {', '.join(STEPS)}")
    reason = _skip_reason()
    report: dict = {"device": None, "steps": {}}
    if reason is None:
        import torch

        report["device"] = torch.cuda.get_device_name()
    for name in names:
        limit, modules = STEPS[name]
        for module in modules:  # a missing import is a failure of the script, GPU or not
            importlib.import_module(module)
        if reason is not None:
            report["steps"][name] = {"skipped": reason}
            continue
        t0 = time.perf_counter()
        try:
            figures = _subprocess_json([sys.executable, __file__, "--step", name], limit)
        except subprocess.TimeoutExpired:
            figures = {"ok": False, "error": f"timed out after {limit:.0f} s"}
        figures["seconds"] = round(time.perf_counter() - t0, 1)
        report["steps"][name] = figures
        print(f"== {name}: {json.dumps(figures)[:300]}", file=sys.stderr, flush=True)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
