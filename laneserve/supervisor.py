"""A small process supervisor for `laneserve up`.

Each child is a command line (`ChildSpec`) started in its own session (so a terminal Ctrl-C
reaches only the supervisor, which then stops the children in order) with stdout/stderr appended
to `LOG_DIR/NAME.log`. `poll()` restarts a child that exited: at once after a stable run, then
with exponential backoff (`backoff_initial_s`, doubled per quick crash up to `backoff_max_s`, reset
once a child has stayed up for `stable_s`), and tells `on_exit` (so `laneserve up` can tell the
broker that a worker died without waiting for a heartbeat to fail). `stop()` never restarts
anything: it sends SIGTERM group by group (`stop_group` ascending: edges first, the recorder last
so it can flush), waits up to `stop_timeout_s` per group, then SIGKILLs what is left, including
grandchildren in each child's process group.

Children also get `--parent-pid` from their owner (`laneserve up`), so they exit on their own if
the supervisor is killed with SIGKILL (DESIGN.md "Processes").

Standby (`ChildSpec.standby`, the engine workers): once a child has run `stable_s`, a spare of it
starts (its argv plus `--standby`: it does its slow imports, then waits for a line on its stdin and
exits at end of file, so it never outlives the supervisor). When the child exits unasked after a
stable run, the spare takes over at once (it is sent the line) instead of a cold start; a new
spare starts once that one has run `stable_s`. A killed worker is back without paying for
Python's, torch's and transformers' imports (~4 s of a ~7 s start on a 2-core CPU).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ChildSpec:
    """One supervised command.

    name: unique label (log file `NAME.log`, key in stack.json's `children`).
    argv: the command line (argv[0] is looked up on PATH when not absolute).
    env: the full environment for the child (None: inherit).
    restart: restart after an unexpected exit.
    stop_group: children stop in ascending groups; same group -> stopped together.
    standby: keep a spare (`argv + ["--standby"]`) ready to take over (module docstring).
    """

    name: str
    argv: list[str]
    env: dict[str, str] | None = None
    restart: bool = True
    stop_group: int = 0
    standby: bool = False


@dataclass(slots=True)
class Child:
    spec: ChildSpec
    proc: subprocess.Popen | None = None
    started_at: float = 0.0  # time.monotonic()
    restarts: int = 0
    backoff_s: float = 0.0  # the delay of the last restart
    streak: int = 0  # exits in a row that came before `stable_s` of running
    restart_at: float | None = None  # monotonic time of the next start, None: not scheduled
    exit_codes: list[int] = field(default_factory=list)
    spare: subprocess.Popen | None = None  # the standby process (ChildSpec.standby)
    spare_at: float = 0.0  # monotonic time the last spare started
    handovers: int = 0  # restarts the spare took over

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None


class Supervisor:
    """Start, watch, restart and stop a set of child processes (not thread-safe: one owner)."""

    def __init__(
        self,
        specs: list[ChildSpec],
        log_dir: Path,
        *,
        backoff_initial_s: float = 1.0,
        backoff_max_s: float = 30.0,
        stable_s: float = 30.0,
        stop_timeout_s: float = 15.0,
        on_change: Callable[[Supervisor], None] | None = None,
        on_exit: Callable[[str, int, int], None] | None = None,
    ) -> None:
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"child names must be unique: {names}")
        self.children = {s.name: Child(s) for s in specs}
        self.log_dir = Path(log_dir)
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.stable_s = stable_s
        self.stop_timeout_s = stop_timeout_s
        self.on_change = on_change
        self.on_exit = on_exit  # (name, pid, exit code) of a child that exited unasked
        self.stopping = False

    # --------------------------------------------------------------------------- start

    def log_path(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def _popen(self, spec: ChildSpec, *, spare: bool = False) -> subprocess.Popen:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path(spec.name), "ab") as log:
            return subprocess.Popen(
                [*spec.argv, "--standby"] if spare else spec.argv,
                stdin=subprocess.PIPE if spare else subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=spec.env,
                start_new_session=True,
            )

    def _spawn(self, child: Child) -> None:
        child.proc = self._popen(child.spec)
        child.started_at = time.monotonic()
        child.restart_at = None
        logger.debug("started %s (pid %d)", child.spec.name, child.proc.pid)

    def _hand_over(self, child: Child) -> bool:
        """Make the child's spare the child (send it its go line); False when there is none
        alive to take over."""
        spare, child.spare = child.spare, None
        if spare is None or spare.poll() is not None:
            return False
        try:
            spare.stdin.write(b"go\n")
            spare.stdin.flush()
        except OSError:  # it died meanwhile
            _kill_group(spare.pid)
            spare.wait()
            return False
        child.proc, child.started_at, child.restart_at = spare, time.monotonic(), None
        child.handovers += 1
        return True

    def _keep_spare(self, child: Child, now: float) -> None:
        """Start the child's spare once the child has run `stable_s`; a spare that died is
        replaced `stable_s` after the last one started, never faster."""
        if child.spare is not None and child.spare.poll() is not None:
            child.spare = None
        if (
            child.spec.standby
            and child.spare is None
            and child.pid is not None
            and now - max(child.started_at, child.spare_at) >= self.stable_s
        ):
            child.spare, child.spare_at = self._popen(child.spec, spare=True), now
            # routine (every worker keeps one): DEBUG, not a line in `up`'s terminal after its
            # banner; a takeover is one of `poll`'s events
            logger.debug("%s: standby started (pid %d)", child.spec.name, child.spare.pid)
            self._changed()

    def standby_pids(self) -> dict[str, int]:
        """name -> pid of each live spare."""
        return {
            name: c.spare.pid
            for name, c in self.children.items()
            if c.spare is not None and c.spare.poll() is None
        }

    def start(self, names: list[str] | None = None) -> None:
        """Start the named children (default: all not yet started), in spec order."""
        if self.stopping:
            raise RuntimeError("supervisor is stopping")
        for name, child in self.children.items():
            if (names is None or name in names) and child.proc is None:
                self._spawn(child)
        self._changed()

    def pids(self) -> dict[str, int | None]:
        """name -> pid of the live process (None while down or waiting for a restart)."""
        return {name: child.pid for name, child in self.children.items()}

    # --------------------------------------------------------------------------- watch

    def poll(self) -> list[str]:
        """Reap exited children and (re)start those whose backoff has elapsed.

        Returns human-readable event lines (also logged). Does nothing while stopping."""
        if self.stopping:
            return []
        events: list[str] = []
        now = time.monotonic()
        changed = False
        for name, child in self.children.items():
            proc = child.proc
            if proc is not None and child.restart_at is None and proc.poll() is not None:
                code = proc.returncode
                child.exit_codes.append(code)
                up_s = now - child.started_at
                if not child.spec.restart:
                    events.append(f"{name} exited with {code}; not restarted")
                    child.restart_at = float("inf")
                    changed = True
                    continue
                if up_s >= self.stable_s:
                    child.streak = 0
                child.backoff_s = self._backoff(child.streak)
                child.streak += 1
                child.restart_at = now + child.backoff_s
                self._exited(name, proc.pid, code)
                events.append(
                    f"{name} (pid {proc.pid}) exited with {code} after {up_s:.1f}s; "
                    f"restarting in {child.backoff_s:.1f}s (log: {self.log_path(name)})"
                )
                changed = True
            if child.restart_at is not None and now >= child.restart_at:  # at once after 0 s
                child.restarts += 1
                how = "its standby took over"
                if not self._hand_over(child):
                    self._spawn(child)
                    how = "restarted"
                events.append(f"{name} {how} (pid {child.proc.pid}, restart #{child.restarts})")
                changed = True
            self._keep_spare(child, now)
        for line in events:
            logger.warning("%s", line)
        if changed:
            self._changed()
        return events

    def _backoff(self, streak: int) -> float:
        """Seconds before a restart: none after a stable run (a killed worker's lines wait for
        it), then `backoff_initial_s` doubled per quick crash up to `backoff_max_s`."""
        if streak == 0:
            return 0.0
        return min(self.backoff_max_s, self.backoff_initial_s * 2 ** (streak - 1))

    def _exited(self, name: str, pid: int, code: int) -> None:
        if self.on_exit is None:
            return
        try:
            self.on_exit(name, pid, code)
        except Exception:  # a failing callback must not kill the supervisor
            logger.exception("supervisor on_exit callback failed")

    def exited(self, name: str) -> int | None:
        """The exit code when `name` is down (and not yet restarted), else None."""
        proc = self.children[name].proc
        return None if proc is None else proc.poll()

    def _changed(self) -> None:
        if self.on_change is not None:
            try:
                self.on_change(self)
            except Exception:  # a failing callback (disk full) must not kill the supervisor
                logger.exception("supervisor on_change callback failed")

    # --------------------------------------------------------------------------- stop

    def stop(self) -> dict[str, int | None]:
        """Stop every child (SIGTERM per group, SIGKILL after `stop_timeout_s`); never restarts.

        Returns name -> exit code (negative: killed by that signal)."""
        self.stopping = True
        groups = sorted({c.spec.stop_group for c in self.children.values()})
        for group in groups:
            members = [c for c in self.children.values() if c.spec.stop_group == group]
            for child in members:
                if child.proc is not None and child.proc.poll() is None:
                    _signal(child.proc.pid, signal.SIGTERM)
            deadline = time.monotonic() + self.stop_timeout_s
            for child in members:
                if child.proc is None:
                    continue
                try:
                    child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    logger.warning("%s did not stop in time; killing it", child.spec.name)
                    _kill_group(child.proc.pid)
                    child.proc.wait()
        for child in self.children.values():  # grandchildren left in a child's group
            if child.proc is not None:
                _kill_group(child.proc.pid)
            if child.spare is not None:  # waiting for its go line: nothing to finish
                _kill_group(child.spare.pid)
                child.spare.wait()
        return {
            name: (c.proc.returncode if c.proc is not None else None)
            for name, c in self.children.items()
        }


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _kill_group(pgid: int) -> None:
    """SIGKILL a child's process group (it is the group leader: started in a new session)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
