"""The window's request rows, read incrementally between refreshes (no Streamlit here).

A refresh reads only the rows that finished since the previous one: `RowCache.read` reads
`finished_at >= last end - LAG_S` again (so rows the recorder commits up to `LAG_S` late are
picked up), puts them in place of the cached rows of that span and drops the rows that left
the window. So on a 1M-row table a refresh costs the new rows, not the window. A full read happens
when the filter (lane, model) changes, the window grows backwards, or every `FULL_READ_S`
(which also picks up rows committed later than `LAG_S` after they finished, e.g. a recorder
that was down).

One cache serves every browser session of the app (a lock keeps reads one at a time).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import pandas as pd
from sqlalchemy import Engine

from laneserve.dashboard.query_rows import Window, request_rows

LAG_S = 30.0  # s: a row committed up to this long after it finished is still read
FULL_READ_S = 300.0  # s between full re-reads of the window


@dataclass(slots=True)
class _Entry:
    start: float
    end: float
    rows: pd.DataFrame
    full_at: float


class RowCache:
    """`request_rows` of a sliding window, refreshed by reading only what is new."""

    def __init__(self, lag_s: float = LAG_S, full_read_s: float = FULL_READ_S) -> None:
        self.lag_s, self.full_read_s = lag_s, full_read_s
        self._entries: dict[tuple, _Entry] = {}
        self._lock = threading.Lock()

    def read(self, engine: Engine, window: Window) -> pd.DataFrame:
        """The finished requests of `window`, as `request_rows(engine, window)` returns them."""
        key = (str(engine.url), window.lane, window.model)
        with self._lock:
            e = self._entries.get(key)
            now = time.monotonic()
            if (
                e is None
                or window.start < e.start
                or window.end < e.end
                or now - e.full_at > self.full_read_s
            ):
                e = _Entry(window.start, window.end, request_rows(engine, window), now)
            else:
                since = max(e.start, e.end - self.lag_s)
                new = request_rows(engine, Window(since, window.end, window.lane, window.model))
                rows = pd.concat([e.rows[e.rows["finished_at"] < since], new], ignore_index=True)
                e = _Entry(e.start, window.end, rows, e.full_at)
            e.rows = e.rows[e.rows["finished_at"] >= window.start].reset_index(drop=True)
            e.start = window.start
            self._entries[key] = e
            return e.rows
