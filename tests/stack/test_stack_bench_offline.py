"""`scripts/bench_offline.py --peers ...`: a real one-round run of laneserve and transformers on
the bundled model reports every figure of both engines and their ratios (slow); how several rounds,
some with a failed engine, merge into medians and within-round ratios (fast: `merge_rounds` is the
only code a second round adds, so the real run keeps to one round)."""

from __future__ import annotations

import json

import pytest

from tests.harness import load_script, run_script

_bench = load_script("bench_offline")
FIGURES, merge_rounds = _bench.FIGURES, _bench.merge_rounds


@pytest.mark.slow
def test_one_round_reports_each_engine_and_its_ratio_to_the_peer(smollm2_gguf, tmp_path):
    proc = run_script(
        "bench_offline",
        smollm2_gguf.parent.parent,
        "--model", str(smollm2_gguf),
        "--peers", "hf",
        "--num-prompts", "2",
        "--max-tokens", "4",
        "--single-tokens", "4",
        "--peer-timeout", "300",
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["rounds"] == 1
    assert "round 1/1: hf" in proc.stderr
    engines = report["engines"]
    for name in ("laneserve", "hf"):
        entry = engines[name]
        assert "skipped" not in entry, entry
        assert all(entry[key] > 0 for key in FIGURES), (name, entry)
        assert "cpu_steal_pct" in entry and "per_round" not in entry
        assert entry["peak_rss_mib"] > 100  # the worker's VmHWM: torch and a model at least
    shares = report["bandwidth"]["single_stream_share"]  # tok/s x step bytes / measured GB/s
    assert report["bandwidth"]["read_gb_s"] > 0 and set(shares) == {"laneserve", "hf"}
    ratio = report["ratios_laneserve_over_peer"]["hf"]
    lane, hf = engines["laneserve"], engines["hf"]
    assert ratio == {key: round(lane[key] / hf[key], 2) for key in FIGURES}
    # the same round twice merges into the same figures, now with every round's values beside
    twice, twice_ratios = merge_rounds([engines, engines])
    for key in FIGURES:
        assert twice["hf"]["per_round"][key] == [hf[key]] * 2
        assert twice_ratios["hf"]["per_round"][key] == [ratio[key]] * 2


def _entry(offline: float, single: float, cold: float = 5.0, warm: float | None = 4.0) -> dict:
    return {
        "offline_tok_s": offline,
        "single_stream_decode_tok_s": single,
        "cold_start_s": cold,
        "warm_start_s": warm,
        "offline_s": 64 * 64 / offline,
        "cpu_steal_pct": 1.0,
        "name": "x",
    }


def test_rounds_merge_around_failed_engines_and_missing_figures():
    rounds = [
        {"laneserve": _entry(200, 100, cold=9), "a": _entry(100, 50), "b": {"skipped": "absent"}},
        {"laneserve": _entry(100, 80), "a": {"skipped": "a failed: crash"}, "b": {"skipped": "x"}},
        {"laneserve": _entry(600, 90, warm=None), "a": _entry(100, 30), "b": {"skipped": "x"}},
        {"laneserve": {"skipped": "laneserve failed"}, "a": _entry(50, 10), "b": {"skipped": "x"}},
    ]
    engines, ratios = merge_rounds(rounds)
    lane = engines["laneserve"]
    assert lane["offline_tok_s"] == 200  # the median of 200, 100, 600, not the mean (300)
    assert lane["per_round"]["single_stream_decode_tok_s"] == [100, 80, 90, None]
    assert lane["offline_s"] == round(64 * 64 / 200, 2)  # every timed field: its median
    assert lane["warm_start_s"] == 4.0  # the rounds that have one
    assert lane["cold_start_s"] == 9  # the first round's: the only really cold start
    assert lane["per_round"]["cpu_steal_pct"] == [1.0, 1.0, 1.0, None]
    assert "cpu_steal_pct" not in lane
    assert engines["a"]["per_round"]["offline_tok_s"] == [100, None, 100, 50]  # index = round
    assert engines["a"]["offline_tok_s"] == 100
    assert engines["b"] == {"skipped": "absent"}
    # ratios only from the rounds where both ran: 200/100 and 600/100; 100/50 and 90/30
    a = ratios["a"]
    assert a["per_round"]["offline_tok_s"] == [2.0, None, 6.0, None]
    assert a["offline_tok_s"] == 4.0 and a["single_stream_decode_tok_s"] == 2.5
    assert a["per_round"]["warm_start_s"] == [1.0, None, None, None] and a["warm_start_s"] == 1.0
    assert a["cold_start_s"] == 1.8  # round 1's: 9 / 5
    assert "b" not in ratios
    one, one_ratios = merge_rounds(rounds[:1])
    assert one is rounds[0]
    assert one_ratios == {
        "a": {"offline_tok_s": 2.0, "single_stream_decode_tok_s": 2.0, "cold_start_s": 1.8,
              "warm_start_s": 1.0}
    }  # fmt: skip
