"""The jobs runner's side of a database outage or a full disk (`db.availability`): pause,
back off, resume.

`OutageKeeper` is an object `jobs.runner.JobsRunner` holds (one concept per file). While the
database does not answer (or the disk under it or the result files is full: writes fail,
`can_wait_out`), the runner's jobs pause: `step` (the runner's `poll`, `flush`, then `advance`:
feed, settle ranges, finish jobs) fails, is counted in `outage` and tried again after a backoff
(0.5 s doubling to 5 s), and no line starts meanwhile. Lines already in flight run to their end
and their results wait in memory (at most `max_in_flight` of them), written by `writer_loop` once
the database answers; no line is marked failed for the outage. A lease not renewed for `lease_s`
is given up (`drop_lapsed`, the runner's `LeaseKeeper.drop_lapsed`): another runner may own those
lines by then. The keeper is given the `Outage` it counts in, the runner's `poll_interval_s`, and
the runner's steps as callables; `unwritten` says how many results wait in memory.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from sqlalchemy.exc import DBAPIError

from laneserve.db.availability import Outage, can_wait_out

logger = logging.getLogger(__name__)

FLUSH_INTERVAL_S = 0.1  # result writes are pooled this long

Step = Callable[[], Awaitable[None]]


class OutageKeeper:
    """Polling, working and writing results through database outages (module docstring)."""

    def __init__(
        self,
        outage: Outage,
        poll_interval_s: float,
        *,
        poll: Step,
        flush: Step,
        advance: Step,
        drop_lapsed: Callable[[], None],
        unwritten: Callable[[], int],
    ) -> None:
        self.outage = outage
        self.poll_interval_s = poll_interval_s
        self._poll = poll
        self._flush = flush
        self._advance = advance
        self._drop_lapsed = drop_lapsed
        self._unwritten = unwritten

    @property
    def down(self) -> bool:
        return self.outage.down

    async def step(self) -> float:
        """Poll and work; the monotonic time of the next poll. While the database is away
        (`outage`) the jobs pause: no line starts, lines in flight finish and their results
        wait in memory, polls back off; a lease that lapsed meanwhile is given up."""
        if self.outage.down:  # also on the first poll after it: leases may have lapsed
            self._drop_lapsed()
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

    async def work(self) -> None:
        """Feed, settle ranges, finish jobs (between polls)."""
        try:
            await self._advance()
        except (DBAPIError, OSError) as exc:
            if not can_wait_out(exc):
                raise
            self.outage.failed(exc)  # the next poll retries

    async def flush_before_exit(self) -> None:
        try:
            await self._flush()
        except (DBAPIError, OSError) as exc:
            if not can_wait_out(exc):
                raise
            logger.warning(
                "stopping without the database: %d results not written; their lines run "
                "again when a runner resumes the job",
                self._unwritten(),
            )

    async def writer_loop(self) -> None:
        """Write the results waiting in memory every `FLUSH_INTERVAL_S` until cancelled,
        backing off while the database is away."""
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
