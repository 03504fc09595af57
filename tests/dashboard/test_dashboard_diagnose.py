"""diagnose.py on hand-made figures: each rule fires only with its evidence; healthy is quiet.

The same rules on recorded SQL traffic are in test_dashboard_diagnosis_cases.py."""

from __future__ import annotations

import dataclasses

import pytest

from laneserve.dashboard.diagnose import (
    Cause,
    Figures,
    JobEta,
    Symptom,
    Thresholds,
    diagnose,
    diagnose_all,
)

# A healthy interactive lane: latencies as in the baseline, no queue, KV half used.
HEALTHY = Figures(
    lane="interactive",
    requests=200,
    baseline_requests=800,
    ttft_p99_ms=180.0,
    ttft_p99_baseline_ms=170.0,
    tpot_p50_ms=20.0,
    tpot_p99_ms=28.0,
    tpot_p99_baseline_ms=27.0,
    itl_p99_ms=35.0,
    queue_p99_ms=10.0,
    prefill_p99_ms=150.0,
    queue_share=0.05,
    prefill_share=0.9,
    preempted_share=0.0,
    cached_share=0.5,
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


def _causes(f: Figures, t: Thresholds | None = None) -> list[Cause]:
    return [x.cause for x in diagnose(f, t)]


def test_healthy_is_quiet():
    assert diagnose(HEALTHY) == []
    assert diagnose_all([HEALTHY, dataclasses.replace(HEALTHY, lane="batch")]) == []


def test_empty_figures_are_quiet():
    assert diagnose(Figures(lane="interactive")) == []


def test_ttft_up_queue_dominating_says_queueing():
    f = dataclasses.replace(HEALTHY, ttft_p99_ms=2400.0, queue_p99_ms=2100.0, queue_share=0.9,
                            prefill_share=0.08, waiting_now=40.0, waiting_before=3.0)  # fmt: skip
    (finding,) = diagnose(f)
    assert (finding.symptom, finding.cause) == (Symptom.TTFT_HIGH, Cause.QUEUEING)
    assert finding.share == 0.9 and not finding.by_design
    assert finding.evidence["waiting_now"] == 40.0
    assert "TTFT P99 2,400 ms (limit 1,000 ms)" == finding.observed


def test_baseline_comparison_needs_enough_baseline_requests():
    f = dataclasses.replace(HEALTHY, ttft_p99_ms=600.0, queue_share=0.8, prefill_share=0.15)
    assert _causes(f) == [Cause.QUEUEING]  # 3.5x the baseline
    assert diagnose(dataclasses.replace(f, baseline_requests=5)) == []  # and under the limit


def test_kv_needs_its_evidence_the_misdiagnosis_case():
    """Batch TTFT and TPOT worse with KV at 5 % and no preemption, queue ~ all of TTFT, while
    interactive traffic runs: queueing behind interactive (by design), never KV."""
    f = dataclasses.replace(
        HEALTHY, lane="batch", ttft_p99_ms=36000.0, ttft_p99_baseline_ms=400.0,
        tpot_p99_ms=70.0, tpot_p99_baseline_ms=30.0, queue_share=0.99, prefill_share=0.01,
        kv_usage_max=0.05099, preemptions=0, interactive_requests=120,
        jobs=(JobEta("batch_x", eta_s=1800.0, window_left_s=86000.0),),
    )  # fmt: skip
    (finding,) = diagnose(f)
    assert finding.symptom is Symptom.BOTH_WORSE
    assert finding.cause is Cause.BATCH_BEHIND_INTERACTIVE and finding.by_design
    assert "job batch_x: ETA 30m00s, 23h53m left in its window" in finding.advice
    late = dataclasses.replace(f, jobs=(JobEta("batch_x", eta_s=90000.0, window_left_s=600.0),))
    (finding,) = diagnose(late)
    assert not finding.by_design and "will miss its window" in finding.advice


def test_batch_queueing_without_interactive_traffic_is_a_fault():
    f = dataclasses.replace(
        HEALTHY, lane="batch", ttft_p99_ms=36000.0, queue_share=0.99, prefill_share=0.01
    )
    (finding,) = diagnose(f)
    assert finding.cause is Cause.QUEUEING and not finding.by_design


def test_ttft_up_with_prefix_misses_names_the_cache():
    f = dataclasses.replace(HEALTHY, ttft_p99_ms=1900.0, prefill_p99_ms=1850.0, cached_share=0.05)
    assert _causes(f) == [Cause.PREFIX_MISSES]


def test_ttft_up_otherwise_is_big_prefill_batches():
    f = dataclasses.replace(HEALTHY, ttft_p99_ms=1900.0, prefill_p99_ms=1850.0)
    (finding,) = diagnose(f)
    assert finding.cause is Cause.BIG_PREFILLS and finding.share == 0.9


def test_causes_are_ranked_by_share_explained():
    f = dataclasses.replace(HEALTHY, ttft_p99_ms=3000.0, queue_share=0.6, prefill_share=0.35,
                            kv_usage_max=0.95, preempted_share=0.2)  # fmt: skip
    found = diagnose(f)
    assert [x.cause for x in found] == [Cause.QUEUEING, Cause.KV_FULL]
    assert [x.share for x in found] == [0.6, 0.2]


def test_symptom_without_evidence_says_cause_not_identified():
    f = dataclasses.replace(HEALTHY, tpot_p99_ms=300.0)  # TPOT only, KV free, no preemption
    (finding,) = diagnose(f)
    assert (finding.symptom, finding.cause) == (Symptom.TPOT_HIGH, Cause.UNKNOWN)


def test_tpot_jitter_needs_chunked_or_long_prefills():
    f = dataclasses.replace(HEALTHY, itl_p99_ms=160.0)
    assert _causes(f) == [Cause.UNKNOWN]
    (finding,) = diagnose(dataclasses.replace(f, chunked_prefills=12))
    assert (finding.symptom, finding.cause) == (Symptom.TPOT_JITTER, Cause.CHUNKS_STEAL_DECODE)
    assert finding.share == pytest.approx((160 - 20) / 160)
    assert _causes(dataclasses.replace(f, prompt_tokens_max=2048.0)) == [Cause.CHUNKS_STEAL_DECODE]


def test_kv_full_with_preemptions_worsening_both():
    f = dataclasses.replace(HEALTHY, ttft_p99_ms=1800.0, tpot_p99_ms=190.0, kv_usage_max=0.97,
                            preemptions=14, preempted_share=0.7, queue_share=0.4,
                            prefill_share=0.4)  # fmt: skip
    (finding,) = diagnose(f)
    assert (finding.symptom, finding.cause) == (Symptom.BOTH_WORSE, Cause.KV_FULL)
    assert finding.evidence["preemptions"] == 14 and finding.share == 0.7


def test_kv_full_without_a_latency_symptom_is_quiet():
    assert diagnose(dataclasses.replace(HEALTHY, kv_usage_max=0.95, preemptions=3)) == []


def test_long_prompts_time_out():
    f = dataclasses.replace(HEALTHY, timeouts=4, timeout_prompt_tokens_p50=3800.0)
    (finding,) = diagnose(f)
    assert finding.cause is Cause.LONG_PROMPTS
    assert finding.check == "max input length, memory headroom"


def test_timeouts_of_ordinary_prompts_are_not_blamed_on_length():
    assert diagnose(dataclasses.replace(HEALTHY, timeouts=4, timeout_prompt_tokens_p50=310.0)) == []


def test_throughput_flat_memory_not_full():
    f = dataclasses.replace(HEALTHY, waiting_now=25.0, waiting_min=20.0, kv_usage_max=0.2,
                            tokens_per_s=870.0)  # fmt: skip
    assert _causes(f) == [Cause.BATCH_CAP]
    assert diagnose(dataclasses.replace(f, waiting_min=0.0)) == []  # the queue drained once


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


def test_slo_target_replaces_the_default_limit():
    f = dataclasses.replace(
        HEALTHY, ttft_p99_baseline_ms=None, ttft_p99_ms=800.0, queue_share=0.8, prefill_share=0.1
    )
    assert diagnose(f) == []
    assert _causes(dataclasses.replace(f, ttft_target_ms=500.0)) == [Cause.QUEUEING]
    assert _causes(f, Thresholds(ttft_p99_ms={"interactive": 700.0})) == [Cause.QUEUEING]


def test_faults_come_before_by_design_notes():
    batch = dataclasses.replace(HEALTHY, lane="batch", ttft_p99_ms=36000.0, queue_share=0.99,
                                prefill_share=0.01, interactive_requests=50)  # fmt: skip
    inter = dataclasses.replace(HEALTHY, ttft_p99_ms=1900.0, prefill_p99_ms=1850.0)
    found = diagnose_all([batch, inter])
    assert [(x.lane, x.by_design) for x in found] == [("interactive", False), ("batch", True)]


def test_rejects_wrong_type():
    with pytest.raises(TypeError, match="Figures"):
        diagnose({"lane": "interactive"})  # type: ignore[arg-type]
