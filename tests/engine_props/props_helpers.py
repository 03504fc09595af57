"""Helpers for the property-based engine tests: Hypothesis settings, running an engine.

Budget: every property runs a fixed, derandomized set of examples in CI (`prop_settings(n)`: the
same n examples on every run, no example database), so CI is stable and fast. Setting
`LANESERVE_HYPOTHESIS_EXAMPLES=N` (contracts/env.py) runs N random examples per property instead,
to search for new failures; a failure prints the `@reproduce_failure` blob, and every failing
example found goes into the regression tests as a plain test.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from hypothesis import HealthCheck, settings

from laneserve.contracts import env

TOKENIZER_LEN = 49152  # the SmolLM2 tokenizer
PADDED_VOCAB = TOKENIZER_LEN + 64  # the tiny Llama's embedding rows


def prop_settings(ci_examples: int, **kwargs) -> settings:
    """Hypothesis settings: `ci_examples` derandomized examples, or the environment's budget."""
    wanted = env.get("LANESERVE_HYPOTHESIS_EXAMPLES")
    return settings(
        max_examples=wanted or ci_examples,
        derandomize=wanted is None,
        database=None,
        deadline=None,
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        **kwargs,
    )


def save_tiny_llama(out: Path, tokenizer_dir: Path) -> Path:
    """Save a tiny random Llama (2 layers, hidden 64, `PADDED_VOCAB` rows, EOS id 2, fixed
    seed) with the tokenizer of `tokenizer_dir` into `out`; returns `out`."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=PADDED_VOCAB,
        max_position_embeddings=512,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        initializer_range=0.15,  # peaked enough that top-p nuclei are often narrow
        bos_token_id=1,
        eos_token_id=2,
    )
    LlamaForCausalLM(config).eval().save_pretrained(out, safe_serialization=True)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    assert len(tokenizer) == TOKENIZER_LEN
    tokenizer.save_pretrained(out)
    return out


class Result:
    """What the deltas of one request added up to."""

    def __init__(self) -> None:
        self.text = ""
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.num_deltas = 0
        self.metrics: dict | None = None

    def key(self) -> tuple:
        return (self.token_ids, self.text, self.finish_reason)


def run_engine(
    engine,
    requests: list[dict],
    preempt_at: dict[int, list[str]] | None = None,
    after_add: Callable | None = None,
    arrive_at: dict[str, int] | None = None,
    max_steps: int = 2000,
) -> dict[str, Result]:
    """Add `requests` (`add_request` keyword dicts with a `request_id`; request `rid` before
    step `arrive_at[rid]`, default 0), call `after_add(engine)`, step until all finish, and join
    every request's deltas. `preempt_at[step]` lists request ids preempted (by recompute) before
    that step when they are running. Checks the engine's integrity after every step, that a
    finished request gets no further delta and that every block is free at the end."""
    results = {r["request_id"]: Result() for r in requests}
    arrive_at = arrive_at or {}
    pending = sorted(requests, key=lambda r: arrive_at.get(r["request_id"], 0))
    for step in range(max_steps):
        while pending and arrive_at.get(pending[0]["request_id"], 0) <= step:
            engine.add_request(**pending.pop(0))
        if step == 0 and after_add is not None:
            after_add(engine)
        for rid in (preempt_at or {}).get(step, []):
            engine.scheduler.preempt_request(rid)
        for d in engine.step():
            res = results[d.request_id]
            assert res.finish_reason is None, f"{d.request_id}: delta after its final"
            res.text += d.new_text
            res.token_ids += d.new_token_ids
            res.num_deltas += 1
            if d.finished:
                res.finish_reason, res.error, res.metrics = d.finish_reason, d.error, d.metrics
        engine.check_integrity()
        if not pending and not engine.has_unfinished_requests():
            break
    else:
        raise AssertionError(f"requests unfinished after {max_steps} steps")
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks, "blocks leaked"
    return results
