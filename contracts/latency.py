"""Per-phase latency: one definition for every process (DESIGN.md "Per-phase latency").

All results are milliseconds (float), ``None`` when the phase did not happen (never scheduled,
no output token). Inputs are of two kinds:

- *readings*: ``time.monotonic()`` seconds taken on one host (one clock), turned into a duration
  with :func:`interval_ms`;
- *hops*: durations in ms that one process measured on its own clock and passed on (the edge's
  hold time, the broker's wait, the engine's delays). A field that spans several processes is
  the sum of consecutive hops, never a difference of wall clocks of different hosts.

A request crosses these hops (each measured by the process that owns it)::

    arrival (edge) --> broker --> dispatched --> engine accepted --> first scheduled
        --> first output token --> ... --> last output token --> final leaves the edge

| field        | definition                                                            | function        |
|--------------|-----------------------------------------------------------------------|-----------------|
| `queue_ms`   | arrival -> first time the engine schedules any token of the request   | :func:`queue_ms`   |
| `prefill_ms` | first scheduled -> first output token produced (all prefill chunks)   | :func:`prefill_ms` |
| `ttft_ms`    | arrival -> first content token leaves the edge                        | :func:`ttft_ms`    |
| `decode_ms`  | first output token -> last output token                               | :func:`decode_ms`  |
| `tpot_ms`    | decode_ms / (completion_tokens - 1); None when completion_tokens < 2  | :func:`tpot_ms`    |
| `itl_p99_ms` | 99th percentile of the gaps between consecutive output tokens         | :func:`itl_p99_ms` |
| `e2e_ms`     | arrival -> final message sent                                         | :func:`e2e_ms`     |

A non-streamed response's first content token leaves with the whole body; its ``ttft_ms`` ends when
that token reached the edge instead (as vLLM records it), so TTFT keeps meaning queue + prefill.

Percentiles everywhere (engine jitter, dashboards, benchmarks) follow :func:`percentile`: linear
interpolation between closest ranks (Hyndman & Fan type 7, the default of ``numpy.percentile``).

Example, a request that waited 50 ms, prefilled for 200 ms and produced 5 tokens over 200 ms::

    queue_ms(30.0, 20.0)                 # 30 ms to reach the engine + 20 ms in its queue: 50.0
    prefill_ms(10.05, 10.25)             # engine readings: ~200.0
    tpot_ms(decode_ms(10.25, 10.45), 5)  # 200 ms / 4 gaps: 50.0
"""

from __future__ import annotations

import math
from collections.abc import Sequence

TIMING_FIELDS = (
    "queue_ms",
    "prefill_ms",
    "ttft_ms",
    "decode_ms",
    "tpot_ms",
    "itl_p99_ms",
    "e2e_ms",
)
"""The DESIGN per-phase fields, in DESIGN's order (also the ``requests`` latency columns)."""

ITL_PERCENTILE = 99.0
"""The percentile of inter-token gaps reported as ``itl_p99_ms``."""


def interval_ms(start: float | None, end: float | None) -> float | None:
    """Milliseconds from ``start`` to ``end``, two ``time.monotonic()`` readings of one clock.

    None when either reading is missing (the event did not happen).
    """
    if start is None or end is None:
        return None
    return (end - start) * 1000.0


def _hops(*hops_ms: float | None) -> float | None:
    """The sum of consecutive per-hop durations (ms); None when any hop is unknown."""
    if any(h is None for h in hops_ms):
        return None
    return math.fsum(hops_ms)  # type: ignore[arg-type]


def queue_ms(to_engine_ms: float | None, engine_wait_ms: float | None) -> float | None:
    """``queue_ms``: arrival -> first time the engine schedules any token of the request.

    Args:
        to_engine_ms: arrival -> handed to the engine: the edge's hold plus the broker's wait
            until dispatch (ms). ``0.0`` when the engine itself is the edge (offline ``LLM``).
        engine_wait_ms: the engine accepted the request -> first scheduled, on the engine's
            clock (ms); None if it was never scheduled.
    """
    return _hops(to_engine_ms, engine_wait_ms)


def prefill_ms(first_scheduled: float | None, first_token: float | None) -> float | None:
    """``prefill_ms``: first scheduled -> first output token produced, spanning every prefill
    chunk. Both are the engine's ``time.monotonic()`` readings (s)."""
    return interval_ms(first_scheduled, first_token)


def ttft_ms(to_hop_ms: float | None, hop_first_token_ms: float | None) -> float | None:
    """``ttft_ms``: arrival -> the first content token leaves the edge (queue + prefill +
    transport). Only a content token counts, never an empty or role-only chunk.

    Args:
        to_hop_ms: arrival -> the moment the measuring process started its own interval (ms):
            ``0.0`` when the edge measures it; at the broker, the edge's hold time (or the
            edge's hold plus the broker's wait when the engine's delay is the last hop).
        hop_first_token_ms: from that moment to the first content token, on the measuring
            process's clock (ms); None when no token was produced.
    """
    return _hops(to_hop_ms, hop_first_token_ms)


def decode_ms(first_token: float | None, last_token: float | None) -> float | None:
    """``decode_ms``: first output token -> last output token, the engine's
    ``time.monotonic()`` readings (s); 0.0 for a one-token answer, None without tokens."""
    return interval_ms(first_token, last_token)


def tpot_ms(decode: float | None, completion_tokens: int | None) -> float | None:
    """``tpot_ms``: ``decode`` (the request's ``decode_ms``) / (completion_tokens - 1).

    None when ``completion_tokens < 2`` (no gap between tokens) or ``decode`` is unknown.
    """
    if decode is None or completion_tokens is None or completion_tokens < 2:
        return None
    return decode / (completion_tokens - 1)


def itl_p99_ms(gaps_ms: Sequence[float]) -> float | None:
    """``itl_p99_ms``: the 99th :func:`percentile` of the gaps (ms) between consecutive output
    tokens (tokens produced in one step have a 0 ms gap); None with fewer than two tokens."""
    return percentile(gaps_ms, ITL_PERCENTILE)


def e2e_ms(to_hop_ms: float | None, hop_final_ms: float | None) -> float | None:
    """``e2e_ms``: arrival -> the final message is sent.

    Args:
        to_hop_ms: arrival -> the moment the measuring process started its own interval (ms);
            ``0.0`` at the edge, the edge's hold time at the broker.
        hop_final_ms: from that moment to the final message, on that process's clock (ms).
    """
    return _hops(to_hop_ms, hop_final_ms)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) of ``values``; None when ``values`` is empty.

    Linear interpolation between closest ranks: rank ``(n - 1) * q / 100`` into the sorted
    values (Hyndman & Fan type 7, ``numpy.percentile``'s default), so ``q=50`` of ``[1, 2, 3, 4]``
    is 2.5 and ``q=99`` of ``[20, 20, 30, 130]`` is 127.0.

    Raises:
        ValueError: ``q`` outside [0, 100] or NaN.
    """
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q={q} outside [0, 100]")
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    lo = math.floor(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)
