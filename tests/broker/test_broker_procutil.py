"""broker.procutil.pid_alive: live, gone and zombie processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from broker.procutil import pid_alive


def test_pid_alive_live_gone_and_zombie():
    assert pid_alive(os.getpid())
    assert not pid_alive(None) and not pid_alive(0) and not pid_alive(-1)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    # exited but not reaped (no wait() yet): a zombie, which must count as gone
    while pid_alive(child.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(child.pid)
    with open(f"/proc/{child.pid}/stat", "rb") as f:
        assert f.read().rsplit(b")", 1)[1].split()[0] == b"Z"  # it really is a zombie
    child.wait()
    assert not pid_alive(child.pid)
