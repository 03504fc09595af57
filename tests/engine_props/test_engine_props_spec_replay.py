"""`scripts/bench_spec_replay.py`: the engine's speculative controller replayed over recorded
outputs under a stated step cost (no model): the step and token accounting on outputs that copy
their prompt and on outputs that copy nothing, batches, the best-of-all-drafts ceiling, and the
script's JSON end to end."""

from __future__ import annotations

import json

from laneserve.gpu_worker.config import SpeculativeConfig
from tests.harness import load_script, run_script

_script = load_script("bench_spec_replay")
replay = _script.replay
lookup_ceiling = _script.lookup_ceiling


def config(adaptive: bool, lookup_min: int = 2) -> SpeculativeConfig:
    return SpeculativeConfig(
        num_speculative_tokens=4, prompt_lookup_min=lookup_min, adaptive=adaptive
    )


PROMPT = list(range(100, 140))
COPY = list(range(100, 140))  # the output copies the prompt: every 2-gram after the first matches
FRESH = list(range(500, 540))  # nothing to copy from


def test_forced_replay_of_a_copied_prompt_counts_steps_tokens_and_cost_exactly():
    """40 output tokens, the first the prefill's: one step without drafts (no 2-gram yet), then
    4 drafts + the bonus token per step, 2 drafts and the bonus in the last (`max_tokens`): 9 steps
    for 39 tokens, every draft accepted. With a step cost of 1 ms whatever its tokens, plain
    decoding costs 39 ms and speculation 9."""
    got = replay([(PROMPT, COPY)], 1, config(False), (1.0, 0.0))
    assert got["tokens"] == 39 and got["decode_steps"] == 9
    # prompt_lookup_min 1: the first decode step drafts from the one-token match too
    one = replay([(PROMPT, COPY)], 1, config(False, lookup_min=1), (1.0, 0.0))
    assert one["tokens"] == 39 and one["decode_steps"] == 8
    assert got["tokens_per_sequence_step"] == round(39 / 9, 3)
    assert got["draft_tokens"] == got["accepted_tokens"] == 4 * 7 + 2
    assert got["acceptance_rate"] == 1.0
    assert got["modelled_speedup"] == round(39 / 9, 3)
    # a cost of 1 ms per token instead: verification rows cost what they save
    per_token = replay([(PROMPT, COPY)], 1, config(False), (0.0, 1.0))
    assert per_token["modelled_speedup"] == 1.0  # 9 steps + 30 drafts = 39 rows either way


def test_outputs_with_nothing_to_copy_decode_one_token_a_step():
    for adaptive in (True, False):
        got = replay([(PROMPT, FRESH)], 1, config(adaptive), (5.0, 1.0))
        assert got["decode_steps"] == got["tokens"] == 39
        assert got["draft_tokens"] == 0 and got["acceptance_rate"] is None
        assert got["modelled_speedup"] == 1.0


def test_a_batch_runs_its_sequences_together_until_the_longest_ends():
    short = (PROMPT, FRESH[:11])  # 10 tokens after the first
    seqs = [(PROMPT, FRESH), short]
    got = replay(seqs, 2, config(False), (2.0, 1.0))
    assert got["decode_steps"] == 39 and got["tokens"] == 39 + 10
    assert got["tokens_per_sequence_step"] == 1.0  # 49 tokens in 49 sequence steps, no drafts
    # plain: 10 steps of 2 rows (4 ms), 29 of one (3 ms); the same steps with no drafts
    assert got["modelled_speedup"] == 1.0
    copied = replay([(PROMPT, COPY), short], 2, config(True), (2.0, 0.25))
    assert copied["tokens"] == 49 and copied["decode_steps"] < 39 and copied["accepted_tokens"]
    assert copied["modelled_speedup"] > 1.0


def test_the_ceiling_verifies_the_best_of_all_matches_where_the_proposer_takes_the_latest():
    """The bigram (1, 2) occurs twice in the prompt: first followed by what the output goes on
    to say (3 4 5 6), last by 50-53. The engine's proposer drafts after the most recent match
    and has every draft rejected, then copies 3 tokens from a 3-gram match: 6 tokens in 3 steps.
    The ceiling takes the earlier match's 4 drafts: 6 tokens in 2 steps (the prefill's token
    not counted, no draft in the first step: its last token's earlier matches are 1-grams)."""
    prompt = [10, 1, 2, 3, 4, 5, 6, 11, 1, 2, 50, 51, 52, 53, 12]
    out = [1, 2, 3, 4, 5, 6, 13]
    forced = replay([(prompt, out)], 1, config(False), (1.0, 0.0))
    assert forced["tokens"] == 6 and forced["decode_steps"] == 3
    assert lookup_ceiling([(prompt, out)], 4, 2, 5) == 3.0
    # k bounds each step's run; the recorded end bounds the last one
    assert lookup_ceiling([(prompt, out)], 2, 2, 5) == round(6 / 3, 3)  # 1, then 3 and 2
    # where the proposer's choice is the only match, the ceiling is the forced replay's figure
    assert lookup_ceiling([(PROMPT, COPY)], 4, 2, 5) == round(39 / 9, 3)
    assert lookup_ceiling([(PROMPT, FRESH)], 4, 2, 5) == 1.0


def test_script_reads_recorded_outputs_and_prints_json(tmp_path):
    recorded = tmp_path / "outputs.json"
    recorded.write_text(json.dumps({"summarize": [[PROMPT, COPY], [PROMPT, FRESH]]}))
    proc = run_script(
        "bench_spec_replay", tmp_path, "--tasks", "summarize", "--batches", "1,2",
        "--outputs", str(recorded), "--cost", "1,0", cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert report["bench"] == "spec_replay" and report["cost_ms"] == {"a": 1.0, "b": 0.0}
    assert report["prompt_lookup"] == [2, 5]
    assert report["lookup_ceiling_tokens_per_sequence_step"] == {"summarize": round(78 / 48, 3)}
    assert report["cpu"]["cores"] >= 1
    cells = {c["batch"]: c for c in report["cells"]}
    assert set(cells) == {1, 2} and cells[1]["sequences"] == 2
    forced = cells[1]["forced"]
    assert forced["tokens"] == 78 and forced["decode_steps"] == 9 + 39
    assert forced["modelled_speedup"] == round(78 / 48, 3)
