"""Process helpers shared by every long-running laneserve process (broker, workers, gateway,
recorder, jobs runner, dashboard, ``up``): children poll their parent's pid and exit when it is
gone (DESIGN.md, "Processes"). Torch-free and import-light.

One rule for "my parent is gone" (:func:`parent_gone`), used by every process that watches one.
"""

from __future__ import annotations

import os


def pid_alive(pid: int | None) -> bool:
    """True when a process with this pid exists (signal-0 probe; a pid we may not signal counts).

    A zombie (exited, not yet reaped by its parent) answers the probe but counts as gone: a child
    whose parent died unreaped, or `laneserve status` looking at a killed child, must see it dead.
    """
    if not pid or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):  # no /proc (not Linux) or the process just went away
        return True


def parent_gone(parent_pid: int | None) -> bool:
    """True when the watched parent process `parent_pid` no longer lives; False when none is watched.

    While `parent_pid` is still our direct parent (``os.getppid()``) it is alive, with no probe. A
    process whose parent dies is re-parented at once, so ``getppid`` changes; the watched pid may
    also be a grandparent (a supervisor that launched us through another process), so a changed
    ``getppid`` is confirmed with :func:`pid_alive` (a zombie counts as gone).
    """
    if not parent_pid:
        return False
    return os.getppid() != parent_pid and not pid_alive(parent_pid)
