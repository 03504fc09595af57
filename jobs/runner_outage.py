"""The jobs runner's side of a database outage or a full disk (`db.availability`): pause,
back off, resume.

A mixin of `jobs.runner.JobsRunner` (one concept per file). While the database does not answer
(or the disk under it or the result files is full: writes fail, `can_wait_out`),
the runner's jobs pause: `_step` (a poll, then `_work`: feed, settle ranges, finish jobs) fails,
is counted in `outage` and tried again after a backoff (0.5 s doubling to 5 s), and no line
starts meanwhile. Lines already in flight run to their end and their results wait in memory
(at most `max_in_flight` of them), written by `_writer_loop` once the database answers; no line
is marked failed for the outage. A lease not renewed for `lease_s` is given up
(`LeaseKeeping._drop_lapsed_leases`): another runner may own those lines by then.
"""

from __future__ import annotations

import asyncio
import logging
import time

from sqlalchemy.exc import DBAPIError

from laneserve.db.availability import Outage, can_wait_out

logger = logging.getLogger(__name__)

FLUSH_INTERVAL_S = 0.1  # result writes are pooled this long


class OutageKeeping:
    """Polling, working and writing results through database outages (module docstring)."""

    outage: Outage
    poll_interval_s: float
    _outcomes: list

    async def _step(self) -> float:
        """Poll and work; the monotonic time of the next poll. While the database is away
        (`outage`) the jobs pause: no line starts, lines in flight finish and their results
        wait in memory, polls back off; a lease that lapsed meanwhile is given up."""
        if self.outage.down:  # also on the first poll after it: leases may have lapsed
            self._drop_lapsed_leases()
        try:
            await self._poll()
            await self._flush()  # no line starts while results cannot be written (disk full)
            await self._advance()
        except (DBAPIError, OSError) as exc:
            if not can_wait_out(exc):
                raise
            return time.monotonic() + self.outage.failed(exc)
        self.outage.ok()
        return time.monotonic() + self.poll_interval_s

    async def _advance(self) -> None:
        await self._feed()
        await self._settle_ranges()
        await self._check_done()

    async def _work(self) -> None:
        """Feed, settle ranges, finish jobs (between polls)."""
        try:
            await self._advance()
        except (DBAPIError, OSError) as exc:
            if not can_wait_out(exc):
                raise
            self.outage.failed(exc)  # the next poll retries

    async def _flush_before_exit(self) -> None:
        try:
            await self._flush()
        except (DBAPIError, OSError) as exc:
            if not can_wait_out(exc):
                raise
            logger.warning(
                "stopping without the database: %d results not written; their lines run "
                "again when a runner resumes the job",
                len(self._outcomes),
            )

    async def _writer_loop(self) -> None:
        delay = FLUSH_INTERVAL_S
        while True:
            await asyncio.sleep(delay)
            try:
                await self._flush()
            except (DBAPIError, OSError) as exc:  # unreachable, locked, disk full: keep, retry
                if not can_wait_out(exc):
                    logger.exception("writing results failed; retrying")
                delay = self.outage.failed(exc)
                continue
            except Exception:
                logger.exception("writing results failed; retrying")
            delay = FLUSH_INTERVAL_S
