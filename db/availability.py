"""Is the database there, is there room? `database_unavailable` and `storage_full` tell a
passing outage from a bad row, and `Outage` is how a process that keeps running without the
database (or without disk space) logs and paces its retries.

The recorder, the jobs runner and the gateway ride out a database that is restarting, unreachable
or (SQLite) locked, and a full disk: they keep what they must write in memory, retry with
exponential backoff, and log one line when the outage starts and one when it ends
(docs/reliability.md "Database outage", "Disk full").
"""

from __future__ import annotations

import errno
import logging
import time

from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError

# First and longest pause between two tries while the database is away (s).
BACKOFF_S = (0.5, 5.0)


def database_unavailable(exc: BaseException) -> bool:
    """True when `exc` says the database cannot be used right now, so the same call may
    succeed later: server unreachable or restarting, a connection dropped under a statement,
    SQLite locked past busy_timeout or its disk full (DBAPI `OperationalError` /
    `InterfaceError`, or any DBAPIError SQLAlchemy classified as a disconnect). Integrity and
    data errors (a bad row) are not."""
    if isinstance(exc, OperationalError | InterfaceError):
        return True
    return isinstance(exc, DBAPIError) and bool(exc.connection_invalidated)


# errnos of a write the filesystem refused for room: no space, quota, file-size limit
_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
_SQLITE_FULL = 13  # SQLITE_FULL: "database or disk is full"
_PG_DISK_FULL = "53100"  # PostgreSQL SQLSTATE disk_full


def storage_full(exc: BaseException) -> bool:
    """True when `exc` is a write refused for want of room: an OSError ENOSPC / EDQUOT / EFBIG
    (a file-size limit), SQLite's SQLITE_FULL or PostgreSQL's disk_full. The same write may
    succeed once space is freed."""
    if isinstance(exc, OSError):
        return exc.errno in _FULL_ERRNOS
    orig = getattr(exc, "orig", None)
    if not isinstance(exc, DBAPIError) or orig is None:
        return False
    code = getattr(orig, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF == _SQLITE_FULL
    return getattr(orig, "sqlstate", None) == _PG_DISK_FULL


def can_wait_out(exc: BaseException) -> bool:
    """The database is unavailable or the disk full: pause and try again later."""
    return database_unavailable(exc) or storage_full(exc)


class Outage:
    """One process's view of a database outage.

    `failed(exc)` at each failed try returns the seconds to wait before the next one
    (`backoff` doubling from its first to its last value) and logs a warning at the first;
    `ok()` at a success logs the end with its length. `down_since` is the monotonic time (s)
    of the first failure, None while the database answers; `count` the outages so far.
    """

    def __init__(
        self, what: str, logger: logging.Logger, backoff: tuple[float, float] = BACKOFF_S
    ) -> None:
        self.what, self.logger, self.backoff = what, logger, backoff
        self.down_since: float | None = None
        self.full = False  # the outage began with a full disk, not an unreachable database
        self.count = 0
        self._delay = backoff[0]

    @property
    def down(self) -> bool:
        return self.down_since is not None

    def down_for(self) -> float:
        """Seconds since the outage began (0 when the database answers)."""
        return 0.0 if self.down_since is None else time.monotonic() - self.down_since

    def failed(self, exc: BaseException) -> float:
        """Note a failed try; the seconds to wait before the next one."""
        if self.down_since is None:
            self.down_since = time.monotonic()
            self.count += 1
            self._delay = self.backoff[0]
            reason = getattr(exc, "orig", None) or exc
            first = str(reason).strip().splitlines()[0] if str(reason).strip() else ""
            self.full = storage_full(exc)
            what = "the disk is full" if self.full else "the database is unavailable"
            self.logger.warning("%s (%s: %s); %s", what, type(reason).__name__, first, self.what)
            return self._delay
        self._delay = min(self._delay * 2, self.backoff[1])
        return self._delay

    def ok(self) -> None:
        """Note a successful call; logs the end of an outage."""
        if self.down_since is not None:
            what = "writes go through again" if self.full else "the database answers again"
            self.logger.warning("%s after %.1f s", what, self.down_for())
            self.down_since = None
