"""The jobs runner's side of `jobs.leases`: claiming, renewing, settling and losing leases.

A mixin of `jobs.runner.JobsRunner` (one concept per file): it uses the runner's `_sql` (the SQL
thread), `_flush`, `active` jobs, `held` line ranges, `controls` (jobs whose control lease the
runner holds), `runner_id`, `lease_s` and `counters`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

from laneserve.db.availability import can_wait_out
from laneserve.jobs import leases

logger = logging.getLogger(__name__)


class LeaseKeeping:
    """Lease bookkeeping of a jobs runner (see the module docstring)."""

    runner_id: str
    lease_s: float
    held: dict[tuple[str, int], leases.Lease]
    controls: set[str]
    counters: dict[str, int]
    active: dict  # job id -> jobs.runner.ActiveJob
    _leases_ok_at: float = 0.0  # monotonic s: start of the last renewal that went through

    # ------------------------------------------------------------------ ranges

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
        for aj in self.active.values():
            if aj.lease is not None:
                busy.add(aj.lease.key)
            for rid in [*aj.tasks, *(pl.rid for pl in aj.buffer)]:
                lease = self._lease_of(aj.info.id, rid)
                if lease is not None:
                    busy.add(lease.key)
        return busy

    async def _settle_ranges(self) -> None:
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
                aj = self.active.get(lease.job_id)
                if aj is not None:
                    aj.exhausted = aj.idle = False  # claim it again

    # ------------------------------------------------------------------ leases

    async def _claim_control(self, job_id: str) -> bool:
        if await self._sql(leases.claim_control, job_id, self.runner_id, self.lease_s):
            self.controls.add(job_id)
            return True
        return False

    async def _release_control(self, job_id: str) -> None:
        self.controls.discard(job_id)
        await self._sql(leases.release, self.runner_id, [(job_id, leases.CONTROL)])

    async def _renew_loop(self) -> None:
        self._leases_ok_at = time.monotonic()
        while True:
            await asyncio.sleep(self.lease_s / 3)
            keys = [*self.held, *((job_id, leases.CONTROL) for job_id in self.controls)]
            started = time.monotonic()
            if not keys:
                self._leases_ok_at = started
                continue
            try:
                lost = await self._sql(leases.renew, self.runner_id, keys, self.lease_s)
            except Exception as exc:  # retry; a lapsed lease shows up as lost
                if can_wait_out(exc):  # the outage is logged once by the runner
                    logger.info("renewing %d leases failed: %s", len(keys), type(exc).__name__)
                else:
                    logger.exception("renewing leases failed; retrying")
                continue
            self._leases_ok_at = started
            for key in lost:
                self._abandon(key)

    def _drop_lapsed_leases(self) -> None:
        """Without the database for longer than `lease_s` since the start of the last renewal
        that went through, every lease this runner holds has lapsed in SQL and another runner
        may be running those lines: stop working them (`_abandon`). Results already in memory
        are still written later, harmlessly: writes only fill unfinished lines. When the
        database answers again the runner claims ranges anew (its own lapsed ones at once)."""
        if not (self.held or self.controls):
            return
        silent_s = time.monotonic() - self._leases_ok_at
        if silent_s <= self.lease_s:
            return
        keys = [*self.held, *((job_id, leases.CONTROL) for job_id in self.controls)]
        logger.warning(
            "no lease renewed for %.1f s (lease %.1f s): giving up %d leases and their lines",
            silent_s,
            self.lease_s,
            len(keys),
        )
        for key in keys:
            self._abandon(key)

    def _abandon(self, key: tuple[str, int]) -> None:
        """Another runner took over lease `key` (ours lapsed): stop running its lines."""
        job_id, part = key
        self.counters["leases_lost"] += 1
        if part == leases.CONTROL:
            self.controls.discard(job_id)
            logger.warning("job %s: lost its control lease", job_id)
            return
        lease = self.held.pop(key, None)
        aj = self.active.get(job_id)
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

    async def _release_all(self) -> None:
        """A clean stop: hand every lease back so other runners take the lines at once."""
        keys = [*self.held, *((job_id, leases.CONTROL) for job_id in self.controls)]
        self.held.clear()
        self.controls.clear()
        if not keys:
            return
        try:
            await self._sql(leases.release, self.runner_id, keys)
        except Exception:  # they lapse after lease_s instead
            logger.exception("releasing %d leases failed", len(keys))
