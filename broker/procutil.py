"""Process helpers shared by every long-running laneserve process (broker, workers, gateway,
recorder, dashboard): children poll their parent's pid and exit when it is gone (DESIGN.md,
"Processes"). Torch-free and import-light, like `broker.protocol`."""

from __future__ import annotations

import os


def pid_alive(pid: int | None) -> bool:
    """True if a process with this pid exists (signal-0 probe; a pid we may not signal counts)."""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
