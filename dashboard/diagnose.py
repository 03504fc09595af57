"""Automatic diagnosis: the symptom table of DESIGN.md ("Dashboard") applied to live figures.

Pure functions, no database and no Streamlit: `dashboard.queries.live_figures` measures a `Figures`
for one lane, `diagnose(figures)` returns the `Finding`s that apply, and an empty list when the lane
is healthy (the panel stays quiet).

"High" and "worse" are relative: a latency is worse when its recent value exceeds `ratio` times the
same percentile over the earlier (baseline) part of the window *and* the difference is at least a
floor in ms, so that noise on a fast idle system triggers nothing. Optional absolute SLOs
(`Thresholds.ttft_slo_ms`, `Thresholds.tpot_slo_ms`) also count as "high" when set.

The symptom table (DESIGN.md):

| symptom                          | likely cause                                        | check |
|----------------------------------|-----------------------------------------------------|-------|
| TTFT high, TPOT normal           | queueing, big prefill batches, prefix cache misses  | queue depth, prefill batch size, prefix hit rate |
| TTFT normal, TPOT jitter         | prefill chunks stealing decode steps, chunk too big | chunk size / token budget |
| TTFT and TPOT both worse         | KV memory near full, preemption                     | KV usage, preemptions |
| long prompts time out            | activation peak, no per-request length limit        | max input length, memory headroom |
| throughput flat, memory not full | batch cap too low, KV fragmentation                 | max_num_seqs, block size |
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field


class Symptom(enum.StrEnum):
    """One row of DESIGN.md's symptom table."""

    TTFT_HIGH = "ttft_high_tpot_normal"
    TPOT_JITTER = "tpot_jitter"
    BOTH_WORSE = "ttft_and_tpot_worse"
    LONG_PROMPT_TIMEOUTS = "long_prompts_time_out"
    THROUGHPUT_FLAT = "throughput_flat_memory_not_full"


@dataclass(frozen=True, slots=True)
class Figures:
    """Live figures of one lane: the recent window and, where compared, the baseline before it.

    Durations are in ms (None when no request in that window has the value), `kv_usage` and
    `prefix_hit_rate` are fractions in [0, 1], gauges (`waiting_*`, `running_max`) are summed over
    the lane's workers from `worker_stats` snapshots, throughput is completion tokens per second.
    """

    lane: str
    requests: int = 0  # finished requests in the recent window
    ttft_p99_ms: float | None = None
    ttft_p99_baseline_ms: float | None = None
    tpot_p50_ms: float | None = None
    tpot_p99_ms: float | None = None
    tpot_p99_baseline_ms: float | None = None
    itl_p99_ms: float | None = None  # P90 over requests of each request's own itl_p99_ms
    queue_p99_ms: float | None = None
    prefill_p99_ms: float | None = None
    waiting_now: float | None = None  # latest snapshot, summed over workers
    waiting_before: float | None = None  # first snapshot of the recent window
    running_max: float | None = None
    kv_usage_max: float | None = None
    prefix_hit_rate: float | None = None
    preemptions: int = 0  # sum over the recent window's requests
    timeouts: int = 0  # requests ended by deadline_exceeded / timeout
    timeout_prompt_tokens_p50: float | None = None
    prompt_tokens_p50: float | None = None
    tokens_per_s: float | None = None
    tokens_per_s_baseline: float | None = None


@dataclass(frozen=True, slots=True)
class Thresholds:
    """When a figure counts as high; the defaults are rules of thumb, tune them per deployment."""

    ratio: float = 1.5  # recent percentile / baseline percentile that counts as "worse"
    ttft_floor_ms: float = 50.0  # ... and the difference must be at least this
    tpot_floor_ms: float = 5.0
    ttft_slo_ms: float | None = None  # absolute limits, off by default
    tpot_slo_ms: float | None = None
    jitter_ratio: float = 3.0  # ITL P99 / TPOT P50 above this is jitter
    min_requests: int = 5  # fewer finished requests than this -> no latency findings
    kv_full: float = 0.9  # KV usage at or above this is "near full"
    kv_low: float = 0.5  # below this memory is "not full"
    queue_share: float = 0.5  # queue P99 / TTFT P99 above this -> queueing dominates TTFT
    prefix_hit_low: float = 0.2
    long_prompt_ratio: float = 2.0  # timed-out prompts this much longer than the median prompt
    flat_ratio: float = 1.1  # throughput below baseline x this while demand waits is "flat"


@dataclass(frozen=True, slots=True)
class Finding:
    """One diagnosis: the symptom, what probably causes it, what to check, and the evidence."""

    lane: str
    symptom: Symptom
    cause: str
    check: str
    advice: str
    evidence: dict[str, float] = field(default_factory=dict)

    @property
    def title(self) -> str:
        return f"[{self.lane}] {self.symptom.value.replace('_', ' ')}"


def _worse(cur: float | None, base: float | None, floor: float, t: Thresholds) -> bool:
    if cur is None or base is None or not math.isfinite(cur) or not math.isfinite(base):
        return False
    return cur > t.ratio * base and cur - base >= floor


def _over(cur: float | None, slo: float | None) -> bool:
    return cur is not None and slo is not None and cur > slo


def ttft_high(f: Figures, t: Thresholds) -> bool:
    return _worse(f.ttft_p99_ms, f.ttft_p99_baseline_ms, t.ttft_floor_ms, t) or _over(
        f.ttft_p99_ms, t.ttft_slo_ms
    )


def tpot_high(f: Figures, t: Thresholds) -> bool:
    return _worse(f.tpot_p99_ms, f.tpot_p99_baseline_ms, t.tpot_floor_ms, t) or _over(
        f.tpot_p99_ms, t.tpot_slo_ms
    )


def tpot_jitter(f: Figures, t: Thresholds) -> bool:
    if f.itl_p99_ms is None or not f.tpot_p50_ms:
        return False
    return f.itl_p99_ms > t.jitter_ratio * f.tpot_p50_ms and f.itl_p99_ms - f.tpot_p50_ms >= (
        t.tpot_floor_ms
    )


def kv_pressure(f: Figures, t: Thresholds) -> bool:
    return f.kv_usage_max is not None and f.kv_usage_max >= t.kv_full and f.preemptions > 0


def queue_growing(f: Figures) -> bool:
    if f.waiting_now is None or f.waiting_now <= 0:
        return False
    return f.waiting_before is None or f.waiting_now > f.waiting_before


def _ttft_high_finding(f: Figures, t: Thresholds) -> Finding:
    ev = {"ttft_p99_ms": f.ttft_p99_ms, "ttft_p99_baseline_ms": f.ttft_p99_baseline_ms}
    queue_dominates = (
        f.queue_p99_ms is not None
        and f.ttft_p99_ms
        and f.queue_p99_ms / f.ttft_p99_ms > t.queue_share
    )
    if queue_dominates or queue_growing(f):
        ev |= {"queue_p99_ms": f.queue_p99_ms, "waiting_now": f.waiting_now}
        advice = (
            "queueing: add workers or route batch elsewhere "
            f"(waiting {f.waiting_before or 0:g} -> {f.waiting_now or 0:g})"
        )
    elif f.prefix_hit_rate is not None and f.prefix_hit_rate < t.prefix_hit_low:
        ev |= {"prefix_hit_rate": f.prefix_hit_rate}
        advice = (
            "prefix cache misses: share a common system prompt at the start of prompts, "
            "give the cache more KV blocks"
        )
    else:
        ev |= {"prefill_p99_ms": f.prefill_p99_ms}
        advice = (
            "big prefill batches: lower max_num_batched_tokens / the prefill chunk on "
            "interactive workers"
        )
    return Finding(
        f.lane,
        Symptom.TTFT_HIGH,
        cause="queueing, big prefill batches, prefix cache misses",
        check="queue depth, prefill batch size, prefix hit rate",
        advice=advice,
        evidence=_clean(ev),
    )


def _clean(ev: dict[str, float | None]) -> dict[str, float]:
    return {k: float(v) for k, v in ev.items() if v is not None}


def _latency_findings(f: Figures, t: Thresholds) -> list[Finding]:
    if f.requests < t.min_requests:
        return []
    ttft, tpot = ttft_high(f, t), tpot_high(f, t)
    out: list[Finding] = []
    if ttft and not tpot:
        out.append(_ttft_high_finding(f, t))
    if not ttft and tpot_jitter(f, t):
        out.append(
            Finding(
                f.lane,
                Symptom.TPOT_JITTER,
                cause="prefill chunks stealing decode steps, chunk too big",
                check="chunk size / token budget",
                advice=(
                    "lower long_prefill_token_threshold / max_num_batched_tokens on the workers "
                    "serving this lane (256-512 tokens for interactive)"
                ),
                evidence=_clean({"itl_p99_ms": f.itl_p99_ms, "tpot_p50_ms": f.tpot_p50_ms}),
            )
        )
    if (ttft and tpot) or kv_pressure(f, t):
        out.append(
            Finding(
                f.lane,
                Symptom.BOTH_WORSE,
                cause="KV memory near full, preemption",
                check="KV usage, preemptions",
                advice=(
                    "KV cache is the limit: give workers more KV memory (--kv-cache-memory), "
                    "lower max_num_seqs, or move batch traffic to other workers"
                ),
                evidence=_clean(
                    {
                        "ttft_p99_ms": f.ttft_p99_ms,
                        "tpot_p99_ms": f.tpot_p99_ms,
                        "kv_usage_max": f.kv_usage_max,
                        "preemptions": f.preemptions,
                    }
                ),
            )
        )
    return out


def _timeout_finding(f: Figures, t: Thresholds) -> list[Finding]:
    if f.timeouts <= 0 or f.timeout_prompt_tokens_p50 is None or not f.prompt_tokens_p50:
        return []
    if f.timeout_prompt_tokens_p50 < t.long_prompt_ratio * f.prompt_tokens_p50:
        return []
    return [
        Finding(
            f.lane,
            Symptom.LONG_PROMPT_TIMEOUTS,
            cause="activation peak, no per-request length limit",
            check="max input length, memory headroom",
            advice=(
                "cap the input length (max_model_len / edge validation) and keep memory headroom "
                "for the prefill activation peak; chunk long prefills"
            ),
            evidence=_clean(
                {
                    "timeouts": f.timeouts,
                    "timeout_prompt_tokens_p50": f.timeout_prompt_tokens_p50,
                    "prompt_tokens_p50": f.prompt_tokens_p50,
                }
            ),
        )
    ]


def _throughput_finding(f: Figures, t: Thresholds) -> list[Finding]:
    if not f.waiting_now or f.waiting_now <= 0 or f.kv_usage_max is None:
        return []
    if f.kv_usage_max >= t.kv_low:
        return []
    base = f.tokens_per_s_baseline
    if base is not None and f.tokens_per_s is not None and f.tokens_per_s > t.flat_ratio * base:
        return []  # throughput is still climbing with the load
    return [
        Finding(
            f.lane,
            Symptom.THROUGHPUT_FLAT,
            cause="batch cap too low, KV fragmentation",
            check="max_num_seqs, block size",
            advice=(
                "requests wait while KV memory is free: raise max_num_seqs "
                "(--max-num-seqs) or use a smaller block size"
            ),
            evidence=_clean(
                {
                    "waiting_now": f.waiting_now,
                    "kv_usage_max": f.kv_usage_max,
                    "running_max": f.running_max,
                    "tokens_per_s": f.tokens_per_s,
                    "tokens_per_s_baseline": base,
                }
            ),
        )
    ]


def diagnose(figures: Figures, thresholds: Thresholds | None = None) -> list[Finding]:
    """Apply the symptom table to one lane's figures.

    Returns:
        The findings, at most one per symptom, in table order; `[]` when healthy or when there is
        too little traffic to judge latencies (`Thresholds.min_requests`).
    Raises:
        TypeError: `figures` is not a `Figures`.
    """
    if not isinstance(figures, Figures):
        raise TypeError(f"diagnose() takes a Figures, got {type(figures).__name__}")
    t = thresholds or Thresholds()
    return (
        _latency_findings(figures, t)
        + _timeout_finding(figures, t)
        + _throughput_finding(figures, t)
    )


def diagnose_all(figures: list[Figures], thresholds: Thresholds | None = None) -> list[Finding]:
    """`diagnose` over several lanes, concatenated."""
    return [finding for f in figures for finding in diagnose(f, thresholds)]
