"""`laneserve status`'s workers and SLO tables at a terminal's width: one row per worker where
the columns fit, one block of "field value" lines per worker below `WIDE_COLUMNS` (an 80-column
terminal squeezed the wide tables into cells such as "worke…" and a KV pool folded over 9 lines)."""

from __future__ import annotations

import io
import re

from rich.console import Console

from laneserve.commands.status import (
    WIDE_COLUMNS,
    _print_workers,
    components_table,
    kv_pool_text,
)

POOL = {"num_blocks": 5825, "block_size": 16, "num_tokens": 93200, "kv_cache_bytes": 2**31,
        "dtype": "bfloat16"}  # fmt: skip
LOAD = {
    "kv_usage": 0.125,
    "num_running": 3,
    "num_waiting": 1,
    "slo_interactive_ttft_ms": 172.4,
    "slo_interactive_tpot_ms": 11.2,
    "slo_interactive_attainment": 0.97,
    "slo_batch_ttft_ms": 1722.0,
    "slo_batch_tpot_ms": 111.0,
    "slo_batch_attainment": 1.0,
    "step_token_budget": 2048,
    "step_batch_tokens": None,
    "predicted_step_ms": 8.4,
    "measured_step_ms": 9.1,
}


def status(num_workers: int) -> dict:
    workers = [
        {
            "worker_id": f"worker-{i}",
            "pid": 24111 + i,
            "lanes": ["interactive", "batch"],
            "model": "smollm2-135m",
            "in_flight": 2,
            "capacity": 128,
            "load": dict(LOAD),
            "info": {"kv_pool": POOL, "engine": {"max_num_seqs": 64}},
        }  # fmt: skip
        for i in range(num_workers)
    ]
    workers[-1]["load"] = {"kv_usage": 0.5}  # a worker under fixed knobs: no SLO fields
    return {"workers": workers, "queues": {"interactive": 0, "batch": 7, "in_flight": 2}}


def printed(width: int, num_workers: int = 2) -> str:
    console = Console(width=width, record=True, file=io.StringIO())
    _print_workers(console, status(num_workers))
    return console.export_text()


def test_narrow_terminal_prints_every_field_whole():
    text = printed(80)
    assert "…" not in text, text
    assert max(len(line) for line in text.splitlines()) <= 80
    for name in (
        "worker-0",
        "worker-1",
        "smollm2-135m",
        "interactive,batch",
        "2/128",
        "3/64",
        "12.5%",
    ):
        assert name in text, (name, text)
    assert text.count(kv_pool_text(POOL)) == 2, text
    # "field value" lines, the SLO ones for the worker under SLO control only
    blocks = text.split("worker-1")
    fields = [dict(re.split(r"\s{2,}", ln.strip(), maxsplit=1) for ln in b.splitlines()
                   if re.search(r"\S\s{2,}\S", ln)) for b in blocks]  # fmt: skip
    assert fields[0]["SLO interactive ttft/tpot ms"] == "172/11"
    assert fields[0]["SLO interactive met"] == "97%"
    assert fields[0]["SLO batch ttft/tpot ms"] == "1722/111"
    assert fields[0]["SLO step ms pred/meas"] == "8.4/9.1"
    assert fields[1]["KV use"] == "50.0%" and not any(k.startswith("SLO") for k in fields[1])
    assert "queues: interactive 0, batch 7, in flight 2" in text


def test_wide_terminal_keeps_one_row_per_worker():
    text = printed(WIDE_COLUMNS + 100)
    assert "…" not in text, text
    rows = [line for line in text.splitlines() if "smollm2-135m" in line]
    assert len(rows) == 2 and all(kv_pool_text(POOL) in r for r in rows), text
    slo_rows = [line for line in text.splitlines() if "172/11" in line]
    assert len(slo_rows) == 1 and "8.4/9.1" in slo_rows[0], text


def test_components_table_folds_long_addresses_at_60_columns():
    """An ipc:// address is one word: at 60 columns it folds over lines, whole, not "…"."""
    address = "ipc:///home/someone/.laneserve/run/broker-frontend-4f2a9c.sock"
    components = [
        {"name": "broker", "pid": 4242, "address": address, "healthy": True, "alive": True},
        {"name": "worker-0", "pid": 4243, "address": None, "healthy": False, "alive": False},
    ]
    console = Console(width=60, record=True, file=io.StringIO())
    console.print(components_table(components))
    text = console.export_text()
    assert "…" not in text, text
    assert max(len(line) for line in text.splitlines()) <= 60
    # the address column's cells, line by line, joined: the whole address, in order
    column = [ln.split("│")[3].strip() for ln in text.splitlines() if ln.startswith("│")]
    assert address in "".join(column), text
