"""`scripts/bench_spec.py --paths stack`: speculation off / adaptive / forced through real stacks
(`laneserve up` each, the bundled model), the cells' figures read back from the streams and from
the `requests` table (slow, one round). Fast, without stacks: the rounds' merge, the modes' order
rotating from round to round (`run_cells` on stand-in runners) and the batch-1 plan.

`--control` (a second `off` stack) and `--fresh-profiles` (`LANESERVE_STEP_COST_CACHE=0`) add no
code path of their own to the stack run: `control` is one more mode configured as `off`, and a
fresh profile is the worker's start-up profile, whose cache is tested in
tests/engine/test_engine_step_cost_cache.py."""

from __future__ import annotations

import argparse
import json

import pytest

from tests.harness import load_script, run_script

_bench = load_script("bench_spec")
merge_rounds = _bench.merge_rounds


@pytest.mark.slow
def test_stack_cells_report_each_mode_from_the_streams_and_the_table(smollm2_gguf, tmp_path):
    proc = run_script(
        "bench_spec",
        smollm2_gguf.parent.parent,
        "--paths", "stack", "--tasks", "summarize", "--batches", "1,2",
        "--batch1-prompts", "1", "--max-tokens", "16", "--forced",
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["step_cost_cache"] is True and report["rounds"] == 1
    for mode in ("off", "adaptive", "forced"):  # each stack's derived targets
        for when in ("start", "end"):
            got = report["stack_slo_targets"][mode][when]
            assert got["ttft_ms"] > 0 and got["tpot_ms"] > 0, (mode, when, got)
    cells = report["cells"]
    assert [(c["path"], c["task"], c["batch"], c["prompts"], c["rounds"]) for c in cells] == [
        ("stack", "summarize", 1, 1, 1),
        ("stack", "summarize", 2, 2, 1),
    ]
    forced_drafts = 0
    for cell in cells:
        for mode in ("off", "adaptive", "forced"):
            fig = cell[mode]
            # every request's row was recorded, every stream produced tokens
            assert fig["server_rows"] == cell["prompts"], (mode, fig)
            assert 0 < fig["tokens"] <= 16 * cell["prompts"], (mode, fig)
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
        assert cell["off"]["draft_tokens"] == 0
        forced_drafts += cell["forced"]["draft_tokens"]
        for mode in ("adaptive", "forced"):
            fig = cell[mode]
            assert fig["speedup_per_round"] == [fig["speedup_tok_s"]]
            assert fig["speedup_tok_s"] == pytest.approx(
                fig["tok_s"] / cell["off"]["tok_s"], abs=2e-3
            )
            assert isinstance(fig["identical_to_off"], bool)
    # a summary copies its document: drafting every step finds something to verify
    assert forced_drafts > 0, cells
    firsts = [line.split(": ")[0] for line in proc.stderr.splitlines() if " round " in line]
    assert firsts == [
        f"stack summarize B={b} round 1/1 {m}"
        for b in (1, 2)
        for m in ("off", "adaptive", "forced")
    ], firsts
    assert report["cpu"]["simd_flags"] is not None


def test_round_r_starts_at_the_rth_mode_and_merges_every_round(capsys):
    """`run_cells` on stand-in runners: within a round the modes interleave, round r starting at
    the r-th mode (off does not always run first), and each cell's rounds are merged."""
    calls = []

    def runner(name: str, tok_s: float):
        def run(convs, batch):
            calls.append((name, len(convs), batch))
            return {"tokens": 10, "seconds": 10 / tok_s, "tok_s": tok_s, "tpot_ms": 1.0,
                    "draft_tokens": 0, "accepted_tokens": 0, "_outputs": [name == "off"]}  # fmt: skip

        return run

    runners = {"off": runner("off", 10.0), "adaptive": runner("adaptive", 20.0),
               "control": runner("control", 10.0)}  # fmt: skip
    args = argparse.Namespace(tasks="summarize", batches="2", batch1_prompts=1, rounds=3)
    (cell,) = _bench.run_cells("stack", runners, args)
    assert [name for name, _, _ in calls] == [
        "off", "adaptive", "control", "adaptive", "control", "off", "control", "off", "adaptive"
    ]  # fmt: skip
    assert {(n, b) for _, n, b in calls} == {(2, 2)}
    assert (cell["batch"], cell["prompts"], cell["rounds"]) == (2, 2, 3)
    assert cell["adaptive"]["speedup_per_round"] == [2.0] * 3
    assert cell["control"]["speedup_tok_s"] == 1.0 and cell["off"]["tokens"] == 30
    assert cell["control"]["identical_to_off"] is False
    assert "stack summarize B=2 round 3/3 control" in capsys.readouterr().err


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
