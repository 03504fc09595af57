#!/usr/bin/env python3
"""Offline throughput: laneserve's engine vs transformers `generate`, same process, same model.

One set of summarization prompts (the project's sample set: module docstrings of the Python
standard library, chat-templated "Summarize ..." requests) goes through

- transformers `generate`: static batching (batch 32, left padding), greedy, forced output length;
- laneserve `LLM.generate`: continuous batching over the paged KV cache, same forced length;

then both run a single stream (batch 1) for the decode-speed comparison. Prints one JSON object:
tokens, seconds, tok/s, the ratios, and how many outputs agree token for token.

    python scripts/bench_offline.py [--num-prompts 64] [--max-tokens 64] [--dtype auto]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import time

# The engines' OpenMP wait policy, for both sides of the comparison, before torch loads (libgomp
# reads it once, at load).
from gpu_worker.openmp import apply_openmp_policy  # isort: skip

apply_openmp_policy()
import torch  # noqa: E402  # isort: skip

STDLIB_MODULES = [
    "argparse",
    "asyncio",
    "base64",
    "bisect",
    "calendar",
    "collections",
    "colorsys",
    "contextlib",
    "copy",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "difflib",
    "enum",
    "fractions",
    "functools",
    "getopt",
    "gettext",
    "glob",
    "gzip",
    "hashlib",
    "heapq",
    "hmac",
    "html",
    "imaplib",
    "inspect",
    "io",
    "ipaddress",
    "json",
    "locale",
    "logging",
    "mailbox",
    "mimetypes",
    "numbers",
    "operator",
    "optparse",
    "pathlib",
    "pickle",
    "pprint",
    "queue",
    "random",
    "re",
    "sched",
    "secrets",
    "selectors",
    "shelve",
    "shlex",
    "shutil",
    "smtplib",
    "socket",
    "sqlite3",
    "statistics",
    "string",
    "struct",
    "subprocess",
    "tarfile",
    "tempfile",
    "textwrap",
    "threading",
    "timeit",
    "tokenize",
    "typing",
    "uuid",
    "wave",
    "weakref",
    "zipfile",
    "zlib",
]


def sample_documents(n: int, max_words: int = 160) -> list[str]:
    docs = []
    for name in STDLIB_MODULES:
        try:
            doc = importlib.import_module(name).__doc__ or ""
        except Exception:
            continue
        words = doc.split()
        if len(words) >= 20:
            docs.append(" ".join(words[:max_words]))
        if len(docs) == n:
            break
    while len(docs) < n:  # recycle with a marker so prompts stay distinct
        docs.append(f"(copy {len(docs)}) " + docs[len(docs) % max(1, len(docs))])
    return docs


def build_prompts(tokenizer, n: int) -> list[list[int]]:
    out = []
    for doc in sample_documents(n):
        messages = [{"role": "user", "content": f"Summarize in two sentences:\n\n{doc}"}]
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        out.append(list(ids["input_ids"] if isinstance(ids, dict) else ids))
    return out


def run_transformers(model, prompts, max_tokens, batch_size, pad_id):
    outs = []
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i : i + batch_size]
        width = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for r, p in enumerate(chunk):  # left padding
            ids[r, width - len(p) :] = torch.tensor(p)
            mask[r, width - len(p) :] = 1
        with torch.inference_mode():
            gen = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=pad_id,
            )
        outs.extend(gen[:, width:].tolist())
    return outs, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=32, help="transformers static batch")
    ap.add_argument("--single-tokens", type=int, default=64, help="tokens for the batch-1 run")
    ap.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    from gpu_worker import LLM, SamplingParams
    from gpu_worker.engine import resolve_dtype
    from gpu_worker.model_files import resolve_model_path
    from gpu_worker.model_loader import convert_gguf

    path = resolve_model_path(args.model)
    hf_dir = convert_gguf(path) if path.is_file() else path
    dtype = resolve_dtype(args.dtype, torch.device("cpu"))
    llm = LLM(
        model=str(hf_dir),
        dtype=str(dtype).removeprefix("torch."),
        max_model_len=2048,
        max_num_seqs=args.num_prompts,
    )
    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=dtype).eval()
    prompts = build_prompts(llm.tokenizer, args.num_prompts)
    pad_id = llm.tokenizer.pad_token_id if llm.tokenizer.pad_token_id is not None else 2
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)

    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
    run_transformers(hf, prompts[:2], 4, 2, pad_id)

    t0 = time.perf_counter()
    ours = llm.generate(prompts, params)
    ours_s = time.perf_counter() - t0
    ref, ref_s = run_transformers(hf, prompts, args.max_tokens, args.batch_size, pad_id)
    tokens = args.num_prompts * args.max_tokens
    agree = sum(o.token_ids == r for o, r in zip(ours, ref, strict=True))

    # Single stream, decode only: time for N tokens minus time for 1 token (the prefill), both sides.
    single = SamplingParams(max_tokens=args.single_tokens, temperature=0.0, ignore_eos=True)
    first = SamplingParams(max_tokens=1, temperature=0.0)
    llm.engine.block_manager.reset_prefix_cache()
    t0 = time.perf_counter()
    llm.generate([prompts[0]], first)
    ours_prefill = time.perf_counter() - t0
    llm.engine.block_manager.reset_prefix_cache()
    t0 = time.perf_counter()
    one = llm.generate([prompts[0]], single)[0]
    ours_1 = time.perf_counter() - t0 - ours_prefill
    _, ref_prefill = run_transformers(hf, [prompts[0]], 1, 1, pad_id)
    ref_1_out, ref_1 = run_transformers(hf, [prompts[0]], args.single_tokens, 1, pad_id)
    ref_1 -= ref_prefill
    prompt_lens = [len(p) for p in prompts]
    result = {
        "machine": f"{platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads",
        "dtype": str(dtype).removeprefix("torch."),
        "num_prompts": args.num_prompts,
        "prompt_tokens_mean": round(sum(prompt_lens) / len(prompt_lens), 1),
        "max_tokens": args.max_tokens,
        "throughput": {
            "tokens": tokens,
            "transformers_s": round(ref_s, 2),
            "laneserve_s": round(ours_s, 2),
            "transformers_tok_s": round(tokens / ref_s, 1),
            "laneserve_tok_s": round(tokens / ours_s, 1),
            "ratio": round(ref_s / ours_s, 2),
            "outputs_identical": f"{agree}/{args.num_prompts}",
        },
        "single_stream_decode": {
            "tokens": args.single_tokens,
            "transformers_tok_s": round((args.single_tokens - 1) / ref_1, 1),
            "laneserve_tok_s": round((args.single_tokens - 1) / ours_1, 1),
            "laneserve_tpot_ms_engine": round(one.metrics["tpot_ms"], 2),
            "ratio": round(ref_1 / ours_1, 2),
            "identical": one.token_ids == ref_1_out[0],
        },
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
