"""The broker's lane queues order requests by `priority` (lower = more urgent), then arrival."""

from __future__ import annotations

import collections

from laneserve.broker import protocol as p
from laneserve.broker.config import BrokerConfig
from laneserve.broker.dispatch import Dispatcher
from laneserve.broker.requests import RequestState
from laneserve.broker.workers import WorkerState


def _dispatcher() -> tuple[Dispatcher, dict[str, RequestState]]:
    requests: dict[str, RequestState] = {}
    worker = WorkerState(b"w", "w", 1, "m", ("interactive", "batch"), 100, {}, 0.0)
    config = BrokerConfig(front="inproc://f", back="inproc://b")
    return Dispatcher(config, {b"w": worker}, requests, collections.Counter()), requests


def _submit(d: Dispatcher, requests, rid: str, lane: str, priority: int, at: float) -> None:
    submit = p.Submit(request_id=rid, lane=lane, priority=priority, prompt="hi")
    req = RequestState(submit=submit, client=b"c", received=at, arrival_at=at)
    requests[rid] = req
    d.enqueue(req)


def test_each_lane_queue_is_ordered_by_priority_then_arrival():
    d, reqs = _dispatcher()
    for rid, prio, at in [("a", 0, 1.0), ("b", 5, 2.0), ("c", -3, 3.0), ("d", 0, 4.0),
                          ("e", -3, 5.0), ("f", 5, 6.0)]:  # fmt: skip
        _submit(d, reqs, rid, "batch", prio, at)
    _submit(d, reqs, "i-late", "interactive", 0, 7.0)
    _submit(d, reqs, "i-urgent", "interactive", -1, 8.0)
    assert list(d.queues["batch"]) == ["c", "e", "a", "d", "b", "f"]
    assert list(d.queues["interactive"]) == ["i-urgent", "i-late"]
    order = []
    while (pair := d.next()) is not None:
        order.append(pair[1].request_id)
        d.assign(*pair, now=9.0)
    # interactive first (lanes), each lane in its queue order; batch_every=4 is not reached
    assert order == ["i-urgent", "i-late", "c", "e", "a", "d", "b", "f"]


def test_no_worker_expiry_finds_old_requests_behind_urgent_ones():
    d, reqs = _dispatcher()
    _submit(d, reqs, "old", "interactive", 3, 0.0)
    _submit(d, reqs, "new-urgent", "interactive", 0, 25.0)
    expired = d.expire_no_worker(now=31.0, serves_interactive=False)
    assert [r.request_id for r in expired] == ["old"]
    assert list(d.queues["interactive"]) == ["new-urgent"]
