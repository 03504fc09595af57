"""`scripts/bench_spec.py --paths stack`: speculation off / adaptive / forced and the A/A control
through real stacks (`laneserve up` each, the bundled model), the cells' figures read back from the
streams and from the `requests` table, the modes' order rotating from round to round (slow)."""

from __future__ import annotations

import json
import statistics

import pytest

from tests.harness import load_script, run_script

merge_rounds = load_script("bench_spec").merge_rounds


@pytest.mark.slow
def test_stack_cells_report_each_mode_from_the_streams_and_the_table(smollm2_gguf, tmp_path):
    proc = run_script(
        "bench_spec",
        smollm2_gguf.parent.parent,
        "--paths", "stack", "--tasks", "summarize", "--batches", "1,2",
        "--batch1-prompts", "1", "--max-tokens", "16", "--forced", "--control",
        "--rounds", "2", "--fresh-profiles",
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["step_cost_cache"] is False
    for mode in ("off", "adaptive", "forced", "control"):  # each stack's derived targets
        for when in ("start", "end"):
            got = report["stack_slo_targets"][mode][when]
            assert got["ttft_ms"] > 0 and got["tpot_ms"] > 0, (mode, when, got)
    cells = report["cells"]
    assert [(c["path"], c["task"], c["batch"], c["prompts"], c["rounds"]) for c in cells] == [
        ("stack", "summarize", 1, 1, 2),
        ("stack", "summarize", 2, 2, 2),
    ]
    forced_drafts = 0
    for cell in cells:
        for mode in ("off", "adaptive", "forced", "control"):
            fig = cell[mode]
            # every request's row was recorded, every stream produced tokens
            assert fig["server_rows"] == 2 * cell["prompts"], (mode, fig)
            assert 0 < fig["tokens"] <= 2 * 16 * cell["prompts"], (mode, fig)
            assert fig["tok_s"] == pytest.approx(fig["tokens"] / fig["seconds"], rel=0.01)
            assert fig["tpot_ms"] > 0 and fig["server_tpot_ms"] > 0, (mode, fig)
            assert 0 <= fig["accepted_tokens"] <= fig["draft_tokens"], (mode, fig)
            # the table's verifications (spec_num_drafts): each carried 1..k (4) drafts
            v = fig["verifications"]
            assert v <= fig["draft_tokens"] <= 4 * v, (mode, fig)
            if v:
                assert fig["mean_accepted_length"] == round(1 + fig["accepted_tokens"] / v, 3)
            else:
                assert fig["mean_accepted_length"] is None, (mode, fig)
        assert cell["off"]["draft_tokens"] == cell["control"]["draft_tokens"] == 0
        forced_drafts += cell["forced"]["draft_tokens"]
        for mode in ("adaptive", "forced", "control"):
            fig = cell[mode]
            assert len(fig["speedup_per_round"]) == 2
            assert fig["speedup_tok_s"] == pytest.approx(
                statistics.median(fig["speedup_per_round"]), abs=2e-3
            )
            assert isinstance(fig["identical_to_off"], bool)
    # a summary copies its document: drafting every step finds something to verify
    assert forced_drafts > 0, cells
    # round r starts at the r-th mode: off does not always run first
    firsts = [line.split(": ")[0] for line in proc.stderr.splitlines() if " round " in line]
    assert firsts[:8] == [
        f"stack summarize B=1 round {r}/2 {m}"
        for r, order in ((1, "off adaptive forced control"), (2, "adaptive forced control off"))
        for m in order.split()
    ], firsts
    assert report["cpu"]["simd_flags"] is not None


def _fig(tokens: int, seconds: float, tpot: float, drafts: int = 0, accepted: int = 0, out=(1,)):
    return {
        "tokens": tokens, "seconds": seconds, "tok_s": round(tokens / seconds, 2),
        "tpot_ms": tpot, "draft_tokens": drafts, "accepted_tokens": accepted,
        "verifications": drafts // 2, "_outputs": [list(out)],
    }  # fmt: skip


def test_rounds_merge_into_sums_medians_and_per_round_ratios():
    rounds = [
        {"off": _fig(100, 1.0, 10.0), "adaptive": _fig(100, 0.5, 5.0, 8, 6)},
        {"off": _fig(100, 2.0, 20.0), "adaptive": _fig(100, 2.5, 25.0, 4, 1)},
        {"off": _fig(100, 1.0, 10.0), "adaptive": _fig(100, 0.8, 8.0, 4, 3, out=(2,))},
    ]
    merged = merge_rounds(rounds, ["off", "adaptive"])
    off, ada = merged["off"], merged["adaptive"]
    assert (off["tokens"], off["seconds"], off["tok_s"], off["tpot_ms"]) == (300, 4.0, 75.0, 10.0)
    assert "speedup_tok_s" not in off and off["acceptance_rate"] is None
    # per-round speedups 2.0 / 0.8 / 1.25: the median, not the ratio of the sums (300/3.8 / 75)
    assert ada["speedup_per_round"] == [2.0, 0.8, 1.25] and ada["speedup_tok_s"] == 1.25
    assert ada["tok_s"] == round(300 / 3.8, 2) and ada["tpot_ms"] == 8.0
    assert ada["tpot_ratio"] == 0.8  # ratios 0.5 / 1.25 / 0.8
    assert (ada["draft_tokens"], ada["accepted_tokens"], ada["acceptance_rate"]) == (16, 10, 0.625)
    assert ada["mean_accepted_length"] == round(1 + 10 / 8, 3)
    assert ada["identical_to_off"] is False  # the third round's outputs differ
    assert merge_rounds(rounds[:2], ["off", "adaptive"])["adaptive"]["identical_to_off"] is True


def test_batch_one_prompts_are_rounds_of_their_own_all_distinct():
    import argparse

    plan = load_script("bench_spec").plan
    args = argparse.Namespace(tasks="summarize", batches="1,8", batch1_prompts=4, rounds=3)
    (t1, b1, one), (t8, b8, eight) = plan(args)
    assert (t1, b1, len(one), {len(r) for r in one}) == ("summarize", 1, 12, {1})
    assert (t8, b8, len(eight), {len(r) for r in eight}) == ("summarize", 8, 3, {8})
    prompts = [json.dumps(conv) for cell in (one, eight) for r in cell for conv in r]
    assert len(set(prompts)) == len(prompts) == 12 + 24
