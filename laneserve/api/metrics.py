"""Prometheus metrics of the gateway, named after vLLM's (``vllm:`` -> ``laneserve:``).

Histograms (seconds, label ``lane``), observed by the gateway per choice, i.e. per engine
request: ``time_to_first_token_seconds`` and ``e2e_request_latency_seconds`` are measured here at
the edge (arrival = the gateway accepted the request; DESIGN.md "Per-phase latency");
``inter_token_latency_seconds`` is every gap between consecutive content deltas seen here;
``request_queue_time_seconds``, ``request_prefill_time_seconds``,
``request_decode_time_seconds`` and ``request_time_per_output_token_seconds`` come from the
broker's ``final`` timings (engine intervals).

Counters (label ``lane``): ``prompt_tokens_total``, ``generation_tokens_total``,
``request_success_total`` (+ ``finished_reason``), ``request_failure_total`` (+ ``code``).

Gauges and counters read from the broker's ``status`` (label ``worker_id``):
``num_requests_running``, ``num_requests_waiting``, ``kv_cache_usage_perc`` (0..1, as vLLM),
``prefix_cache_hits_total`` / ``prefix_cache_queries_total`` (tokens), ``num_preemptions_total``,
and ``num_requests_queued`` (label ``lane``: requests waiting in the broker's lane queue),
``num_workers`` (label ``lane``).

Bulk-job lines (label ``lane``; DESIGN.md "Health": /metrics counts API and bulk-job requests
alike), read from the SQL ``requests`` table at scrape time (:class:`JobsCollector`):
``job_lines`` (+ ``status``: pending, completed, failed), ``job_prompt_tokens`` and
``job_generation_tokens`` of finished lines. SQL is the one complete source: job lines reach the
engine through the jobs runner, never through this gateway, and the table holds every line of
every runner, across gateway restarts (the broker's status keeps no per-lane history).

Bucket bounds are vLLM's (vllm/v1/metrics/loggers.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "laneserve:"

# No `*_created` series next to every counter and histogram (as vLLM does); process-wide.
disable_created_metrics()

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)  # fmt: skip
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


class GatewayMetrics:
    """One registry per app (so several apps in one process do not collide)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        reg = self.registry

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, ["lane"], buckets=buckets, registry=reg)

        self.ttft = hist(
            "time_to_first_token_seconds",
            "Arrival at the gateway -> first content token sent.",
            TTFT_BUCKETS,
        )
        self.itl = hist(
            "inter_token_latency_seconds",
            "Gap between consecutive content deltas at the gateway.",
            ITL_BUCKETS,
        )
        self.e2e = hist(
            "e2e_request_latency_seconds",
            "Arrival at the gateway -> request finished.",
            LATENCY_BUCKETS,
        )
        self.queue = hist(
            "request_queue_time_seconds",
            "Arrival -> first scheduled by the engine.",
            LATENCY_BUCKETS,
        )
        self.prefill = hist(
            "request_prefill_time_seconds",
            "First scheduled -> first output token.",
            LATENCY_BUCKETS,
        )
        self.decode = hist(
            "request_decode_time_seconds", "First -> last output token.", LATENCY_BUCKETS
        )
        self.tpot = hist(
            "request_time_per_output_token_seconds",
            "decode time / (output tokens - 1).",
            ITL_BUCKETS,
        )
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prompt tokens of finished requests.", ["lane"], registry=reg
        )
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens", "Output tokens.", ["lane"], registry=reg
        )
        self.success = Counter(
            PREFIX + "request_success",
            "Finished requests.",
            ["lane", "finished_reason"],
            registry=reg,
        )
        self.failure = Counter(
            PREFIX + "request_failure",
            "Requests ended by an error.",
            ["lane", "code"],
            registry=reg,
        )
        self.broker = BrokerCollector()
        reg.register(self.broker)
        self.jobs = JobsCollector()
        reg.register(self.jobs)

    def observe_final(self, lane: str, timings: dict, usage: dict, finish_reason: str) -> None:
        """Engine-side phases from a broker ``final`` (ms -> s) and token counts."""
        for hist, key in (
            (self.queue, "queue_ms"),
            (self.prefill, "prefill_ms"),
            (self.decode, "decode_ms"),
            (self.tpot, "tpot_ms"),
        ):
            value = timings.get(key)
            if isinstance(value, int | float):
                hist.labels(lane).observe(value / 1000.0)
        if isinstance(usage.get("prompt_tokens"), int):
            self.prompt_tokens.labels(lane).inc(usage["prompt_tokens"])
        if isinstance(usage.get("completion_tokens"), int):
            self.generation_tokens.labels(lane).inc(usage["completion_tokens"])
        self.success.labels(lane, finish_reason).inc()


class BrokerCollector:
    """Gauges from the last broker status (set by the gateway's status poller)."""

    def __init__(self) -> None:
        self.status: dict[str, Any] | None = None

    def collect(self) -> Iterator[Any]:
        st = self.status or {}
        workers = st.get("workers") or []
        gauges = {
            "num_requests_running": ("Requests running in the engine.", "running"),
            "num_requests_waiting": ("Requests waiting in the engine.", "waiting"),
            "kv_cache_usage_perc": ("KV-cache usage (1 = full).", "kv_usage"),
        }
        for name, (doc, key) in gauges.items():
            fam = GaugeMetricFamily(PREFIX + name, doc, labels=["worker_id"])
            for w in workers:
                value = (w.get("load") or {}).get(key)
                if isinstance(value, int | float):
                    fam.add_metric([str(w.get("worker_id"))], float(value))
            yield fam
        counters = {
            "prefix_cache_hits": ("Prefix-cache hits (tokens).", "prefix_cache_hits"),
            "prefix_cache_queries": ("Prefix-cache queries (tokens).", "prefix_cache_queries"),
            "num_preemptions": ("Preemptions.", "num_preemptions"),
        }
        for name, (doc, key) in counters.items():
            fam = CounterMetricFamily(PREFIX + name, doc, labels=["worker_id"])
            for w in workers:
                value = (w.get("load") or {}).get(key)
                if isinstance(value, int | float):
                    fam.add_metric([str(w.get("worker_id"))], float(value))
            yield fam
        queued = GaugeMetricFamily(
            PREFIX + "num_requests_queued",
            "Requests waiting in the broker's lane queue.",
            labels=["lane"],
        )
        nworkers = GaugeMetricFamily(
            PREFIX + "num_workers", "Workers serving the lane.", labels=["lane"]
        )
        queues = st.get("queues") or {}
        for lane in ("interactive", "batch"):
            if isinstance(queues.get(lane), int):
                queued.add_metric([lane], float(queues[lane]))
            nworkers.add_metric([lane], float(sum(lane in (w.get("lanes") or []) for w in workers)))
        yield queued
        yield nworkers


JOBS_SOURCE = (
    "From the SQL requests table (rows with a job_id), read at scrape time: every bulk-job line "
    "of every jobs runner, across gateway restarts; shrinks when retention prunes old rows."
)


class JobsCollector:
    """Gauges of bulk-job lines from SQL (see the module docstring); ``rows`` is
    ``[(lane, status, lines, prompt_tokens, completion_tokens)]`` from :meth:`refresh`."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, str, int, int, int]] = []

    def refresh(self, engine: Any) -> None:
        """Re-read the job lines' counts (blocking: one grouped query)."""
        from sqlalchemy import func, select

        from db.models import Request
        from db.session import read_session

        query = (
            select(
                Request.lane,
                Request.status,
                func.count(),
                func.coalesce(func.sum(Request.prompt_tokens), 0),
                func.coalesce(func.sum(Request.completion_tokens), 0),
            )
            .where(Request.job_id.is_not(None))
            .group_by(Request.lane, Request.status)
        )
        with read_session(engine) as session:
            self.rows = [
                (str(lane), str(status), int(n), int(p), int(c))
                for lane, status, n, p, c in session.execute(query)
            ]

    def collect(self) -> Iterator[Any]:
        lines = GaugeMetricFamily(
            PREFIX + "job_lines",
            "Bulk-job lines by status. " + JOBS_SOURCE,
            labels=["lane", "status"],
        )
        prompt = GaugeMetricFamily(
            PREFIX + "job_prompt_tokens",
            "Prompt tokens of finished bulk-job lines. " + JOBS_SOURCE,
            labels=["lane"],
        )
        generation = GaugeMetricFamily(
            PREFIX + "job_generation_tokens",
            "Output tokens of finished bulk-job lines. " + JOBS_SOURCE,
            labels=["lane"],
        )
        tokens: dict[str, list[int]] = {}
        for lane, status, n, p, c in self.rows:
            lines.add_metric([lane, status], float(n))
            if status in ("completed", "failed"):
                slot = tokens.setdefault(lane, [0, 0])
                slot[0] += p
                slot[1] += c
        for lane, (p, c) in tokens.items():
            prompt.add_metric([lane], float(p))
            generation.add_metric([lane], float(c))
        yield lines
        yield prompt
        yield generation
