"""Leases on background responses: which gateway process runs a queued or in-progress one.

A background response's row (``responses``, :class:`laneserve.db.models.StoredResponse`) holds
its create body (``request_body``) and, until it ends, the lease of the gateway process running
it: ``lease_owner`` (that process's instance id) and ``lease_expires_at`` (unix s). The process
renews its leases every ``lease_s / 3`` (:func:`renew`); a process that dies stops renewing, and
once its leases lapse any gateway sharing the database claims them (:func:`claim_lapsed`) and
runs the stored body again. A live gateway's leases never lapse, so its responses are not taken
over; every status write of a runner is conditional on its lease (:func:`write_held`), so a
process that lost one (taken over, cancelled elsewhere, deleted) cannot overwrite the row.

On PostgreSQL the claim reads candidate rows with ``SELECT ... FOR UPDATE SKIP LOCKED`` (two
gateways never claim one row); on SQLite the write transaction (``BEGIN IMMEDIATE``) serializes
claims. The ``UPDATE`` repeats the lapsed condition, so a claim is exact on both (as
:mod:`laneserve.jobs.leases` does for job lines).

All functions are synchronous (run them with :func:`laneserve.api.files.jobs_call`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, and_, select, update

from laneserve.db.models import StoredResponse
from laneserve.db.session import read_session, write_session

DEFAULT_LEASE_S = 10.0  # a dead gateway's background responses wait this long to run again
CLAIMS_PER_PASS = 8  # lapsed responses one gateway claims per heartbeat (the rest: next pass)
TERMINAL = ("completed", "incomplete", "failed", "cancelled")


@dataclass(frozen=True, slots=True)
class Claimed:
    """A background response this process now holds: its row as stored."""

    id: str
    owner: str  # SHA-256 of the API key that created it
    created_at: float
    input_items: list[dict]
    response: dict
    request_body: dict | None
    runs: int  # starts so far, this one included
    previous_owner: str | None  # the gateway whose lease lapsed


def insert(
    engine: Engine,
    owner: str,
    items: list[dict],
    obj: dict,
    body: dict,
    holder: str,
    lease_s: float,
) -> None:
    """Store a new background response ``obj`` (created from ``body``), held by ``holder``."""
    row = StoredResponse(
        id=obj["id"],
        owner=owner,
        created_at=obj["created_at"],
        input_items=items,
        response=obj,
        request_body=body,
        lease_owner=holder,
        lease_expires_at=time.time() + lease_s,
        runs=1,
    )
    with write_session(engine) as session:
        session.add(row)


def write_held(engine: Engine, resp_id: str, holder: str, obj: dict, lease_s: float | None) -> bool:
    """Replace the stored object of a response ``holder`` holds and renew its lease for
    ``lease_s`` (None: release it, ``obj`` is final). False when ``holder`` no longer holds it
    (nothing written)."""
    values: dict[str, Any] = {"response": obj}
    if lease_s is None:
        values.update(lease_owner=None, lease_expires_at=None)
    else:
        values["lease_expires_at"] = time.time() + lease_s
    with write_session(engine) as session:
        held = and_(StoredResponse.id == resp_id, StoredResponse.lease_owner == holder)
        return session.execute(update(StoredResponse).where(held).values(**values)).rowcount == 1


def renew(engine: Engine, holder: str, ids: list[str], lease_s: float) -> set[str]:
    """Extend ``holder``'s leases on ``ids`` by ``lease_s``; the ids it still holds (a missing
    one was cancelled by another gateway, deleted or taken over: its run must stop)."""
    if not ids:
        return set()
    with write_session(engine) as session:
        held = and_(StoredResponse.id.in_(ids), StoredResponse.lease_owner == holder)
        kept = set(session.scalars(select(StoredResponse.id).where(held)))
        if kept:
            session.execute(
                update(StoredResponse).where(held).values(lease_expires_at=time.time() + lease_s)
            )
        return kept


def _lapsed(now: float):
    return and_(StoredResponse.lease_owner.is_not(None), StoredResponse.lease_expires_at < now)


def claim_lapsed(
    engine: Engine, holder: str, lease_s: float, limit: int = CLAIMS_PER_PASS
) -> list[Claimed]:
    """Take over up to ``limit`` background responses whose lease lapsed (their gateway died),
    oldest first, for ``lease_s``; each claim counts one more run."""
    now = time.time()
    with read_session(engine) as session:  # the common case, nothing lapsed: no write lock
        if session.scalar(select(StoredResponse.id).where(_lapsed(now)).limit(1)) is None:
            return []
    out = []
    with write_session(engine) as session:
        rows = session.scalars(
            select(StoredResponse)
            .where(_lapsed(now))
            .order_by(StoredResponse.created_at)
            .limit(limit)
            .with_for_update(skip_locked=True)
        ).all()
        for row in rows:
            previous, runs = row.lease_owner, row.runs + 1
            took = session.execute(
                update(StoredResponse)
                .where(StoredResponse.id == row.id, _lapsed(now))
                .values(lease_owner=holder, lease_expires_at=now + lease_s, runs=runs)
            ).rowcount
            assert took == 1, f"response {row.id} was locked but its lease had not lapsed"
            out.append(
                Claimed(
                    row.id,
                    row.owner,
                    row.created_at,
                    row.input_items,
                    row.response,
                    row.request_body,
                    runs,
                    previous,
                )  # fmt: skip
            )
    return out


def hand_back(engine: Engine, resp_id: str, holder: str, runs: int) -> None:
    """Give a claimed response back unrun (its lane has no worker now): it stays where it was,
    and runs again when its lease lapses, without counting this claim as a run."""
    with write_session(engine) as session:
        held = and_(StoredResponse.id == resp_id, StoredResponse.lease_owner == holder)
        session.execute(update(StoredResponse).where(held).values(runs=runs - 1))


def let_go(engine: Engine, holder: str) -> int:
    """Make every lease of ``holder`` (a gateway shutting down) lapse now, so another gateway, or
    this one restarted, runs those responses at its next heartbeat; the number let go."""
    with write_session(engine) as session:
        mine = StoredResponse.lease_owner == holder
        return session.execute(
            update(StoredResponse).where(mine).values(lease_expires_at=0.0)
        ).rowcount


def cancel(engine: Engine, owner: str, resp_id: str) -> dict | None:
    """Cancel a stored background response of ``owner`` that has not ended: its object's
    status becomes ``cancelled`` and its lease is released, so the gateway running it stops at
    its next renewal. The stored object (after the change); None when ``owner`` has no such
    response. A finished or foreground one is returned as it is."""
    with write_session(engine) as session:
        row = session.scalars(
            select(StoredResponse).where(StoredResponse.id == resp_id).with_for_update()
        ).first()
        if row is None or row.owner != owner:
            return None
        obj = row.response
        if obj.get("background") and obj.get("status") not in TERMINAL:
            obj = {**obj, "status": "cancelled", "error": None}
            row.response, row.lease_owner, row.lease_expires_at = obj, None, None
        return obj


__all__ = [
    "CLAIMS_PER_PASS", "Claimed", "DEFAULT_LEASE_S", "TERMINAL", "cancel", "claim_lapsed",
    "hand_back", "insert", "let_go", "renew", "write_held",
]  # fmt: skip
