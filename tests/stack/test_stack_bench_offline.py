"""`scripts/bench_offline.py --peers ... --rounds N`: every engine N times round-robin, medians and
within-round ratios (a real two-round run of laneserve and transformers on the bundled model,
slow); how rounds with a failed engine merge (fast)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import pytest

from tests.harness import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
from bench_offline import FIGURES, merge_rounds  # noqa: E402


@pytest.mark.slow
def test_two_rounds_report_medians_and_within_round_ratios(smollm2_gguf, tmp_path):
    env = {**os.environ, "LANESERVE_HOME": str(smollm2_gguf.parent.parent)}
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "bench_offline.py"),
            "--model",
            str(smollm2_gguf),
            "--peers",
            "hf",
            "--rounds",
            "2",
            "--num-prompts",
            "2",
            "--max-tokens",
            "4",
            "--single-tokens",
            "4",
            "--peer-timeout",
            "300",
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["rounds"] == 2
    assert "round 2/2: hf-r2" in proc.stderr
    for name in ("laneserve", "hf"):
        entry = report["engines"][name]
        assert "skipped" not in entry, entry
        for key in FIGURES:
            values = entry["per_round"][key]
            assert len(values) == 2 and all(v > 0 for v in values), (name, key, values)
            assert entry[key] == round(statistics.median(values), 2)
        assert len(entry["per_round"]["cpu_steal_pct"]) == 2 and "cpu_steal_pct" not in entry
    ratio = report["ratios_laneserve_over_peer"]["hf"]
    lane, hf = report["engines"]["laneserve"]["per_round"], report["engines"]["hf"]["per_round"]
    for key in FIGURES:
        expected = [round(a / b, 2) for a, b in zip(lane[key], hf[key], strict=True)]
        assert ratio["per_round"][key] == expected
        assert ratio[key] == round(statistics.median(expected), 2)


def _entry(offline: float, single: float) -> dict:
    return {
        "offline_tok_s": offline,
        "single_stream_decode_tok_s": single,
        "cold_start_s": 5.0,
        "warm_start_s": 4.0,
        "name": "x",
    }


def test_rounds_merge_around_a_failed_engine():
    rounds = [
        {"laneserve": _entry(200, 100), "a": _entry(100, 50), "b": {"skipped": "not installed"}},
        {"laneserve": _entry(100, 80), "a": {"skipped": "a failed: crash"}, "b": {"skipped": "x"}},
        {"laneserve": _entry(600, 90), "a": _entry(100, 30), "b": {"skipped": "x"}},
    ]
    engines, ratios = merge_rounds(rounds)
    assert engines["laneserve"]["offline_tok_s"] == 200  # the median, not the mean (300)
    assert engines["laneserve"]["per_round"]["single_stream_decode_tok_s"] == [100, 80, 90]
    assert engines["a"]["per_round"]["offline_tok_s"] == [100, 100]  # its two good rounds
    assert engines["b"] == {"skipped": "not installed"}
    # ratios only from the rounds where both ran: 200/100 and 600/100; 100/50 and 90/30
    assert ratios["a"]["per_round"]["offline_tok_s"] == [2.0, 6.0]
    assert ratios["a"]["offline_tok_s"] == 4.0
    assert ratios["a"]["single_stream_decode_tok_s"] == 2.5
    assert "b" not in ratios
    one, one_ratios = merge_rounds(rounds[:1])
    assert one is rounds[0] and one_ratios == {
        "a": {k: 2.0 if "tok" in k else 1.0 for k in FIGURES}
    }
