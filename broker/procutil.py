"""Process helpers shared by every long-running laneserve process (broker, workers, gateway,
recorder, dashboard): children poll their parent's pid and exit when it is gone (DESIGN.md,
"Processes"). Torch-free and import-light, like `broker.protocol`."""

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
