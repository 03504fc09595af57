"""Automatic diagnosis: a symptom is named only with the evidence for its cause.

Pure functions, no database and no Streamlit: `dashboard.query_figures.live_figures` measures a
`Figures` per lane over the recent window (default the last 5 minutes), `diagnose(figures)`
returns the `Finding`s, most explaining first, and `[]` when the lane is healthy.

**Symptoms** (what an operator feels). A latency percentile is *high* when it is over the
lane's absolute limit (`Thresholds.ttft_p99_ms` / `tpot_p99_ms`, per lane; an SLO target a
worker reports replaces the default) *or* worse than its baseline, the same percentile over
the earlier part of the window: `ratio` times higher and at least a floor in ms more (so that
noise on a fast idle system triggers nothing; a baseline needs `min_baseline_requests`). The
absolute limit is what catches a problem in the first minutes, before there is a baseline.

**Causes** (the symptom table below). Each cause fires only when its own evidence holds, and
carries `share`: how much of the symptom it explains, so the causes of one symptom are ranked.

| symptom                    | cause                                | evidence that must hold                                   | share explained |
|----------------------------|--------------------------------------|-----------------------------------------------------------|-----------------|
| TTFT high (TPOT any)       | queueing                             | queue time >= `queue_share` of TTFT in the slowest 10 %, or the queue growing | queue / TTFT (slowest 10 %) |
| TTFT high, batch lane      | queueing behind interactive (design) | as queueing, and interactive requests in the same window  | queue / TTFT |
| TTFT high                  | prefix cache misses                  | prefill >= `prefill_share` of TTFT, cached prompt share < `prefix_hit_low` | prefill / TTFT |
| TTFT high                  | big prefill batches / long prompts   | prefill >= `prefill_share` of TTFT, prefix cache hitting  | prefill / TTFT |
| TTFT and/or TPOT high      | KV memory near full, preemption      | KV usage >= `kv_full` or preemptions > 0                  | preempted share of the slowest 10 % (queue / TTFT when KV is full without preemption) |
| TPOT jitter, TTFT normal   | prefill chunks steal decode steps    | ITL P99 > `jitter_ratio` x TPOT P50, and chunked or long (>= `long_prefill_tokens`) prefills in the window | (ITL P99 - TPOT P50) / ITL P99 |
| long prompts time out      | activation peak, no length limit     | timeouts whose prompts are `long_prompt_ratio` x the median | timed-out share |
| throughput flat, memory free | batch cap too low, fragmentation   | requests waiting in every snapshot, KV usage < `kv_low`, throughput not rising | 1 |

A symptom whose causes all lack evidence is still reported, as "cause not identified", with the
figures that were checked. Queueing of the batch lane while interactive traffic runs is how the
lanes are meant to work: it is reported as `by_design`, with each bulk job's ETA against the
time left in its completion window (a job that will miss its window turns it into a fault).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

DEFAULT_TTFT_P99_MS = {"interactive": 1000.0, "batch": 10000.0}
DEFAULT_TPOT_P99_MS = {"interactive": 100.0, "batch": 1000.0}


class Symptom(enum.StrEnum):
    """What the operator sees; the value is the UI label."""

    TTFT_HIGH = "TTFT high"
    TPOT_HIGH = "TPOT high"
    BOTH_WORSE = "TTFT and TPOT both worse"
    TPOT_JITTER = "TPOT jitter"
    LONG_PROMPT_TIMEOUTS = "long prompts time out"
    THROUGHPUT_FLAT = "throughput flat, memory not full"


class Cause(enum.StrEnum):
    """A likely cause; the value is the UI label."""

    QUEUEING = "queueing"
    BATCH_BEHIND_INTERACTIVE = "batch waits behind interactive traffic (by design)"
    PREFIX_MISSES = "prefix cache misses"
    BIG_PREFILLS = "big prefill batches / long prompts"
    KV_FULL = "KV memory near full, preemption"
    CHUNKS_STEAL_DECODE = "prefill chunks stealing decode steps"
    LONG_PROMPTS = "activation peak, no per-request length limit"
    BATCH_CAP = "batch cap too low, KV fragmentation"
    UNKNOWN = "cause not identified"


@dataclass(frozen=True, slots=True)
class JobEta:
    """An active bulk job: its ETA at the current line rate and the time left in its completion
    window (seconds; None when unknown)."""

    id: str
    eta_s: float | None
    window_left_s: float | None


@dataclass(frozen=True, slots=True)
class Figures:
    """Live figures of one lane over the recent window, and the baseline before it.

    Durations in ms (None when no request has the value); shares and `kv_usage_max`,
    `prefix_hit_rate`, `cached_share` are fractions in [0, 1]; gauges (`waiting_*`,
    `running_max`) are summed over the lane's workers from `worker_stats` snapshots; throughput
    is completion tokens per second. "Tail" is the slowest 10 % of the recent requests by TTFT.
    """

    lane: str
    requests: int = 0  # finished requests in the recent window
    baseline_requests: int = 0
    ttft_p99_ms: float | None = None
    ttft_p99_baseline_ms: float | None = None
    tpot_p50_ms: float | None = None
    tpot_p99_ms: float | None = None
    tpot_p99_baseline_ms: float | None = None
    itl_p99_ms: float | None = None  # P90 over requests of each request's own itl_p99_ms
    queue_p99_ms: float | None = None
    prefill_p99_ms: float | None = None
    queue_share: float | None = None  # sum(queue_ms) / sum(ttft_ms) over the tail
    prefill_share: float | None = None  # sum(prefill_ms) / sum(ttft_ms) over the tail
    preempted_share: float | None = None  # tail requests with preemptions > 0
    cached_share: float | None = None  # sum(cached_tokens) / sum(prompt_tokens), recent
    chunked_prefills: int = 0  # recent requests (any lane) whose prefill took > 1 chunk
    prompt_tokens_max: float | None = None  # longest recent prompt (any lane), tokens
    interactive_requests: int = 0  # interactive requests finished in the recent window
    waiting_now: float | None = None  # latest snapshot, summed over workers
    waiting_before: float | None = None  # first snapshot of the recent window
    waiting_min: float | None = None  # least waiting over the recent snapshots
    running_max: float | None = None
    kv_usage_max: float | None = None
    prefix_hit_rate: float | None = None
    preemptions: int = 0  # sum over the recent window's requests
    timeouts: int = 0  # requests ended by deadline_exceeded / timeout
    timeout_prompt_tokens_p50: float | None = None
    prompt_tokens_p50: float | None = None
    tokens_per_s: float | None = None
    tokens_per_s_baseline: float | None = None
    ttft_target_ms: float | None = None  # an SLO target reported by the workers, if any
    tpot_target_ms: float | None = None
    jobs: tuple[JobEta, ...] = ()


@dataclass(frozen=True, slots=True)
class Thresholds:
    """When a figure counts; rules of thumb, documented in the module docstring. Tune them per
    deployment (the per-lane limits are P99 in ms)."""

    ratio: float = 1.5  # recent percentile / baseline percentile that counts as "worse"
    ttft_floor_ms: float = 50.0  # ... and the difference must be at least this
    tpot_floor_ms: float = 5.0
    ttft_p99_ms: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_TTFT_P99_MS))
    tpot_p99_ms: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_TPOT_P99_MS))
    min_requests: int = 5  # fewer finished requests than this -> no latency findings
    min_baseline_requests: int = 20  # a baseline of fewer requests is not compared with
    jitter_ratio: float = 3.0  # ITL P99 / TPOT P50 above this is jitter
    long_prefill_tokens: int = 512  # a prompt this long is prefilled beside running decodes
    kv_full: float = 0.9  # KV usage at or above this is "near full"
    kv_low: float = 0.5  # below this memory is "not full"
    queue_share: float = 0.5  # queue / TTFT at or above this: queueing dominates TTFT
    prefill_share: float = 0.5  # prefill / TTFT at or above this: prefill dominates TTFT
    prefix_hit_low: float = 0.2  # cached prompt share below this: the prefix cache misses
    long_prompt_ratio: float = 2.0  # timed-out prompts this much longer than the median prompt
    flat_ratio: float = 1.1  # throughput below baseline x this while demand waits is "flat"


@dataclass(frozen=True, slots=True)
class Finding:
    """One diagnosis: the symptom with its figures, the cause whose evidence holds, the share
    of the symptom it explains (0..1, None when not measurable), what to check and do."""

    lane: str
    symptom: Symptom
    cause: Cause
    observed: str  # the symptom's figures, e.g. "TTFT P99 36,000 ms (limit 10,000 ms)"
    check: str
    advice: str
    evidence: dict[str, float] = field(default_factory=dict)
    conditions: dict[str, str] = field(default_factory=dict)  # evidence name -> rule it met
    share: float | None = None
    by_design: bool = False

    @property
    def title(self) -> str:
        return f"[{self.lane}] {self.symptom.value}: {self.cause.value}"


# ---------------------------------------------------------------------------------------------
# Symptoms


def _finite(*values: float | None) -> bool:
    return all(v is not None and math.isfinite(v) for v in values)


def _limit(f: Figures, target: float | None, limits: dict[str, float]) -> float | None:
    return target if target is not None else limits.get(f.lane)


def _high(
    f: Figures, t: Thresholds, cur: float | None, base: float | None, limit: float | None, floor
) -> str | None:
    """Why `cur` counts as high (a phrase with the numbers), or None."""
    if not _finite(cur):
        return None
    if limit is not None and cur > limit:
        return f"{cur:,.0f} ms (limit {limit:,.0f} ms)"
    if f.baseline_requests >= t.min_baseline_requests and _finite(base):
        if cur > t.ratio * base and cur - base >= floor:
            return f"{cur:,.0f} ms (was {base:,.0f} ms before)"
    return None


def ttft_high(f: Figures, t: Thresholds) -> str | None:
    limit = _limit(f, f.ttft_target_ms, t.ttft_p99_ms)
    return _high(f, t, f.ttft_p99_ms, f.ttft_p99_baseline_ms, limit, t.ttft_floor_ms)


def tpot_high(f: Figures, t: Thresholds) -> str | None:
    limit = _limit(f, f.tpot_target_ms, t.tpot_p99_ms)
    return _high(f, t, f.tpot_p99_ms, f.tpot_p99_baseline_ms, limit, t.tpot_floor_ms)


def tpot_jitter(f: Figures, t: Thresholds) -> bool:
    if not _finite(f.itl_p99_ms, f.tpot_p50_ms) or not f.tpot_p50_ms:
        return False
    return (
        f.itl_p99_ms > t.jitter_ratio * f.tpot_p50_ms
        and f.itl_p99_ms - f.tpot_p50_ms >= t.tpot_floor_ms
    )


def queue_growing(f: Figures) -> bool:
    if f.waiting_now is None or f.waiting_now <= 0:
        return False
    return f.waiting_before is None or f.waiting_now > f.waiting_before


# ---------------------------------------------------------------------------------------------
# Causes of a latency symptom: each returns a Finding when its evidence holds, else None


def _clean(ev: dict[str, float | None]) -> dict[str, float]:
    return {k: float(v) for k, v in ev.items() if v is not None}


def _kv_cause(f: Figures, t: Thresholds, symptom: Symptom, observed: str) -> Finding | None:
    kv_full = f.kv_usage_max is not None and f.kv_usage_max >= t.kv_full
    if not kv_full and f.preemptions <= 0:
        return None
    share = f.preempted_share or 0.0
    if kv_full and not share:
        share = f.queue_share or 0.0  # a full cache holds new requests back in the queue
    return Finding(
        f.lane, symptom, Cause.KV_FULL, observed,
        check="KV usage, preemptions",
        advice="KV cache is the limit: give workers more KV memory (--kv-cache-memory), "
        "lower max_num_seqs, or move batch traffic to other workers",
        evidence=_clean({"kv_usage_max": f.kv_usage_max, "preemptions": f.preemptions,
                         "preempted_share": f.preempted_share}),
        conditions={"kv_usage_max": f">= {t.kv_full:g}", "preemptions": "> 0"},
        share=share,
    )  # fmt: skip


def _eta_line(jobs: tuple[JobEta, ...]) -> tuple[str, bool]:
    """One line of job ETAs against their windows, and whether any job will miss its window."""
    parts, late = [], False
    for j in jobs:
        if j.eta_s is None:
            parts.append(f"job {j.id}: no ETA yet")
            continue
        left = "unknown window" if j.window_left_s is None else f"{_dur(j.window_left_s)} left"
        miss = j.window_left_s is not None and j.eta_s > j.window_left_s
        late |= miss
        verdict = " (will miss its window)" if miss else ""
        parts.append(f"job {j.id}: ETA {_dur(j.eta_s)}, {left} in its window{verdict}")
    return "; ".join(parts), late


def _dur(seconds: float) -> str:
    s = max(0, int(seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _queue_cause(f: Figures, t: Thresholds, symptom: Symptom, observed: str) -> Finding | None:
    dominates = f.queue_share is not None and f.queue_share >= t.queue_share
    if not dominates and not queue_growing(f):
        return None
    evidence = _clean({"queue_share": f.queue_share, "queue_p99_ms": f.queue_p99_ms,
                       "ttft_p99_ms": f.ttft_p99_ms, "waiting_now": f.waiting_now})  # fmt: skip
    conditions = {"queue_share": f">= {t.queue_share:g}", "waiting_now": "growing"}
    if f.lane == "batch" and f.interactive_requests > 0:
        evidence["interactive_requests"] = float(f.interactive_requests)
        conditions["interactive_requests"] = "> 0"
        etas, late = _eta_line(f.jobs)
        advice = "the batch lane fills what interactive traffic leaves, as designed"
        advice += f"; {etas}" if etas else ""
        if late:
            advice += ": add workers serving the batch lane, or extend the completion window"
        return Finding(
            f.lane, symptom, Cause.BATCH_BEHIND_INTERACTIVE, observed,
            check="job ETA against its completion window", advice=advice,
            evidence=evidence, conditions=conditions, share=f.queue_share, by_design=not late,
        )  # fmt: skip
    return Finding(
        f.lane, symptom, Cause.QUEUEING, observed,
        check="queue depth, running requests per worker",
        advice="more requests arrive than the workers serve: add workers for this lane, or "
        "raise max_num_seqs where KV memory is free "
        f"(waiting {f.waiting_before or 0:g} -> {f.waiting_now or 0:g})",
        evidence=evidence, conditions=conditions, share=f.queue_share,
    )  # fmt: skip


def _prefill_cause(f: Figures, t: Thresholds, symptom: Symptom, observed: str) -> Finding | None:
    if f.prefill_share is None or f.prefill_share < t.prefill_share:
        return None
    evidence = {"prefill_share": f.prefill_share, "prefill_p99_ms": f.prefill_p99_ms,
                "cached_share": f.cached_share, "prefix_hit_rate": f.prefix_hit_rate}  # fmt: skip
    conditions = {"prefill_share": f">= {t.prefill_share:g}"}
    hit = f.cached_share if f.cached_share is not None else f.prefix_hit_rate
    if hit is not None and hit < t.prefix_hit_low:
        conditions["cached_share"] = f"< {t.prefix_hit_low:g}"
        return Finding(
            f.lane, symptom, Cause.PREFIX_MISSES, observed, check="prefix hit rate",
            advice="put the shared part of prompts (system prompt) first, give the cache more "
            "KV blocks", evidence=_clean(evidence), conditions=conditions, share=f.prefill_share,
        )  # fmt: skip
    return Finding(
        f.lane, symptom, Cause.BIG_PREFILLS, observed, check="prefill batch size, prompt length",
        advice="lower max_num_batched_tokens / long_prefill_token_threshold on the workers "
        "serving this lane, or add workers", evidence=_clean(evidence), conditions=conditions,
        share=f.prefill_share,
    )  # fmt: skip


def _unknown(f: Figures, symptom: Symptom, observed: str, check: str) -> Finding:
    return Finding(
        f.lane, symptom, Cause.UNKNOWN, observed, check=check,
        advice="no cause's evidence holds; compare the figures below with the workers' logs",
        evidence=_clean({"queue_share": f.queue_share, "prefill_share": f.prefill_share,
                         "kv_usage_max": f.kv_usage_max, "preemptions": f.preemptions,
                         "running_max": f.running_max}),
    )  # fmt: skip


def _latency_findings(f: Figures, t: Thresholds) -> list[Finding]:
    if f.requests < t.min_requests:
        return []
    ttft, tpot = ttft_high(f, t), tpot_high(f, t)
    if ttft or tpot:
        if ttft and tpot:
            symptom, observed = Symptom.BOTH_WORSE, f"TTFT P99 {ttft}, TPOT P99 {tpot}"
        elif ttft:
            symptom, observed = Symptom.TTFT_HIGH, f"TTFT P99 {ttft}"
        else:
            symptom, observed = Symptom.TPOT_HIGH, f"TPOT P99 {tpot}"
        rules = [_kv_cause]
        rules += [_queue_cause, _prefill_cause] if ttft else []
        found = [x for rule in rules if (x := rule(f, t, symptom, observed)) is not None]
        return found or [_unknown(f, symptom, observed, "queue time, prefill time, KV usage")]
    if not tpot_jitter(f, t):
        return []
    observed = f"ITL P99 {f.itl_p99_ms:,.0f} ms against TPOT P50 {f.tpot_p50_ms:,.0f} ms"
    long_prompts = f.prompt_tokens_max is not None and f.prompt_tokens_max >= t.long_prefill_tokens
    if f.chunked_prefills <= 0 and not long_prompts:
        return [_unknown(f, Symptom.TPOT_JITTER, observed, "chunk size / token budget")]
    return [
        Finding(
            f.lane, Symptom.TPOT_JITTER, Cause.CHUNKS_STEAL_DECODE, observed,
            check="chunk size / token budget",
            advice="lower long_prefill_token_threshold / max_num_batched_tokens on the workers "
            "serving this lane (256-512 tokens for interactive)",
            evidence=_clean({"itl_p99_ms": f.itl_p99_ms, "tpot_p50_ms": f.tpot_p50_ms,
                             "chunked_prefills": f.chunked_prefills,
                             "prompt_tokens_max": f.prompt_tokens_max}),
            conditions={"itl_p99_ms": f"> {t.jitter_ratio:g} x tpot_p50_ms",
                        "chunked_prefills": "> 0",
                        "prompt_tokens_max": f">= {t.long_prefill_tokens}"},
            share=(f.itl_p99_ms - f.tpot_p50_ms) / f.itl_p99_ms,
        )
    ]  # fmt: skip


def _timeout_finding(f: Figures, t: Thresholds) -> list[Finding]:
    if f.timeouts <= 0 or f.timeout_prompt_tokens_p50 is None or not f.prompt_tokens_p50:
        return []
    if f.timeout_prompt_tokens_p50 < t.long_prompt_ratio * f.prompt_tokens_p50:
        return []
    observed = f"{f.timeouts} requests timed out"
    return [
        Finding(
            f.lane, Symptom.LONG_PROMPT_TIMEOUTS, Cause.LONG_PROMPTS, observed,
            check="max input length, memory headroom",
            advice="cap the input length (max_model_len / edge validation) and keep memory "
            "headroom for the prefill activation peak; chunk long prefills",
            evidence=_clean({"timeouts": f.timeouts,
                             "timeout_prompt_tokens_p50": f.timeout_prompt_tokens_p50,
                             "prompt_tokens_p50": f.prompt_tokens_p50}),
            conditions={"timeout_prompt_tokens_p50": f">= {t.long_prompt_ratio:g} x median"},
            share=f.timeouts / max(f.requests, f.timeouts),
        )
    ]  # fmt: skip


def _throughput_finding(f: Figures, t: Thresholds) -> list[Finding]:
    waiting = f.waiting_min if f.waiting_min is not None else f.waiting_now
    if not waiting or waiting <= 0 or f.kv_usage_max is None or f.kv_usage_max >= t.kv_low:
        return []
    base = f.tokens_per_s_baseline
    if base is not None and f.tokens_per_s is not None and f.tokens_per_s > t.flat_ratio * base:
        return []  # throughput is still climbing with the load
    return [
        Finding(
            f.lane, Symptom.THROUGHPUT_FLAT, Cause.BATCH_CAP,
            f"{waiting:g}+ requests waiting while KV usage peaks at {f.kv_usage_max:.0%}",
            check="max_num_seqs, block size",
            advice="requests wait while KV memory is free: raise max_num_seqs "
            "(--max-num-seqs) or use a smaller block size",
            evidence=_clean({"waiting_min": waiting, "kv_usage_max": f.kv_usage_max,
                             "running_max": f.running_max, "tokens_per_s": f.tokens_per_s,
                             "tokens_per_s_baseline": base}),
            conditions={"waiting_min": "> 0", "kv_usage_max": f"< {t.kv_low:g}"},
            share=1.0,
        )
    ]  # fmt: skip


def _rank(finding: Finding) -> tuple:
    return (finding.by_design, finding.cause is Cause.UNKNOWN, -(finding.share or 0.0))


def diagnose(figures: Figures, thresholds: Thresholds | None = None) -> list[Finding]:
    """Apply the symptom table to one lane's figures.

    Returns:
        The findings whose evidence holds, faults before by-design notes, each group ranked by
        the share of its symptom it explains; `[]` when healthy or when there is too little
        traffic to judge latencies (`Thresholds.min_requests`).
    Raises:
        TypeError: `figures` is not a `Figures`.
    """
    if not isinstance(figures, Figures):
        raise TypeError(f"diagnose() takes a Figures, got {type(figures).__name__}")
    t = thresholds or Thresholds()
    found = (
        _latency_findings(figures, t)
        + _timeout_finding(figures, t)
        + _throughput_finding(figures, t)
    )
    return sorted(found, key=_rank)


def diagnose_all(figures: list[Figures], thresholds: Thresholds | None = None) -> list[Finding]:
    """`diagnose` over several lanes: every lane's faults first, then the by-design notes."""
    found = [finding for f in figures for finding in diagnose(f, thresholds)]
    return sorted(found, key=lambda x: x.by_design)  # stable: each lane's own ranking stays
