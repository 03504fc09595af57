"""Helpers for the property-based engine tests: Hypothesis settings, running an engine.

Budget: every property runs a fixed, derandomized set of examples in CI (`prop_settings(n)`: the
same n examples on every run, no example database), so CI is stable and fast. Setting
`LANESERVE_HYPOTHESIS_EXAMPLES=N` (contracts/env.py) runs N random examples per property instead,
to search for new failures; a failure prints the `@reproduce_failure` blob, and every failing
example found goes into the regression tests as a plain test.
"""

from __future__ import annotations

from collections.abc import Callable

from hypothesis import HealthCheck, settings

from contracts import env

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
    max_steps: int = 2000,
) -> dict[str, Result]:
    """Add `requests` (`add_request` keyword dicts with a `request_id`), call `after_add(engine)`,
    step until all finish, and join every request's deltas. `preempt_at[step]` lists request ids
    preempted (by recompute) before that step when they are running. Checks the engine's
    integrity after every step, that a finished request gets no further delta and that every
    block is free at the end."""
    results = {r["request_id"]: Result() for r in requests}
    for r in requests:
        engine.add_request(**r)
    if after_add is not None:
        after_add(engine)
    for step in range(max_steps):
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
        if not engine.has_unfinished_requests():
            break
    else:
        raise AssertionError(f"requests unfinished after {max_steps} steps")
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks, "blocks leaked"
    return results
