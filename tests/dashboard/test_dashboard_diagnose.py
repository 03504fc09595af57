"""diagnose.py: each row of DESIGN.md's symptom table fires on synthetic figures; healthy is quiet."""

from __future__ import annotations

import dataclasses

import pytest

from dashboard.diagnose import Figures, Symptom, Thresholds, diagnose, diagnose_all

# A healthy interactive lane: latencies as in the baseline, no queue, KV half used.
HEALTHY = Figures(
    lane="interactive",
    requests=200,
    ttft_p99_ms=180.0,
    ttft_p99_baseline_ms=170.0,
    tpot_p50_ms=20.0,
    tpot_p99_ms=28.0,
    tpot_p99_baseline_ms=27.0,
    itl_p99_ms=35.0,
    queue_p99_ms=10.0,
    prefill_p99_ms=150.0,
    waiting_now=0.0,
    waiting_before=0.0,
    running_max=12.0,
    kv_usage_max=0.6,
    prefix_hit_rate=0.7,
    preemptions=0,
    timeouts=0,
    prompt_tokens_p50=300.0,
    tokens_per_s=900.0,
    tokens_per_s_baseline=880.0,
)


def _symptoms(f: Figures, t: Thresholds | None = None) -> list[Symptom]:
    return [x.symptom for x in diagnose(f, t)]


def test_healthy_is_quiet():
    assert diagnose(HEALTHY) == []
    assert diagnose_all([HEALTHY, dataclasses.replace(HEALTHY, lane="batch")]) == []


def test_empty_figures_are_quiet():
    assert diagnose(Figures(lane="interactive")) == []


def test_ttft_up_tpot_flat_queue_growing_says_queueing():
    f = dataclasses.replace(
        HEALTHY, ttft_p99_ms=2400.0, queue_p99_ms=2100.0, waiting_now=40.0, waiting_before=3.0
    )
    findings = diagnose(f)
    assert [x.symptom for x in findings] == [Symptom.TTFT_HIGH]
    assert "queueing: add workers or route batch elsewhere" in findings[0].advice
    assert findings[0].check == "queue depth, prefill batch size, prefix hit rate"
    assert findings[0].evidence["waiting_now"] == 40.0


def test_ttft_up_with_prefix_misses_names_the_cache():
    f = dataclasses.replace(HEALTHY, ttft_p99_ms=900.0, prefill_p99_ms=850.0, prefix_hit_rate=0.05)
    findings = diagnose(f)
    assert [x.symptom for x in findings] == [Symptom.TTFT_HIGH]
    assert "prefix cache misses" in findings[0].advice


def test_ttft_up_otherwise_is_big_prefill_batches():
    f = dataclasses.replace(HEALTHY, ttft_p99_ms=900.0, prefill_p99_ms=850.0)
    assert "big prefill batches" in diagnose(f)[0].advice


def test_tpot_jitter_with_normal_ttft():
    f = dataclasses.replace(HEALTHY, itl_p99_ms=160.0)
    findings = diagnose(f)
    assert [x.symptom for x in findings] == [Symptom.TPOT_JITTER]
    assert findings[0].check == "chunk size / token budget"


def test_ttft_and_tpot_both_worse_points_at_kv():
    f = dataclasses.replace(
        HEALTHY, ttft_p99_ms=800.0, tpot_p99_ms=90.0, kv_usage_max=0.97, preemptions=14
    )
    findings = diagnose(f)
    assert [x.symptom for x in findings] == [Symptom.BOTH_WORSE]
    assert findings[0].check == "KV usage, preemptions"
    assert findings[0].evidence["preemptions"] == 14


def test_kv_full_with_preemptions_alone_is_reported():
    f = dataclasses.replace(HEALTHY, kv_usage_max=0.95, preemptions=3)
    assert _symptoms(f) == [Symptom.BOTH_WORSE]


def test_long_prompts_time_out():
    f = dataclasses.replace(HEALTHY, timeouts=4, timeout_prompt_tokens_p50=3800.0)
    findings = diagnose(f)
    assert [x.symptom for x in findings] == [Symptom.LONG_PROMPT_TIMEOUTS]
    assert findings[0].check == "max input length, memory headroom"


def test_timeouts_of_ordinary_prompts_are_not_blamed_on_length():
    f = dataclasses.replace(HEALTHY, timeouts=4, timeout_prompt_tokens_p50=310.0)
    assert diagnose(f) == []


def test_throughput_flat_memory_not_full():
    f = dataclasses.replace(
        HEALTHY, waiting_now=25.0, waiting_before=25.0, kv_usage_max=0.2, tokens_per_s=870.0
    )
    findings = diagnose(f)
    assert [x.symptom for x in findings] == [Symptom.THROUGHPUT_FLAT]
    assert "max_num_seqs" in findings[0].check


def test_throughput_still_rising_is_not_flat():
    f = dataclasses.replace(HEALTHY, waiting_now=25.0, kv_usage_max=0.2, tokens_per_s=1500.0)
    assert diagnose(f) == []


def test_too_few_requests_mutes_latency_rules():
    f = dataclasses.replace(HEALTHY, requests=2, ttft_p99_ms=5000.0, itl_p99_ms=500.0)
    assert diagnose(f) == []


def test_small_absolute_change_is_noise():
    # 3x the baseline, but only 20 ms more: below the TTFT floor.
    f = dataclasses.replace(HEALTHY, ttft_p99_ms=30.0, ttft_p99_baseline_ms=10.0)
    assert diagnose(f) == []


def test_slo_counts_as_high_without_baseline():
    f = dataclasses.replace(HEALTHY, ttft_p99_baseline_ms=None, ttft_p99_ms=1500.0)
    assert diagnose(f) == []
    assert _symptoms(f, Thresholds(ttft_slo_ms=1000.0)) == [Symptom.TTFT_HIGH]


def test_rejects_wrong_type():
    with pytest.raises(TypeError, match="Figures"):
        diagnose({"lane": "interactive"})  # type: ignore[arg-type]
