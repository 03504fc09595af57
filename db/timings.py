"""Per-phase latency fields from a request's monotonic timeline (DESIGN.md "Per-phase latency").

All inputs are `time.monotonic()` seconds taken on one host (durations are never built by
subtracting wall clocks of different hosts); all outputs are milliseconds rounded to 0.001 ms
(one microsecond, below any clock's useful resolution here), so a scripted timeline gives
exact values.

| field        | definition                                                              |
|--------------|-------------------------------------------------------------------------|
| `queue_ms`   | arrival -> first time the engine schedules any token of the request     |
| `prefill_ms` | first scheduled -> first output token produced (all prefill chunks)     |
| `ttft_ms`    | arrival -> first content token leaves the edge (falls back to produced) |
| `decode_ms`  | first output token -> last output token                                 |
| `tpot_ms`    | decode_ms / (completion_tokens - 1); None when completion_tokens < 2    |
| `itl_p99_ms` | 99th percentile of the gaps between consecutive output tokens           |
| `e2e_ms`     | arrival -> final message sent (falls back to finished)                  |

The percentile is the linear interpolation between closest ranks (Hyndman & Fan type 7, the
default of `numpy.percentile`).
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


class TimelineError(ValueError):
    """A timeline whose events are out of order or not finite."""


def percentile(values: Sequence[float], q: float) -> float:
    """The `q`-th percentile (0..100) of `values`, linear interpolation (numpy's default).

    Raises:
        ValueError: empty `values` or `q` outside [0, 100].
    """
    if not values:
        raise ValueError("percentile of an empty sequence")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q={q} outside [0, 100]")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    lo = math.floor(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)


def compute_timings(
    arrival: float,
    first_scheduled: float | None,
    token_times: Sequence[float],
    finished: float,
    *,
    first_content_sent: float | None = None,
    final_sent: float | None = None,
) -> dict[str, float | None]:
    """The DESIGN latency fields of one request, in ms.

    Args:
        arrival: when the edge accepted the request (monotonic s).
        first_scheduled: when the engine first scheduled any of its tokens; None if never.
        token_times: when each output token was produced, in order (monotonic s);
            `len(token_times)` is completion_tokens.
        finished: when the request finished at the engine/edge (monotonic s).
        first_content_sent: when the first content token left the edge; defaults to
            `token_times[0]` (no transport measured).
        final_sent: when the final message left the edge; defaults to `finished`.

    Returns:
        `{field: ms or None}` for every name in `TIMING_FIELDS`. Fields whose events did not
        happen (no token, never scheduled) are None.

    Raises:
        TimelineError: a non-finite time or events out of order.
    """
    events = [arrival, finished, *token_times]
    events += [t for t in (first_scheduled, first_content_sent, final_sent) if t is not None]
    if not all(math.isfinite(t) for t in events):
        raise TimelineError("timeline has a non-finite time")
    order = [arrival]
    if first_scheduled is not None:
        order.append(first_scheduled)
    order.extend(token_times)
    if any(b < a for a, b in zip(order, order[1:], strict=False)):
        raise TimelineError("timeline events out of order (arrival <= scheduled <= tokens)")
    if finished < order[-1]:
        raise TimelineError("finished before the last event")
    if token_times and first_scheduled is None:
        raise TimelineError("output tokens without a first_scheduled time")

    n = len(token_times)
    first_token = token_times[0] if n else None
    gaps = [b - a for a, b in zip(token_times, token_times[1:], strict=False)]
    decode_s = token_times[-1] - token_times[0] if n else None
    first_sent = first_content_sent if first_content_sent is not None else first_token
    end = final_sent if final_sent is not None else finished
    return {
        "queue_ms": _ms(first_scheduled - arrival) if first_scheduled is not None else None,
        "prefill_ms": _ms(first_token - first_scheduled) if first_token is not None else None,
        "ttft_ms": _ms(first_sent - arrival) if first_sent is not None else None,
        "decode_ms": _ms(decode_s) if decode_s is not None else None,
        "tpot_ms": _ms(decode_s / (n - 1)) if n >= 2 else None,
        "itl_p99_ms": _ms(percentile(gaps, 99.0)) if gaps else None,
        "e2e_ms": _ms(end - arrival),
    }
