"""Background responses' leases (laneserve.api.response_leases) on SQLite and PostgreSQL: a live
lease is never claimed, a lapsed one is claimed once however many gateways ask at once, a
holder that lost its lease cannot write, and a cancel from another gateway releases it."""

from __future__ import annotations

import threading

import laneserve.api.response_leases as leases
from laneserve.api.response_store import _save
from laneserve.db.models import StoredResponse
from laneserve.db.session import read_session

BODY = {"model": "m", "input": "hi", "background": True}


def _obj(resp_id: str, status: str = "queued", background: bool = True) -> dict:
    return {"id": resp_id, "created_at": 1.0, "status": status, "background": background}


def _row(engine, resp_id: str) -> StoredResponse:
    with read_session(engine) as session:
        return session.get(StoredResponse, resp_id)


def test_a_live_lease_is_kept_and_a_lapsed_one_taken_over_once(engine) -> None:
    leases.insert(engine, "k", [], _obj("resp_live"), BODY, "gw-a", lease_s=60)
    leases.insert(engine, "k", [], _obj("resp_dead"), BODY, "gw-dead", lease_s=-1)
    assert leases.renew(engine, "gw-a", ["resp_live"], 60) == {"resp_live"}
    (claimed,) = leases.claim_lapsed(engine, "gw-b", 30)
    assert (claimed.id, claimed.previous_owner, claimed.runs) == ("resp_dead", "gw-dead", 2)
    assert claimed.request_body == BODY and claimed.response["status"] == "queued"
    assert leases.claim_lapsed(engine, "gw-c", 30) == []  # b's claim is live now
    # the dead holder (back from a pause) lost it: no renewal, no write
    assert leases.renew(engine, "gw-dead", ["resp_dead"], 30) == set()
    assert not leases.write_held(engine, "resp_dead", "gw-dead", _obj("resp_dead", "failed"), None)
    done = _obj("resp_dead", "completed")
    assert leases.write_held(engine, "resp_dead", "gw-b", done, None)
    row = _row(engine, "resp_dead")
    assert row.response["status"] == "completed" and row.lease_owner is None
    assert leases.claim_lapsed(engine, "gw-c", 30) == []  # released: nobody runs it again
    assert _row(engine, "resp_live").lease_owner == "gw-a"


def test_gateways_claiming_at_once_split_the_lapsed_responses(engine) -> None:
    ids = [f"resp_{i:02d}" for i in range(24)]
    for resp_id in ids:
        leases.insert(engine, "k", [], _obj(resp_id), BODY, "gw-dead", lease_s=-1)
    got: dict[str, list[str]] = {}
    start = threading.Barrier(4)

    def gateway(name: str) -> None:
        start.wait()
        mine = got.setdefault(name, [])
        while batch := leases.claim_lapsed(engine, name, 30, limit=3):
            mine += [c.id for c in batch]

    threads = [threading.Thread(target=gateway, args=(f"gw-{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    claimed = [resp_id for mine in got.values() for resp_id in mine]
    assert sorted(claimed) == ids  # each exactly once
    for name, mine in got.items():
        assert leases.renew(engine, name, ids, 30) == set(mine)


def test_a_cancel_elsewhere_releases_the_lease_and_a_hand_back_is_not_a_run(engine) -> None:
    leases.insert(engine, "k", [], _obj("resp_x", "in_progress"), BODY, "gw-a", lease_s=60)
    assert leases.cancel(engine, "other-key", "resp_x") is None
    cancelled = leases.cancel(engine, "k", "resp_x")
    assert cancelled["status"] == "cancelled" and cancelled["error"] is None
    assert leases.renew(engine, "gw-a", ["resp_x"], 60) == set()  # gw-a stops its run
    assert not leases.write_held(engine, "resp_x", "gw-a", _obj("resp_x", "completed"), None)
    assert leases.cancel(engine, "k", "resp_x")["status"] == "cancelled"  # as it is
    assert _row(engine, "resp_x").response["status"] == "cancelled"
    _save(engine, "k", [], _obj("resp_fg", "completed", background=False))
    assert leases.cancel(engine, "k", "resp_fg")["status"] == "completed"  # foreground: as is

    leases.insert(engine, "k", [], _obj("resp_y"), BODY, "gw-dead", lease_s=-1)
    (c,) = leases.claim_lapsed(engine, "gw-b", lease_s=-1)  # handed back: lapses at once
    leases.hand_back(engine, "resp_y", "gw-b", c.runs)
    (again,) = leases.claim_lapsed(engine, "gw-c", 30)
    assert again.runs == 2 and again.previous_owner == "gw-b"


def test_a_gateway_shutting_down_lets_its_leases_go_at_once(engine) -> None:
    leases.insert(engine, "k", [], _obj("resp_a"), BODY, "gw-a", lease_s=60)
    leases.insert(engine, "k", [], _obj("resp_b"), BODY, "gw-b", lease_s=60)
    assert leases.claim_lapsed(engine, "gw-c", 30) == []
    assert leases.let_go(engine, "gw-a") == 1
    (claimed,) = leases.claim_lapsed(engine, "gw-c", 30)
    assert claimed.id == "resp_a" and claimed.previous_owner == "gw-a"
    assert _row(engine, "resp_b").lease_owner == "gw-b"  # another live gateway's: kept
