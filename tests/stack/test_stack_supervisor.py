"""The supervisor and stack.json on real (tiny) child processes; no model."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest

from laneserve import stack
from laneserve.commands.up import parse_lanes
from laneserve.commands.up_host import threads_per_worker
from laneserve.supervisor import ChildSpec, Supervisor

PY = sys.executable


def wait_for(predicate, timeout_s: float = 15.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"{what} not met within {timeout_s}s")


def test_stack_file_roundtrip_and_staleness(tmp_path):
    assert stack.read_stack(tmp_path) is None
    stack.write_stack({"state": "ready", "supervisor_pid": os.getpid(), "api_url": "u"}, tmp_path)
    assert oct((tmp_path / "stack.json").stat().st_mode & 0o777) == "0o600"  # holds the db url
    info = stack.running_stack(tmp_path)
    assert info["api_url"] == "u" and info["version"] == stack.STACK_VERSION
    # A supervisor that is gone makes the file stale.
    dead = subprocess.Popen([PY, "-c", "pass"])
    dead.wait()
    stack.write_stack({"state": "ready", "supervisor_pid": dead.pid}, tmp_path)
    assert stack.running_stack(tmp_path) is None
    with pytest.raises(stack.StackNotRunningError, match="laneserve up"):
        stack.require_stack(tmp_path)
    # Only the owner removes it; a starting stack is not "ready".
    stack.write_stack({"state": "starting", "supervisor_pid": os.getpid()}, tmp_path)
    assert stack.running_stack(tmp_path) is None
    assert stack.running_stack(tmp_path, ready=False) is not None
    stack.remove_stack(dead.pid, tmp_path)
    assert stack.read_stack(tmp_path) is not None
    stack.remove_stack(os.getpid(), tmp_path)
    assert stack.read_stack(tmp_path) is None


def test_crashing_child_restarts_with_growing_backoff(tmp_path):
    starts = tmp_path / "starts"
    code = f"open({str(starts)!r}, 'a').write('x'); raise SystemExit(3)"
    sup = Supervisor(
        [ChildSpec("crasher", [PY, "-c", code])],
        tmp_path / "logs",
        backoff_initial_s=0.2,
        backoff_max_s=0.8,
        stable_s=60,
    )
    changes = []
    sup.on_change = lambda s: changes.append(s.pids())
    sup.start()
    backoffs = []
    deadline = time.monotonic() + 20
    while sup.children["crasher"].restarts < 4 and time.monotonic() < deadline:
        sup.poll()
        b = sup.children["crasher"].backoff_s
        if not backoffs or backoffs[-1] != b:
            backoffs.append(b)
        time.sleep(0.02)
    sup.stop()
    child = sup.children["crasher"]
    assert child.restarts >= 4
    assert backoffs[:4] == [0.0, 0.2, 0.4, 0.8]  # doubled per crash, capped
    assert set(child.exit_codes) == {3}
    assert child.restarts <= len(starts.read_text()) <= child.restarts + 1  # real new processes
    assert len(changes) >= 4  # stack.json would be rewritten with each new pid


def test_stop_never_restarts_and_kills_stubborn_groups(tmp_path):
    grandchild_pid = tmp_path / "gc.pid"
    stubborn = (
        "import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN);"
        f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']);"
        f"open({str(grandchild_pid)!r}, 'w').write(str(p.pid)); time.sleep(120)"
    )
    sup = Supervisor(
        [
            ChildSpec("edge", [PY, "-c", "import time; time.sleep(120)"], stop_group=0),
            ChildSpec("stubborn", [PY, "-c", stubborn], stop_group=1),
        ],
        tmp_path / "logs",
        stop_timeout_s=2.0,
    )
    sup.start()
    gc = int(wait_for(lambda: grandchild_pid.exists() and grandchild_pid.read_text(), what="gc"))
    pids = sup.pids()
    t0 = time.monotonic()
    codes = sup.stop()
    assert time.monotonic() - t0 < 10
    assert codes["edge"] == -15 and codes["stubborn"] == -9
    wait_for(lambda: not any(_not_zombie(p) for p in [*pids.values(), gc]), 5, "all gone")
    assert sup.poll() == [] and sup.pids() == {"edge": None, "stubborn": None}


def _not_zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_standby_takes_over_a_killed_child_and_never_outlives_the_supervisor(tmp_path):
    """A stable child gets a spare (argv + --standby, waiting on stdin); when the child is
    killed the spare takes over at once (same log), a new spare follows once it has run
    stable_s, and stop() leaves no spare behind."""
    events = tmp_path / "events"
    code = (
        "import os, sys, time\n"
        f"log = lambda w: open({str(events)!r}, 'a').write(f'{{w}} {{os.getpid()}}\\n')\n"
        "if '--standby' in sys.argv:\n"
        "    log('spare')\n"
        "    if not sys.stdin.readline(): log('eof'); sys.exit(0)\n"
        "    log('took-over')\n"
        "else:\n"
        "    log('started')\n"
        "time.sleep(120)\n"
    )
    sup = Supervisor([ChildSpec("w", [PY, "-c", code], standby=True)], tmp_path, stable_s=0.5)
    sup.start()
    first = sup.pids()["w"]

    def spare():
        sup.poll()
        return sup.standby_pids().get("w")

    spare_pid = wait_for(spare, what="a spare")
    wait_for(lambda: f"spare {spare_pid}" in events.read_text(), what="the spare's imports")
    os.kill(first, 9)
    wait_for(lambda: sup.poll() or sup.pids()["w"] == spare_pid, what="the handover")
    wait_for(lambda: f"took-over {spare_pid}" in events.read_text(), what="the go line")
    assert sup.children["w"].handovers == 1 and sup.children["w"].restarts == 1
    second = wait_for(lambda: spare() not in (None, spare_pid) and spare(), what="a new spare")
    sup.stop()
    wait_for(lambda: not any(_not_zombie(p) for p in (first, spare_pid, second)), 5, "all gone")
    assert "started" in events.read_text().splitlines()[0]
    assert sup.standby_pids() == {}
    # without ChildSpec.standby no spare is started
    plain = Supervisor([ChildSpec("p", [PY, "-c", code])], tmp_path / "p", stable_s=0.1)
    plain.start()
    time.sleep(0.4)
    plain.poll()
    assert plain.standby_pids() == {}
    plain.stop()


def test_duplicate_names_rejected(tmp_path):
    with pytest.raises(ValueError, match="unique"):
        Supervisor([ChildSpec("a", ["true"]), ChildSpec("a", ["true"])], tmp_path)


def test_parse_lanes_and_threads():
    assert parse_lanes("interactive,batch", 2) == [["interactive", "batch"]] * 2
    assert parse_lanes("interactive;batch", 2) == [["interactive"], ["batch"]]
    with pytest.raises(ValueError, match="2 workers"):
        parse_lanes("interactive;batch;batch", 2)
    with pytest.raises(ValueError, match="lanes"):
        parse_lanes("interactive,bulk", 1)
    assert threads_per_worker(2, 1) == 2  # one worker uses every core
    assert threads_per_worker(16, 1) == 16
    assert threads_per_worker(16, 4) == 4
    assert threads_per_worker(3, 2) == 1
    assert threads_per_worker(1, 3) == 1


def test_up_rejects_bad_options_before_starting_anything(tmp_path):
    from tests.harness import laneserve

    for args, needle in (
        (["--kv-cache-memory", "lots"], "--kv-cache-memory"),
        (["--max-num-seqs", "0"], "--max-num-seqs"),
        (["--workers", "2", "--lanes", "interactive;bulk"], "--lanes"),
        (["--api-port", "99999"], "--api-port: port 99999 is not in 0..65535"),
        (["--dashboard-port", "-1"], "--dashboard-port"),
    ):
        res = laneserve(tmp_path, "up", "--synthetic", *args, timeout=60)
        assert res.returncode == 2 and needle in res.stderr, res.stderr
    assert not (tmp_path / "stack.json").exists() and not (tmp_path / "logs").exists()


def test_a_port_left_in_time_wait_by_a_stopped_stack_is_free():
    """The side that closes a connection first keeps its port in TIME_WAIT for up to a
    minute; `laneserve up` right after a stack stopped once refused its own port for that
    long, though the API's listener (SO_REUSEADDR) binds it at once."""
    import socket

    from laneserve.commands.up_host import port_free

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    served, _ = listener.accept()
    served.close()  # the server closes first: its port goes to TIME_WAIT
    client.recv(1)
    client.close()
    listener.close()
    with socket.socket() as plain:  # what the check once did, and failed
        with pytest.raises(OSError):
            plain.bind(("127.0.0.1", port))
    assert port_free(port)
    with socket.create_server(("127.0.0.1", port)):  # a listener there: not free
        assert not port_free(port)


def _up_specs(tmp_path, *argv: str) -> dict:
    """The child specs `laneserve up ARGV` builds (no process started)."""
    import argparse

    from laneserve.commands import up
    from laneserve.gpu_worker.config import EngineConfig

    parser = argparse.ArgumentParser()
    up.add_arguments(parser)
    args = parser.parse_args(list(argv))
    plan = {
        "home": tmp_path, "front": "ipc://f", "back": "ipc://b", "recorder_addr": "ipc://r",
        "db_url": "sqlite://", "lanes": [["batch"]], "engine": EngineConfig(), "threads": 1,
        "gpus": 0, "liveness": 5, "api_port": 1, "dashboard_port": None, "api_key": None,
    }  # fmt: skip
    return {s.name: s for s in up.build_specs(args, plan)}


def test_up_jobs_runners_start_with_distinct_stable_lease_ids(tmp_path):
    argv = ("--jobs-runners", "3", "--synthetic")
    runners = [s for n, s in _up_specs(tmp_path, *argv).items() if n.startswith("jobs-runner")]
    assert [s.name for s in runners] == ["jobs-runner-0", "jobs-runner-1", "jobs-runner-2"]
    ids = [s.argv[s.argv.index("--runner-id") + 1] for s in runners]
    assert len(set(ids)) == 3 and all(i.endswith(s.name) for i, s in zip(ids, runners, strict=True))
    # Built again (a restart), each runner keeps its lease id.
    again = [s for n, s in _up_specs(tmp_path, *argv).items() if n.startswith("jobs-runner")]
    assert [s.argv[s.argv.index("--runner-id") + 1] for s in again] == ids


def test_up_passes_tool_call_parser_to_the_gateway_and_the_jobs_runner(tmp_path):
    import argparse

    from laneserve.commands import api, jobs_runner

    specs = _up_specs(tmp_path, "--tool-call-parser", "llama3_json", "--no-dashboard")
    commands = argparse.ArgumentParser().add_subparsers()
    api.register(commands)
    jobs_runner.register(commands)
    gateway = commands.choices["api"].parse_args(specs["api"].argv[3:])
    assert api.build_config(gateway).tool_call_parser == "llama3_json"
    runner = commands.choices["jobs-runner"].parse_args(specs["jobs-runner"].argv[3:])
    assert runner.tool_call_parser == "llama3_json"
    with pytest.raises(SystemExit):  # only vLLM's names
        _up_specs(tmp_path, "--tool-call-parser", "pythonic")
