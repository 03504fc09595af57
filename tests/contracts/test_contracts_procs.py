"""contracts.procs: pid_alive (live, gone and zombie processes) and the one parent-watch rule."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from laneserve.contracts.procs import parent_gone, pid_alive


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


def test_parent_gone_for_live_and_dead_pids():
    assert not parent_gone(None) and not parent_gone(0)
    assert not parent_gone(os.getppid())  # our direct parent
    assert not parent_gone(os.getpid())  # alive, though not our parent (a supervisor further up)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert parent_gone(child.pid)


@pytest.mark.slow
def test_orphaned_grandchild_sees_its_watched_parent_gone(tmp_path):
    """A process watching a middle process notices within a second of that process being killed."""
    flag = tmp_path / "gone"
    grandchild = textwrap.dedent(f"""
        import os, sys, time
        from laneserve.contracts.procs import parent_gone
        watched = os.getppid()
        print("ready", flush=True)
        deadline = time.monotonic() + 60
        while not parent_gone(watched) and time.monotonic() < deadline:
            time.sleep(0.05)
        if parent_gone(watched):
            open({str(flag)!r}, "w").write(str(watched))
    """)
    middle = textwrap.dedent(f"""
        import subprocess, sys, time
        p = subprocess.Popen([sys.executable, "-c", {grandchild!r}], stdout=subprocess.PIPE)
        assert p.stdout.readline().strip() == b"ready"
        print(p.pid, flush=True)
        time.sleep(120)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    mid = subprocess.Popen([sys.executable, "-c", middle], stdout=subprocess.PIPE, env=env)
    grandchild_pid = None
    try:
        grandchild_pid = int(mid.stdout.readline())
        assert not flag.exists()
        mid.kill()
        mid.wait()
        deadline = time.monotonic() + 10
        while not flag.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert flag.read_text() == str(mid.pid)
    finally:
        if pid_alive(grandchild_pid):
            os.kill(grandchild_pid, 9)
