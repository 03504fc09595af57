"""Scale-out without losing a line (issue 22's check): on the multi-host rig (tests/netns.py),
2 jobs runners + 2 gateways on the edge host and 2 CURVE workers, all on one PostgreSQL (reached
from the rig through a relay in the root namespace), a 2,000-line job plus interactive traffic.
Kill one runner, then one gateway, then partition one worker for 10 s: the job completes with
every `custom_id` once, no interactive request outlives its deadline, and the survivors' RSS and
open file descriptors stay flat.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from sqlalchemy.engine import make_url

from laneserve.jobs import leases
from tests.harness import (
    chat_line,
    check_exactly_once,
    free_port,
    job_state,
    report,
    submit_job,
    wait_for,
    wait_job_done,
)
from tests.netns import WORKERS, NetRig, RigStack

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.timeout(600)]

LINES = 2000
LEASE_S = 3.0
DEADLINE_S = 15.0  # an interactive request's deadline (client timeout)
PARTITION_S = 10.0


class Traffic(threading.Thread):
    """Interactive chat requests, one at a time, alternating between the live gateways; each
    request's outcome and duration are kept."""

    def __init__(self, urls: list[str]) -> None:
        super().__init__(daemon=True)
        self.urls, self.results = list(urls), []
        self.stopping = threading.Event()

    def run(self) -> None:
        model = httpx.get(f"{self.urls[0]}/v1/models", timeout=10).json()["data"][0]["id"]
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        i = 0
        while not self.stopping.is_set():
            url = self.urls[i % len(self.urls)]
            i += 1
            t0 = time.monotonic()
            try:
                r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=DEADLINE_S)
                outcome = r.status_code
            except httpx.HTTPError as exc:  # a killed gateway: refused at once
                outcome = type(exc).__name__
            self.results.append((outcome, time.monotonic() - t0))
            time.sleep(0.2)


@pytest.fixture
def rig(netns_rig: NetRig, own_pg_url) -> Iterator[RigStack]:
    tmp = Path(tempfile.mkdtemp(prefix="lso", dir="/tmp"))
    url = make_url(own_pg_url)
    listen = netns_rig.expose_root(free_port(), url.port or 5432)
    host, port = listen.rsplit(":", 1)
    rig_url = url.set(host=host, port=int(port)).render_as_string(hide_password=False)
    r = RigStack(tmp, netns_rig, db_url=rig_url)
    try:
        yield r
    finally:
        r.stack.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def _footprint(procs: dict[str, psutil.Process]) -> dict[str, tuple[int, int]]:
    return {n: (p.memory_info().rss, p.num_fds()) for n, p in procs.items()}


def test_two_runners_two_gateways_two_workers_survive_kills_and_a_partition(
    rig: RigStack, own_pg_url
) -> None:
    from laneserve.db import migrate
    from laneserve.db.session import make_engine

    migrate.upgrade(own_pg_url)
    engine = make_engine(own_pg_url)
    stack = rig.stack
    rig.start(("runner-a", "runner-b"), "--lease-timeout", str(LEASE_S))
    for name in WORKERS:
        rig.start_worker(name, lanes="interactive,batch")
    urls = [rig.start_api("api-1"), rig.start_api("api-2")]
    stack.wait_workers(set(WORKERS))
    for url in urls:
        wait_for(lambda u=url: _ok(u), 60, f"gateway {url}")
    ids = [f"r{i:05d}" for i in range(LINES)]
    job = submit_job(engine, rig.tmp, [chat_line(c, f"t {c}", 12, temperature=None) for c in ids])
    traffic = Traffic(urls)
    traffic.start()
    survivors = {n: psutil.Process(stack.procs[n].pid) for n in ("runner-b", "api-2", "broker")}
    survivors["worker-w2"] = psutil.Process(stack.procs["worker-w2"].pid)
    figures: dict[str, float] = {}
    try:
        wait_for(lambda: job_state(engine, job.id).request_counts["completed"] >= 100, 180,
                 "job progress")  # fmt: skip
        before = _footprint(survivors)
        # 1. kill a runner: the other takes its line ranges once their leases lapse
        t0 = time.monotonic()
        stack.kill("runner-a")
        wait_for(lambda: any(r.takeovers for r in leases.leases_of(engine, job.id)), 60,
                 "runner-b to take over")  # fmt: skip
        figures["runner_takeover_s"] = round(time.monotonic() - t0, 2)
        # 2. kill a gateway: traffic goes on through the other
        stack.kill("api-1")
        traffic.urls = urls[1:]
        # 3. partition a worker for 10 s, then heal it
        t0 = time.monotonic()
        rig.rig.partition("w1")
        wait_for(lambda: rig.counter("workers_lost") >= 1, 30, "the broker to lose w1")
        figures["worker_lost_after_s"] = round(time.monotonic() - t0, 2)
        time.sleep(max(0.0, PARTITION_S - (time.monotonic() - t0)))
        rig.rig.heal("w1")
        t0 = time.monotonic()
        stack.wait_workers(set(WORKERS), timeout_s=60)
        figures["worker_back_after_heal_s"] = round(time.monotonic() - t0, 2)
        job = wait_job_done(engine, job.id, 400, stack)
        after = _footprint(survivors)
    finally:
        traffic.stopping.set()
        traffic.join(timeout=DEADLINE_S + 5)
    assert job.status == "completed", job.status
    out, err = check_exactly_once(engine, job, ids)
    assert len(out) == LINES and err == [], err[:3]
    slowest = max(d for _, d in traffic.results)
    assert slowest <= DEADLINE_S + 1, f"an interactive request took {slowest:.1f}s"
    ok = sum(1 for o, _ in traffic.results if o == 200)
    assert ok >= len(traffic.results) // 2, traffic.results
    for name, (rss, fds) in after.items():
        rss0, fds0 = before[name]
        assert fds <= fds0 + 16, f"{name}: open fds {fds0} -> {fds}"
        assert rss <= rss0 * 1.5 + 32 * 2**20, f"{name}: RSS {rss0} -> {rss}"
    st = stack.status()
    report(
        "22.4 2 runners + 2 gateways + 2 workers on PostgreSQL: runner, gateway killed, "
        "worker partitioned 10 s",
        lines=LINES,
        lease_s=LEASE_S,
        **figures,
        job_s=round(job.finalizing_at - job.in_progress_at, 1),
        interactive_requests=len(traffic.results),
        interactive_ok=ok,
        interactive_slowest_s=round(slowest, 2),
        stale_outputs_dropped=st["counters"].get("stale_outputs", 0),
        rss_mb={n: round(a[0] / 2**20) for n, a in after.items()},
        fds={n: (before[n][1], a[1]) for n, a in after.items()},
        duplicates=0,
        lines_lost=0,
    )


def _ok(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
