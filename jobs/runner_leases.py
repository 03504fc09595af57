"""The jobs runner's leases (`jobs.leases`): claiming, renewing, settling and losing them.

`LeaseKeeper` is an object `jobs.runner.JobsRunner` holds (one concept per file). It owns the
leases the runner holds, `held` line ranges and `controls` (jobs whose control lease it holds),
and is given what it uses: `sql` (the runner's SQL thread: `sql(fn, *args)` runs
`fn(engine, *args)`), the runner's `runner_id` and `lease_s`, its `jobs` (job id -> `ActiveJob`,
read to see which ranges are busy and changed when lines are lost or a range opens again),
`counters` (the `ranges_*` and `leases_lost` counts) and `flush` (write the results waiting in
memory before a range is ended).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from laneserve.db.availability import can_wait_out
from laneserve.jobs import leases

if TYPE_CHECKING:
    from laneserve.jobs.runner import ActiveJob

logger = logging.getLogger(__name__)

Sql = Callable[..., Awaitable[Any]]  # sql(fn, *args): `fn(engine, *args)` on the SQL thread


class LeaseKeeper:
    """The leases of one jobs runner (see the module docstring)."""

    def __init__(
        self,
        sql: Sql,
        runner_id: str,
        lease_s: float,
        jobs: dict[str, ActiveJob],
        counters: dict[str, int],
        flush: Callable[[], Awaitable[None]],
    ) -> None:
        self._sql = sql
        self.runner_id = runner_id
        self.lease_s = lease_s
        self._jobs = jobs
        self._counters = counters
        self._flush = flush
        self.held: dict[tuple[str, int], leases.Lease] = {}  # line ranges claimed
        self.controls: set[str] = set()  # jobs whose control lease this runner holds
        self._ok_at = 0.0  # monotonic s: start of the last renewal that went through

    def _all_keys(self) -> list[tuple[str, int]]:
        return [*self.held, *((job_id, leases.CONTROL) for job_id in self.controls)]

    # ------------------------------------------------------------------ ranges

    async def claim_range(self, job_id: str) -> leases.Lease | None:
        """Claim the next free or lapsed line range of `job_id` (None when none is left)."""
        mine = {part for (j, part) in self.held if j == job_id}
        lease = await self._sql(leases.claim_range, job_id, self.runner_id, self.lease_s, mine)
        if lease is None:
            return None
        self.held[lease.key] = lease
        self._counters["ranges_claimed"] += 1
        self._counters["ranges_taken_over"] += lease.previous_owner is not None
        return lease

    def holds_ranges(self, job_id: str) -> bool:
        """Whether a line range of `job_id` is still held (`settle_ranges` has not ended it)."""
        return any(j == job_id for j, _ in self.held)

    async def release_job(self, job_id: str) -> None:
        """Hand back the line ranges of a job the runner no longer runs."""
        mine = [key for key in self.held if key[0] == job_id]
        for key in mine:
            del self.held[key]
        if mine:
            await self._sql(leases.release, self.runner_id, mine)

    def _lease_of(self, job_id: str, rid: str) -> leases.Lease | None:
        return next(
            (
                lease
                for (j, _), lease in self.held.items()
                if j == job_id and lease.first_rid <= rid <= lease.last_rid
            ),
            None,
        )

    def _busy_parts(self) -> set[tuple[str, int]]:
        """Held ranges still being read or with lines buffered or in flight."""
        busy = set()
        for aj in self._jobs.values():
            if aj.lease is not None:
                busy.add(aj.lease.key)
            for rid in [*aj.tasks, *(pl.rid for pl in aj.buffer)]:
                lease = self._lease_of(aj.info.id, rid)
                if lease is not None:
                    busy.add(lease.key)
        return busy

    async def settle_ranges(self) -> None:
        """End each held range whose lines are all read and finished: done, or released to be
        read again when a line is still open."""
        busy = self._busy_parts()
        idle = [key for key in self.held if key not in busy]
        if not idle:
            return
        await self._flush()
        for key in idle:
            lease = self.held[key]
            finished = await self._sql(leases.finish_range, lease, self.runner_id)
            self.held.pop(key, None)  # kept when the call fails: a lease is never forgotten
            if not finished:
                aj = self._jobs.get(lease.job_id)
                if aj is not None:
                    aj.exhausted = aj.idle = False  # claim it again

    # ------------------------------------------------------------------ leases

    async def claim_control(self, job_id: str) -> bool:
        if await self._sql(leases.claim_control, job_id, self.runner_id, self.lease_s):
            self.controls.add(job_id)
            return True
        return False

    async def release_control(self, job_id: str) -> None:
        self.controls.discard(job_id)
        await self._sql(leases.release, self.runner_id, [(job_id, leases.CONTROL)])

    async def renew_loop(self) -> None:
        """Renew every held lease each `lease_s / 3` until cancelled; give up those lost."""
        self._ok_at = time.monotonic()
        while True:
            await asyncio.sleep(self.lease_s / 3)
            keys = self._all_keys()
            started = time.monotonic()
            if not keys:
                self._ok_at = started
                continue
            try:
                lost = await self._sql(leases.renew, self.runner_id, keys, self.lease_s)
            except Exception as exc:  # retry; a lapsed lease shows up as lost
                if can_wait_out(exc):  # the outage is logged once by the runner
                    logger.info("renewing %d leases failed: %s", len(keys), type(exc).__name__)
                else:
                    logger.exception("renewing leases failed; retrying")
                continue
            self._ok_at = started
            for key in lost:
                self.abandon(key)

    def drop_lapsed(self) -> None:
        """Without the database for longer than `lease_s` since the start of the last renewal
        that went through, every lease this runner holds has lapsed in SQL and another runner
        may be running those lines: stop working them (`abandon`). Results already in memory
        are still written later, harmlessly: writes only fill unfinished lines. When the
        database answers again the runner claims ranges anew (its own lapsed ones at once)."""
        if not (self.held or self.controls):
            return
        silent_s = time.monotonic() - self._ok_at
        if silent_s <= self.lease_s:
            return
        keys = self._all_keys()
        logger.warning(
            "no lease renewed for %.1f s (lease %.1f s): giving up %d leases and their lines",
            silent_s,
            self.lease_s,
            len(keys),
        )
        for key in keys:
            self.abandon(key)

    def abandon(self, key: tuple[str, int]) -> None:
        """Another runner took over lease `key` (ours lapsed): stop running its lines."""
        job_id, part = key
        self._counters["leases_lost"] += 1
        if part == leases.CONTROL:
            self.controls.discard(job_id)
            logger.warning("job %s: lost its control lease", job_id)
            return
        lease = self.held.pop(key, None)
        aj = self._jobs.get(job_id)
        if lease is None or aj is None:
            return
        logger.warning("job %s: lost lines %d-%d to another runner", job_id, lease.first_line,
                       lease.last_line)  # fmt: skip
        if aj.lease is not None and aj.lease.key == key:
            aj.lease = None
        aj.buffer = deque(pl for pl in aj.buffer if not lease.first_rid <= pl.rid <= lease.last_rid)
        for rid, task in list(aj.tasks.items()):
            if lease.first_rid <= rid <= lease.last_rid:
                task.cancel()

    async def release_all(self) -> None:
        """A clean stop: hand every lease back so other runners take the lines at once."""
        keys = self._all_keys()
        self.held.clear()
        self.controls.clear()
        if not keys:
            return
        try:
            await self._sql(leases.release, self.runner_id, keys)
        except Exception:  # they lapse after lease_s instead
            logger.exception("releasing %d leases failed", len(keys))
