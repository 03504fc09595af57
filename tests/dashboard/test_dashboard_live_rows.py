"""live_rows.RowCache: the incremental read of a sliding window equals a full read."""

from __future__ import annotations

import numpy as np
import pandas as pd
from dashboard_data import NOW, make_records, store

from laneserve.dashboard.live_rows import RowCache
from laneserve.dashboard.queries import Window, request_rows


def _ids(df: pd.DataFrame) -> list[str]:
    return sorted(df["id"])


def test_incremental_read_equals_full_read(db_engine):
    rng = np.random.default_rng(21)
    store(db_engine, records=make_records(rng, 300, NOW - 3600, NOW - 100, "interactive"))
    cache = RowCache(lag_s=30.0)
    first = cache.read(db_engine, Window(NOW - 3600, NOW - 100))
    assert _ids(first) == _ids(request_rows(db_engine, Window(NOW - 3600, NOW - 100)))
    # New rows: some finished since the last read, some committed late (inside the lag).
    late = make_records(rng, 10, NOW - 120, NOW - 100, "interactive")
    new = make_records(rng, 40, NOW - 100, NOW, "batch")
    store(db_engine, records=late + new)
    for end in (NOW, NOW + 60):  # the window slides: old rows leave it
        win = Window(end - 3600, end)
        got = cache.read(db_engine, win)
        full = request_rows(db_engine, win)
        assert _ids(got) == _ids(full)
        pd.testing.assert_frame_equal(
            got.sort_values("id").reset_index(drop=True),
            full.sort_values("id").reset_index(drop=True),
        )
        assert got["finished_at"].is_monotonic_increasing
    # Another filter is its own entry, read in full.
    only_batch = cache.read(db_engine, Window(NOW - 3540, NOW + 60, lane="batch"))
    assert _ids(only_batch) == sorted(r["id"] for r in new)
