"""Prometheus metrics of the gateway, named after vLLM's (``vllm:`` -> ``laneserve:``).

Every series carries ``model_name`` as vLLM's do (vLLM labels its metrics ``model_name`` = the
served model name, plus ``engine``; laneserve's second label is ``lane``, or ``worker_id`` for
worker gauges). Request metrics use the gateway's served model name (``--served-model-name``, the
model's name, or else the first worker's model); worker gauges use that served name too, or the
model each worker reports when the gateway has none.

Histograms (seconds, labels ``model_name``, ``lane``), observed by the gateway per choice, i.e. per engine
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
the SLO controller's ``step_token_budget``, ``step_batch_tokens``, ``step_predicted_ms``,
``step_measured_ms``, ``slo_interactive_attainment``, ``slo_batch_attainment`` (0..1),
``slo_interactive_ttft_target_ms``, ``slo_interactive_tpot_target_ms``,
``spec_decode_num_draft_tokens_total`` / ``spec_decode_num_accepted_tokens_total`` /
``spec_decode_num_drafts_total`` (vLLM's names; mean accepted length = 1 + accepted / drafts), and ``num_requests_queued`` (label ``lane``: requests waiting in the broker's lane queue),
``num_workers`` (label ``lane``), ``records_unacked`` and ``records_dropped_total`` (the broker's
bounded buffer of records the recorder has not committed yet, e.g. while the database is away,
and what it dropped when full).

Bulk-job lines (label ``lane``; DESIGN.md "Health": /metrics counts API and bulk-job requests
alike), read from the SQL ``requests`` table at scrape time (:class:`JobsCollector`):
``job_lines`` (+ ``status``: pending, completed, failed), ``job_prompt_tokens`` and
``job_generation_tokens`` of finished lines. SQL is the one complete source: job lines reach the
engine through the jobs runner, never through this gateway, and the table holds every line of
every runner, across gateway restarts (the broker's status keeps no per-lane history).

Bucket bounds are vLLM's (vllm/v1/metrics/loggers.py).

Who exports what (several gateways on one broker): request metrics are per gateway (each counts
the requests it served; Prometheus sums them over instances). The *stack gauges* -- the broker
status gauges and counters and the bulk-job gauges above -- describe the whole stack and read the
same in every gateway, so exactly one gateway per broker exports them: ``GatewayMetrics(
stack_gauges=False)`` (``laneserve api --no-stack-gauges``) on every other one. docs/metrics.md.
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


UNKNOWN_MODEL = "unknown"  # model_name before the gateway knows which model it serves


class _ByModel:
    """A labelled metric whose first label, ``model_name``, is filled in from ``owner``:
    ``m.labels(lane)`` is ``metric.labels(owner.model_name, lane)``."""

    def __init__(self, owner: GatewayMetrics, metric: Histogram | Counter) -> None:
        self._owner = owner
        self.metric = metric

    def labels(self, *values: str) -> Any:
        return self.metric.labels(self._owner.model_name, *values)


class GatewayMetrics:
    """One registry per app (so several apps in one process do not collide).

    ``model_name``: the ``model_name`` label of request metrics (set by the gateway once it
    knows its served name). ``stack_gauges``: export the broker status and bulk-job gauges
    (the module docstring: one gateway per broker).
    """

    def __init__(self, model_name: str = UNKNOWN_MODEL, *, stack_gauges: bool = True) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.served_name = False  # model_name is the gateway's --served-model-name / model
        self.stack_gauges = stack_gauges
        reg = self.registry

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> _ByModel:
            labels = ["model_name", "lane"]
            return _ByModel(
                self, Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=reg)
            )

        def counter(name: str, doc: str, labels: list[str]) -> _ByModel:
            return _ByModel(
                self, Counter(PREFIX + name, doc, ["model_name", *labels], registry=reg)
            )

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
        self.prompt_tokens = counter(
            "prompt_tokens", "Prompt tokens of finished requests.", ["lane"]
        )
        self.generation_tokens = counter("generation_tokens", "Output tokens.", ["lane"])
        self.success = counter("request_success", "Finished requests.", ["lane", "finished_reason"])
        self.failure = counter("request_failure", "Requests ended by an error.", ["lane", "code"])
        self.broker = BrokerCollector(self)
        self.jobs = JobsCollector(self)
        if stack_gauges:
            reg.register(self.broker)
            reg.register(self.jobs)

    def worker_model_name(self, worker: dict[str, Any]) -> str:
        """``model_name`` of a worker's series: the served name when the gateway has one (as
        vLLM labels everything with its served name), else the model the worker reports."""
        model = worker.get("model")
        if self.served_name or not isinstance(model, str) or not model:
            return self.model_name
        return model

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
    """Gauges from the last broker status (set by the gateway's status poller); worker series
    carry the model each worker reports, lane series the gateway's ``owner.model_name``."""

    def __init__(self, owner: GatewayMetrics) -> None:
        self.owner = owner
        self.status: dict[str, Any] | None = None

    def collect(self) -> Iterator[Any]:
        st = self.status or {}
        workers = st.get("workers") or []
        gauges = {
            "num_requests_running": ("Requests running in the engine.", "running"),
            "num_requests_waiting": ("Requests waiting in the engine.", "waiting"),
            "kv_cache_usage_perc": ("KV-cache usage (1 = full).", "kv_usage"),
            # SLO-driven steps (gpu_worker/step_budget.py); absent under fixed knobs
            "step_token_budget": ("Token budget the SLO controller chose.", "step_token_budget"),
            "step_batch_tokens": ("Batch-lane tokens per step it allowed.", "step_batch_tokens"),
            "step_predicted_ms": ("Predicted time of the last step (ms).", "predicted_step_ms"),
            "step_measured_ms": ("Measured step time, moving average (ms).", "measured_step_ms"),
            "slo_interactive_attainment": (
                "Recent interactive requests within both targets (0..1).",
                "slo_interactive_attainment",
            ),
            "slo_batch_attainment": (
                "Recent batch requests within both targets (0..1).", "slo_batch_attainment"
            ),
            "slo_interactive_ttft_target_ms": ("Interactive TTFT target, P99 (ms).",
                                               "slo_interactive_ttft_ms"),
            "slo_interactive_tpot_target_ms": ("Interactive TPOT target, P99 (ms).",
                                               "slo_interactive_tpot_ms"),
        }  # fmt: skip
        for name, (doc, key) in gauges.items():
            fam = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name", "worker_id"])
            self._add_workers(fam, workers, key)
            yield fam
        counters = {
            "prefix_cache_hits": ("Prefix-cache hits (tokens).", "prefix_cache_hits"),
            "prefix_cache_queries": ("Prefix-cache queries (tokens).", "prefix_cache_queries"),
            "num_preemptions": ("Preemptions.", "num_preemptions"),
            "spec_decode_num_draft_tokens": (
                "Speculative decoding: draft tokens verified.",
                "spec_draft_tokens",
            ),
            "spec_decode_num_accepted_tokens": (
                "Speculative decoding: draft tokens accepted.",
                "spec_accepted_tokens",
            ),
            "spec_decode_num_drafts": (
                "Speculative decoding: verifications that carried drafts.",
                "spec_num_drafts",
            ),
        }
        for name, (doc, key) in counters.items():
            fam = CounterMetricFamily(PREFIX + name, doc, labels=["model_name", "worker_id"])
            self._add_workers(fam, workers, key)
            yield fam
        queued = GaugeMetricFamily(
            PREFIX + "num_requests_queued",
            "Requests waiting in the broker's lane queue.",
            labels=["model_name", "lane"],
        )
        nworkers = GaugeMetricFamily(
            PREFIX + "num_workers", "Workers serving the lane.", labels=["model_name", "lane"]
        )
        queues = st.get("queues") or {}
        model = self.owner.model_name
        for lane in ("interactive", "batch"):
            if isinstance(queues.get(lane), int):
                queued.add_metric([model, lane], float(queues[lane]))
            serving = float(sum(lane in (w.get("lanes") or []) for w in workers))
            nworkers.add_metric([model, lane], serving)
        yield queued
        yield nworkers
        yield from self._record_link(st, model)

    @staticmethod
    def _record_link(st: dict, model: str) -> Iterator[Any]:
        """The broker's buffer of records the recorder has not acknowledged (it fills while
        the database is away) and the records dropped when it was full."""
        series = (
            (
                GaugeMetricFamily,
                "records_unacked",
                "Request records and snapshots the broker holds until the recorder commits them.",
                (st.get("queues") or {}).get("records_unacked"),
            ),
            (
                CounterMetricFamily,
                "records_dropped",
                "Records dropped, oldest first, when the broker's unacknowledged buffer was full.",
                (st.get("counters") or {}).get("records_dropped", 0),
            ),
        )
        for family, name, doc, value in series:
            if isinstance(value, int):
                fam = family(PREFIX + name, doc, labels=["model_name"])
                fam.add_metric([model], float(value))
                yield fam

    def _add_workers(self, fam: Any, workers: list[dict], key: str) -> None:
        for w in workers:
            value = (w.get("load") or {}).get(key)
            if isinstance(value, int | float):
                labels = [self.owner.worker_model_name(w), str(w.get("worker_id"))]
                fam.add_metric(labels, float(value))


JOBS_SOURCE = (
    "From the SQL requests table (rows with a job_id), read at scrape time: every bulk-job line "
    "of every jobs runner, across gateway restarts; shrinks when retention prunes old rows."
)


class JobsCollector:
    """Gauges of bulk-job lines from SQL (see the module docstring); ``rows`` is
    ``[(model, lane, status, lines, prompt_tokens, completion_tokens)]`` from :meth:`refresh`
    (a line without a model gets ``owner.model_name``)."""

    def __init__(self, owner: GatewayMetrics) -> None:
        self.owner = owner
        self.rows: list[tuple[str, str, str, int, int, int]] = []

    def refresh(self, engine: Any) -> None:
        """Re-read the job lines' counts (blocking: one grouped query)."""
        from sqlalchemy import func, select

        from laneserve.db.models import Request
        from laneserve.db.session import read_session

        query = (
            select(
                Request.model,
                Request.lane,
                Request.status,
                func.count(),
                func.coalesce(func.sum(Request.prompt_tokens), 0),
                func.coalesce(func.sum(Request.completion_tokens), 0),
            )
            .where(Request.job_id.is_not(None))
            .group_by(Request.model, Request.lane, Request.status)
        )
        with read_session(engine) as session:
            self.rows = [
                (model or self.owner.model_name, str(lane), str(status), int(n), int(p), int(c))
                for model, lane, status, n, p, c in session.execute(query)
            ]

    def collect(self) -> Iterator[Any]:
        lines = GaugeMetricFamily(
            PREFIX + "job_lines",
            "Bulk-job lines by status. " + JOBS_SOURCE,
            labels=["model_name", "lane", "status"],
        )
        prompt = GaugeMetricFamily(
            PREFIX + "job_prompt_tokens",
            "Prompt tokens of finished bulk-job lines. " + JOBS_SOURCE,
            labels=["model_name", "lane"],
        )
        generation = GaugeMetricFamily(
            PREFIX + "job_generation_tokens",
            "Output tokens of finished bulk-job lines. " + JOBS_SOURCE,
            labels=["model_name", "lane"],
        )
        tokens: dict[tuple[str, str], list[int]] = {}
        counts: dict[tuple[str, str, str], int] = {}
        for model, lane, status, n, p, c in self.rows:
            counts[(model, lane, status)] = counts.get((model, lane, status), 0) + n
            if status in ("completed", "failed"):
                slot = tokens.setdefault((model, lane), [0, 0])
                slot[0] += p
                slot[1] += c
        for key, n in counts.items():
            lines.add_metric(list(key), float(n))
        for key, (p, c) in tokens.items():
            prompt.add_metric(list(key), float(p))
            generation.add_metric(list(key), float(c))
        yield lines
        yield prompt
        yield generation
