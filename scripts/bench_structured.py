#!/usr/bin/env python3
"""Structured outputs: what constrained decoding costs and what it buys, in one invocation.

Same model, same prompts, side by side:

- **tok/s with vs without a schema** at batch 1 and batch N (default 64): the constrained run goes
  first (greedy, a JSON schema of a person record); the unconstrained run then generates exactly
  as many tokens per request (`ignore_eos`, `max_tokens` = the constrained request's length), so
  both runs have the same batch shape step for step and the ratio is the per-step overhead of
  building and applying the grammar bitmasks (both runs find the prompts in the prefix cache;
  greedy rows compute a mask only where the grammar refuses their unmasked pick: the JSON's
  `greedy_rows_masked`);
- **grammar compile time**: the first compile of the schema (the one-off llguidance tokenizer build
  reported apart) and a cached one (median of 200 cache hits: lookup + matcher copy);
- **valid share**: outputs that parse and validate with `jsonschema`, without constraints (the
  schema only in the prompt) vs with them.

Targets (issue 20): 100% valid with constraints; <= 10% tok/s overhead at batch 64; cached
compile < 1 ms. Prints one JSON object, with the CPU model and flags.

``--tools``: the same with a forced tool call instead (issue 49: ``tool_choice`` naming the function
whose ``parameters`` are the schema, the grammar the gateway sends: the reply is its arguments,
valid when they validate); ``--tool-choice required``: any number of calls, valid = an array of
calls naming the function, each with arguments that validate.

    python scripts/bench_structured.py [--num-prompts 64] [--batch1-prompts 4] [--max-tokens 160]
        [--tools]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jsonschema  # noqa: E402
import torch  # noqa: E402
from benchlib import cpu_info  # noqa: E402

from laneserve.contracts.openai.structured import parse_structured  # noqa: E402
from laneserve.contracts.openai.tools import parse_tools  # noqa: E402
from laneserve.gpu_worker import LLM, SamplingParams  # noqa: E402
from laneserve.gpu_worker.structured_output import GrammarCompiler  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
        "role": {"enum": ["admin", "user", "guest"]},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    },
    "required": ["name", "age", "email", "role", "skills"],
    "additionalProperties": False,
}
TOOL = {"type": "function", "function": {"name": "add_person", "parameters": SCHEMA}}
FORCED = {"type": "function", "function": {"name": "add_person"}}  # the reply: its arguments
SUBJECTS = ["a teacher", "a pilot", "a chef", "a student", "a nurse", "an artist", "a farmer"]


def conversations(n: int) -> list[list[dict]]:
    schema = json.dumps(SCHEMA)
    return [
        [
            {
                "role": "user",
                "content": f"Describe {SUBJECTS[i % len(SUBJECTS)]} number {i} as a JSON object "
                f"following this schema, JSON only: {schema}",
            }
        ]
        for i in range(n)
    ]


def valid(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def valid_calls(text: str) -> bool:
    """A forced reply (``--tools``): ``[{"name": "add_person", "arguments": {...}}, ...]``."""
    try:
        calls = json.loads(text)
    except ValueError:
        return False
    ok = isinstance(calls, list) and len(calls) > 0
    return ok and all(
        c.get("name") == "add_person" and valid(json.dumps(c.get("arguments"))) for c in calls
    )


def timed_chat(llm: LLM, convs, params) -> tuple[list, float]:
    start = time.perf_counter()
    outs = llm.chat(convs, params)
    return outs, time.perf_counter() - start


def overhead_pair(
    llm: LLM, convs, spec: dict, max_tokens: int, one_by_one: bool, check=valid
) -> dict:
    """Constrained run, then an unconstrained run of exactly the same per-request lengths.

    Both find the prompts in the prefix cache (a one-token pass over them goes first): otherwise
    the first run alone would pay every prefill and the second would reuse them."""
    constrained = SamplingParams(max_tokens=max_tokens, temperature=0.0, structured_outputs=spec)
    llm.chat(convs, SamplingParams(max_tokens=1, temperature=0.0))
    runs = [[c] for c in convs] if one_by_one else [convs]
    outs, with_s = [], 0.0
    structured = llm.engine.structured
    counts = ("num_greedy_rows", "num_forced_rows", "num_refused_rows")
    before = [getattr(structured, c) for c in counts]
    for group in runs:
        o, s = timed_chat(llm, group, constrained)
        outs += o
        with_s += s
    rows, forced, masked = (getattr(structured, c) - b for c, b in zip(counts, before, strict=True))
    lengths = [len(o.token_ids) for o in outs]
    plain = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    without_s, plain_tokens = 0.0, 0
    for k, group in enumerate(runs):
        start = sum(len(g) for g in runs[:k])
        o, s = timed_chat(llm, group, plain[start : start + len(group)])
        without_s += s
        plain_tokens += sum(len(x.token_ids) for x in o)
    tokens = sum(lengths)
    assert plain_tokens == tokens, (plain_tokens, tokens)
    return {
        "requests": len(convs),
        "tokens": tokens,
        "tok_s_without_schema": round(tokens / without_s, 1),
        "tok_s_with_schema": round(tokens / with_s, 1),
        "overhead_pct": round(100.0 * (with_s - without_s) / without_s, 1),
        "valid_with_schema": sum(check(o.text) for o in outs),
        "cut_by_max_tokens": sum(o.finish_reason == "length" for o in outs),
        # greedy rows sample unmasked first: only the rows the grammar refuses compute a mask
        "greedy_rows": rows,
        "greedy_rows_forced_token": forced,
        "greedy_rows_masked": masked,
    }


def compile_times(llm: LLM, spec: dict) -> dict:
    compiler = GrammarCompiler(llm.tokenizer, llm.engine.model_config.vocab_size, [2])
    start = time.perf_counter()
    _ = compiler.ll_tokenizer
    tokenizer_ms = (time.perf_counter() - start) * 1e3
    start = time.perf_counter()
    compiler.matcher(spec)
    first_ms = (time.perf_counter() - start) * 1e3
    cached = []
    for _ in range(200):
        start = time.perf_counter()
        compiler.matcher(spec)
        cached.append((time.perf_counter() - start) * 1e3)
    return {
        "tokenizer_build_ms_once": round(tokenizer_ms, 1),
        "first_compile_ms": round(first_ms, 2),
        "cached_compile_ms_median": round(statistics.median(cached), 4),
        "cached_compile_ms_max": round(max(cached), 4),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M")
    ap.add_argument("--num-prompts", type=int, default=64, help="the large batch")
    ap.add_argument("--batch1-prompts", type=int, default=4, help="requests run one at a time")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--tools", action="store_true", help="a forced tool call, not a schema")
    ap.add_argument(
        "--tool-choice", choices=("function", "required"), default="function",
        help="--tools: the named function (OpenAI's forced call: one call, its arguments) or "
        "'required' (any number of calls: a small model may repeat calls until max tokens)",
    )  # fmt: skip
    args = ap.parse_args()

    kwargs = {"dtype": args.dtype, "max_num_seqs": max(64, args.num_prompts)}
    llm = LLM(model=args.model, **kwargs) if args.model else LLM(**kwargs)
    spec = parse_structured(
        {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}}
    )
    check = valid
    if args.tools:  # the grammar of tool_choice "required" (contracts/openai/tools.py)
        choice = "required" if args.tool_choice == "required" else FORCED
        spec = parse_tools({"tools": [TOOL], "tool_choice": choice}).spec()
        check = valid_calls if args.tool_choice == "required" else valid
    convs = conversations(args.num_prompts)
    llm.chat(convs[:2], SamplingParams(max_tokens=4, temperature=0.0, structured_outputs=spec))

    result: dict = {"cpu": cpu_info(), "torch": torch.__version__, "dtype": str(llm.engine.dtype)}
    result["compile"] = compile_times(llm, spec)
    result["batch_1"] = overhead_pair(
        llm, convs[: args.batch1_prompts], spec, args.max_tokens, True, check
    )
    result[f"batch_{args.num_prompts}"] = overhead_pair(
        llm, convs, spec, args.max_tokens, False, check
    )
    free, _ = timed_chat(llm, convs, SamplingParams(max_tokens=args.max_tokens, temperature=0.0))
    result["valid_share"] = {
        "without_constraints": round(sum(check(o.text) for o in free) / len(free), 3),
        "with_constraints": round(
            result[f"batch_{args.num_prompts}"]["valid_with_schema"] / len(convs), 3
        ),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
