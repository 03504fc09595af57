"""`scripts/bench_lanes.py`: the phases on a fresh stack and the ratios from their figures (a real
one-round run on the bundled model, slow); how several rounds merge into the medians of each
round's own ratios (fast: `merge_rounds` is the only code a second round adds, so the real run
keeps to one round)."""

from __future__ import annotations

import json

import pytest

from tests.harness import load_script, run_script

_bench = load_script("bench_lanes")
RATIOS = (
    "lanes_ttft_p99_over_idle_p50",
    "lanes_tpot_p99_over_idle_p50",
    "batch_with_interactive_over_alone",
    "batch_total_with_interactive_over_alone",
)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_one_round_reports_the_phases_and_their_ratios(smollm2_gguf, tmp_path):
    proc = run_script(
        "bench_lanes",
        smollm2_gguf.parent.parent,
        "--model", str(smollm2_gguf),
        "--phases", "idle,lanes,batch_alone",
        "--interactive", "3",
        "--rate", "2",
        "--output-tokens", "4",
        "--bulk-lines", "48",
        "--bulk-tokens", "8",
        "--batch-warmup-lines", "2",
        "--max-num-seqs", "8",
        "--out", str(tmp_path),
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["config"]["rounds"] == 1
    assert "round 1/1, variant default" in proc.stderr
    entry = report["variants"]["default"]
    phases = entry["phases"]
    assert phases["idle"]["client"]["errors"] == 0
    assert phases["lanes"]["client"]["errors"] == 0
    assert phases["batch_alone"]["batch_tok_s"] > 0
    for phase in ("lanes", "batch_alone"):  # prompt positions computed + output tokens
        assert phases[phase]["batch_total_tok_s"] > phases[phase]["batch_tok_s"], phases[phase]
    for key in RATIOS:
        assert entry["ratios"][key] is not None and entry["ratios"][key] > 0, (key, entry)
    # the ratios are the phases' figures
    idle, lanes = phases["idle"]["client"], phases["lanes"]["client"]
    assert entry["ratios"]["lanes_ttft_p99_over_idle_p50"] == round(
        lanes["ttft_ms"]["p99"] / idle["ttft_ms"]["p50"], 2
    )
    assert report["side_by_side"]["default"]["target_met"] == entry["target_met"]
    assert report["phases"] == phases and (tmp_path / "bench_lanes.png").exists()
    # the same round twice: the same ratios as medians, each round's beside them
    twice = _bench.merge_rounds([entry, entry])
    assert (
        twice["ratios_per_round"]["lanes_ttft_p99_over_idle_p50"]
        == [entry["ratios"]["lanes_ttft_p99_over_idle_p50"]] * 2
    )
    assert twice["rounds_met"] in (0, 2) and twice["per_round"] == [phases, phases]


def _round(ttft: float, tpot: float, batch: float | None) -> dict:
    ratios = {
        "lanes_ttft_p99_over_idle_p50": ttft,
        "lanes_tpot_p99_over_idle_p50": tpot,
        "fifo_ttft_p99_over_idle_p50": None,
        "fifo_tpot_p99_over_idle_p50": None,
        "batch_with_interactive_over_alone": batch,
    }
    return {"phases": {"ttft": ttft}, "ratios": ratios, "target_met": _bench.targets_met(ratios)}


def test_rounds_merge_into_medians_judged_on_their_own():
    rounds = [_round(1.2, 1.6, 0.8), _round(2.4, 1.2, 0.6), _round(1.4, 1.3, None)]
    assert [r["target_met"] for r in rounds] == [False, False, False]
    merged = _bench.merge_rounds(rounds)
    assert merged["ratios"]["lanes_ttft_p99_over_idle_p50"] == 1.4
    assert merged["ratios"]["lanes_tpot_p99_over_idle_p50"] == 1.3
    assert merged["ratios"]["batch_with_interactive_over_alone"] == 0.7  # of the rounds with one
    assert merged["ratios"]["fifo_ttft_p99_over_idle_p50"] is None
    assert merged["ratios_per_round"]["batch_with_interactive_over_alone"] == [0.8, 0.6, None]
    assert merged["target_met"] is True and merged["rounds_met"] == 0
    assert merged["phases"] == {"ttft": 1.2} and len(merged["per_round"]) == 3
    assert _bench.merge_rounds(rounds[:1]) == rounds[0]
    assert _bench.merge_rounds([_round(1.0, 1.0, 0.9), _round(1.0, 1.6, 0.9)])["rounds_met"] == 1
