"""Security (issue 11, items 13 and 14): loopback/ipc by default, CurveZMQ for remote workers,
no pickle anywhere on a socket path.

Process tests use the synthetic worker (they need a registered, serving worker, not real tokens).
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from laneserve.broker import protocol as p
from laneserve.broker.broker import Broker, BrokerConfig
from laneserve.broker.client import BrokerClient
from laneserve.broker.curve import CurveKeyError, generate_keys, load_public, load_secret
from tests.harness import ROOT, Stack, free_port, run, wait_for


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# ---------------------------------------------------------------------------------- keys


def test_keys_generate_writes_private_files(laneserve_home) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "laneserve.cli", "keys", "generate", "--client", "gpu1", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert out.returncode == 0, out.stderr
    import json

    paths = json.loads(out.stdout)
    keys = laneserve_home / "keys"
    assert Path(paths["keys_dir"]) == keys
    for d in (keys, keys / "allowed", keys / "clients"):
        assert _mode(d) == 0o700, d
    files = [p for p in keys.rglob("*") if p.is_file()]
    assert sorted(p.name for p in files) == [
        "gpu1.key",
        "gpu1.key_secret",
        "server.key",
        "server.key_secret",
    ]
    assert all(_mode(f) == 0o600 for f in files), [(f, oct(_mode(f))) for f in files]
    pub, sec = load_secret(paths["clients"]["gpu1"])
    assert load_public(keys / "allowed" / "gpu1.key") == pub and len(sec) == 40
    server_pub = load_public(paths["server_public"])
    # a second run adds a client and keeps the server key
    again = generate_keys(keys, ["gpu2"])
    assert load_public(again.server_public) == server_pub
    assert sorted(x.name for x in (keys / "allowed").iterdir()) == ["gpu1.key", "gpu2.key"]


def test_keys_reject_bad_names_and_open_secret_files(tmp_path) -> None:
    with pytest.raises(CurveKeyError):
        generate_keys(tmp_path / "k", ["../evil"])
    paths = generate_keys(tmp_path / "k", ["w"])
    os.chmod(paths.clients["w"], 0o644)
    with pytest.raises(CurveKeyError, match="readable by others"):
        load_secret(paths.clients["w"])
    with pytest.raises(CurveKeyError, match="no CURVE secret"):
        load_secret(paths.allow_dir / "w.key")


def test_allow_list_follows_the_directory(tmp_path) -> None:
    from laneserve.broker.curve import ZAP_DOMAIN, AllowList

    keys = generate_keys(tmp_path / "k", ["a", "b"])
    allow = AllowList(keys.allow_dir)
    key_a = load_public(keys.allow_dir / "a.key")
    key_c = load_public(generate_keys(tmp_path / "k", ["c"]).allow_dir / "c.key")
    assert allow.callback(ZAP_DOMAIN, key_a) and allow.callback(ZAP_DOMAIN, key_c)
    (keys.allow_dir / "a.key").unlink()  # revoke a
    assert not allow.callback(ZAP_DOMAIN, key_a)
    assert not allow.callback(ZAP_DOMAIN, b"x" * 40)
    assert allow.refused == 2


# ---------------------------------------------------------------------------------- binding


def test_broker_refuses_non_loopback_back_without_curve(tmp_path) -> None:
    for back in ("tcp://0.0.0.0:5999", "tcp://*:5999", "tcp://10.1.2.3:5999"):
        with pytest.raises(ValueError, match="CurveZMQ"):
            Broker(BrokerConfig(front=f"ipc://{tmp_path}/f.sock", back=back))
    with pytest.raises(ValueError, match="both"):
        Broker(
            BrokerConfig(
                front=f"ipc://{tmp_path}/f.sock",
                back="tcp://127.0.0.1:0",
                curve_allow=str(tmp_path),
            )
        )


def _listening_inet(pid: int) -> list[str]:
    conns = psutil.Process(pid).net_connections(kind="inet")
    return [f"{c.laddr.ip}:{c.laddr.port}" for c in conns if c.status == psutil.CONN_LISTEN]


@pytest.mark.slow
def test_default_endpoints_are_ipc_in_private_dir(laneserve_home) -> None:
    """`laneserve broker` without address flags binds ipc:// sockets in a 0700 directory under
    $LANESERVE_HOME and listens on no TCP port at all; a worker with defaults finds it."""
    tmp = Path(tempfile.mkdtemp(prefix="lsy", dir="/tmp"))
    stack = Stack(tmp)
    stack.env["LANESERVE_HOME"] = str(laneserve_home)
    try:
        broker = stack.spawn("broker", ["laneserve.commands.broker"])
        run_dir = laneserve_home / "run"
        wait_for(lambda: (run_dir / "broker-back.sock").exists(), 30, "the ipc sockets")
        assert _mode(run_dir) == 0o700
        assert stat.S_ISSOCK((run_dir / "broker-front.sock").stat().st_mode)
        assert _listening_inet(broker.pid) == []
        stack.front = f"ipc://{run_dir / 'broker-front.sock'}"
        stack.spawn("worker", ["laneserve.commands.worker", "--synthetic", "--worker-id", "d1"])
        stack.wait_workers({"d1"})
        assert _listening_inet(stack.procs["worker"].pid) == []
        log = stack.log("broker")
        assert re.search(r"front ipc://\S+ back ipc://\S+", log), log[-2000:]
    finally:
        stack.stop()
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------------------------- CURVE


@pytest.mark.slow
def test_curve_allows_listed_worker_and_refuses_the_others(tmp_path) -> None:
    """Back socket on TCP loopback as a CURVE server with an allow-list. Four real workers:
    `good` (listed key) registers and serves a request; `nokey` (no CURVE), `stranger` (a valid
    key pair that is not on the list) and `impostor-broker` (listed key, wrong server public key)
    never register, while the broker keeps running and counts the refusals."""
    keys = generate_keys(tmp_path / "keys", ["good"])
    other = generate_keys(tmp_path / "other", ["stranger"])
    tmp = Path(tempfile.mkdtemp(prefix="lsc", dir="/tmp"))
    stack = Stack(tmp)
    back = f"tcp://127.0.0.1:{free_port()}"
    try:
        curve = [
            "--curve-server-key",
            str(keys.server_secret),
            "--curve-allow",
            str(keys.allow_dir),
        ]
        stack.start_broker("--back", back, *curve)
        good = ["--curve-server-public", str(keys.server_public)]
        stack.start_worker(
            "good", *good, "--curve-client-key", str(keys.clients["good"]), back=back
        )
        stack.start_worker("nokey", back=back)
        stack.start_worker(
            "stranger", *good, "--curve-client-key", str(other.clients["stranger"]), back=back
        )
        stack.start_worker(
            "impostor-broker",
            "--curve-server-public",
            str(other.server_public),
            "--curve-client-key",
            str(keys.clients["good"]),
            back=back,
        )
        stack.wait_workers({"good"})

        async def ask():
            async with BrokerClient(stack.front) as c:
                deltas, final = [], None
                async for msg in c.submit(prompt="hello", sampling_params={"max_tokens": 5}):
                    if isinstance(msg, p.Delta):
                        deltas.append(msg)
                    else:
                        final = msg
                return deltas, final

        deltas, final = run(ask(), timeout_s=30)
        assert isinstance(final, p.Final) and final.worker_id == "good", final
        assert len(deltas) == 5

        def refused():
            st = stack.status()
            return st if st["counters"].get("curve_refused", 0) >= 2 else None

        wait_for(refused, 20, "two refused CURVE handshakes")
        time.sleep(2.0)  # several reconnect attempts each
        st = stack.status()
        assert [w["worker_id"] for w in st["workers"]] == ["good"], st["workers"]
        assert st["counters"].get("unknown_worker_messages", 0) == 0  # nothing got through
        for name in ("nokey", "stranger", "impostor-broker"):
            assert stack.alive(f"worker-{name}"), stack.logs()
        assert stack.alive("broker")
        for name in ("stranger", "impostor-broker"):
            assert "refused the connection" in stack.log(f"worker-{name}"), stack.logs()
        assert "refused CURVE client key" in stack.log("broker")
    finally:
        stack.stop()
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------------------------- pickle

_PICKLE = re.compile(
    r"^\s*(import|from)\s+(pickle|_pickle|cPickle|dill|cloudpickle|joblib|shelve|marshal)\b"
    r"|\b(pickle|_pickle|cloudpickle|dill|marshal)\.(loads?|dumps?|Unpickler|Pickler)\b"
    r"|\b(recv_pyobj|send_pyobj|recv_serialized|send_serialized)\b"
    r"|\btorch\.load\([^)]*weights_only\s*=\s*False"
)


def _python_sources() -> list[Path]:
    """Every .py file of the project tree that ships or runs (all packages, scripts), found
    by walking the repository rather than a fixed package list; tests are excluded (one test
    pickles an exception on purpose to check it round-trips)."""
    skip = {".git", "tests", "build", "dist", ".venv", "venv", "node_modules", "__pycache__"}
    out = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if d not in skip and not d.endswith(".egg-info")]
        out += [Path(dirpath) / f for f in filenames if f.endswith(".py")]
    return out


def test_no_pickle_anywhere_in_the_tree() -> None:
    files = _python_sources()
    tops = {f.relative_to(ROOT).parts[0] for f in files}
    assert {"broker", "gpu_worker", "kernels", "dashboard", "laneserve", "scripts"} <= tops, tops
    offenders = []
    for path in files:
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if _PICKLE.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{lineno}: {line.strip()}")
    assert offenders == [], "pickle is forbidden on any socket path:\n" + "\n".join(offenders)


def test_pickle_pattern_catches_the_usual_forms() -> None:
    for bad in (
        "import pickle",
        "from cloudpickle import dumps",
        "obj = pickle.loads(frames[1])",
        "sock.send_pyobj(x)",
        "torch.load(f, weights_only=False)",
    ):
        assert _PICKLE.search(bad), bad
    for ok in ("msgpack.unpackb(b)", "# no pickling here", "torch.load(f, weights_only=True)"):
        assert not _PICKLE.search(ok), ok
