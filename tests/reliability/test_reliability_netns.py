"""Several hosts (network namespaces, tests/netns.py) over TCP + CURVE (issue 22, items 2 and 3).

The broker in one namespace, two synthetic workers in two others (CURVE on the back socket),
the jobs runner in a fourth (its SQLite file is shared: namespaces isolate the network only),
the test in the root namespace (broker status over its own link). Scenarios:

- a worker partitioned past the broker's liveness window, then healed: its in-flight lines are
  requeued to the other worker, its late results are dropped and counted (`stale_outputs`), it
  comes back under the same identity, and the job ends with every `custom_id` once;
- 100 ms one-way latency and 5% loss on both worker links: the job completes; throughput
  against a clean network is reported (docs/reliability.md), never asserted.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness import (
    Stack,
    chat_line,
    check_exactly_once,
    free_port,
    job_state,
    report,
    submit_job,
    wait_for,
    wait_job_done,
)
from tests.netns import BROKER_LIVENESS, HB, WORKERS, NetRig, RigStack, netem_available

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


@pytest.fixture
def rig(netns_rig: NetRig) -> Iterator[RigStack]:
    tmp = Path(tempfile.mkdtemp(prefix="lsn", dir="/tmp"))
    r = RigStack(tmp, netns_rig)
    try:
        r.start()
        yield r
    finally:
        r.stack.stop()  # before the namespaces go
        shutil.rmtree(tmp, ignore_errors=True)


def _engine(stack: Stack):
    from laneserve.db import migrate
    from laneserve.db.session import make_engine

    migrate.upgrade(stack.db_url)
    return make_engine(stack.db_url)


def _run_job(rig: RigStack, engine, n: int, tag: str, during=None) -> tuple[object, float]:
    ids = [f"{tag}{i:04d}" for i in range(n)]
    job = submit_job(engine, rig.tmp, [chat_line(c, f"t {c}", 16, temperature=None) for c in ids])
    if during is not None:
        during(job)
    job = wait_job_done(engine, job.id, 240, rig.stack)
    assert job.status == "completed", job.status
    out, err = check_exactly_once(engine, job, ids)
    assert len(out) == n and err == [], err[:3]
    return job, n / (job.finalizing_at - job.in_progress_at)


def test_partitioned_worker_requeued_late_results_dropped_same_identity(rig: RigStack) -> None:
    for name in WORKERS:
        rig.start_worker(name)
    rig.stack.wait_workers(set(WORKERS))
    engine = _engine(rig.stack)
    figures = {}

    def partition_w1(job) -> None:
        wait_for(lambda: job_state(engine, job.id).request_counts["completed"] >= 20, 180,
                 "job progress")  # fmt: skip
        wait_for(lambda: rig.stack.status()["workers"] and all(
            w["in_flight"] for w in rig.stack.status()["workers"]), 30, "both workers busy")  # fmt: skip
        t0 = time.monotonic()
        rig.rig.partition("w1")
        wait_for(lambda: rig.counter("workers_lost") >= 1, 30, "the broker to lose w1")
        figures["lost_after_s"] = round(time.monotonic() - t0, 2)
        assert rig.counter("requeued") >= 1  # w1's in-flight lines went back to the queue
        time.sleep(max(0.0, 6.0 - (time.monotonic() - t0)))  # a 6 s partition
        rig.rig.heal("w1")
        t_heal = time.monotonic()
        wait_for(lambda: rig.counter("stale_outputs") >= 1, 30, "w1's late results, dropped")
        rig.stack.wait_workers(set(WORKERS), timeout_s=30)  # w1 again, same identity
        figures["back_after_heal_s"] = round(time.monotonic() - t_heal, 2)

    job, _ = _run_job(rig, engine, 400, "p", partition_w1)
    st = rig.stack.status()
    assert {w["worker_id"] for w in st["workers"]} == set(WORKERS)
    report(
        "22.2 worker partitioned 6 s (TCP + CURVE, namespaces), healed",
        lines=400,
        liveness_window_s=HB * BROKER_LIVENESS,
        **figures,
        requeued=st["counters"].get("requeued", 0),
        stale_outputs_dropped=st["counters"].get("stale_outputs", 0),
        duplicates=0,
        lines_lost=0,
    )


def test_job_completes_over_slow_lossy_links(rig: RigStack) -> None:
    engine = _engine(rig.stack)
    for name in WORKERS:
        rig.start_worker(name)
    rig.stack.wait_workers(set(WORKERS))
    _, clean = _run_job(rig, engine, 150, "c")
    for name in WORKERS:  # the same workers again, now through slow, lossy links
        rig.stack.stop_proc(f"worker-{name}")
    rig.stack.wait_status(lambda st: not st["workers"], 30)
    emulated = not netem_available(rig.rig.ns["w1"], f"{rig.rig.tag}h1")
    for name in WORKERS:
        port = rig.rig.relay(name, free_port(), rig.back_port, delay_ms=100, loss=0.05)
        rig.start_worker(name, port)
    rig.stack.wait_workers(set(WORKERS), timeout_s=60)
    _, slow = _run_job(rig, engine, 150, "s")
    report(
        "22.3 job over 100 ms + 5% loss worker links vs clean (namespaces, TCP + CURVE)",
        lines=150,
        runner_max_in_flight=16,
        clean_lines_per_s=round(clean, 1),
        slow_lossy_lines_per_s=round(slow, 1),
        ratio=round(slow / clean, 2),
        emulation="user-space relay (no sch_netem)" if emulated else "tc netem",
    )
