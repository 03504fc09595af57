"""Default broker endpoints: ``ipc://`` sockets in a 0700 directory under ``$LANESERVE_HOME``.

Unix socket paths are limited to about 107 bytes (``sun_path``); DESIGN.md asks for paths under
100 bytes. When ``$LANESERVE_HOME`` is too deep, the sockets go to a 0700 directory under the
system temp dir named after a hash of the home path instead.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

from laneserve.contracts.env import laneserve_home

MAX_IPC_PATH = 100


def run_dir() -> Path:
    """A 0700 directory for ipc sockets (created if missing)."""
    home = laneserve_home()
    path = home / "run"
    if len(str(path / "broker-front.sock")) >= MAX_IPC_PATH:
        digest = hashlib.sha256(str(home.resolve()).encode()).hexdigest()[:16]
        path = Path(tempfile.gettempdir()) / f"laneserve-{os.getuid()}-{digest}"
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path, 0o700)
    return path


def default_front() -> str:
    return f"ipc://{run_dir() / 'broker-front.sock'}"


def default_back() -> str:
    return f"ipc://{run_dir() / 'broker-back.sock'}"


def is_local_endpoint(addr: str) -> bool:
    """True when a ZMQ endpoint is reachable only from this host: ``ipc://``, ``inproc://`` or
    ``tcp://`` on a loopback address (127.0.0.0/8, ``localhost``, ``::1``). Wildcards (``*``,
    ``0.0.0.0``), interface names and other hosts are not local."""
    import ipaddress

    scheme, _, rest = addr.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    if scheme != "tcp" or not rest:
        return False
    host = rest.rsplit(":", 1)[0] if ":" in rest else rest
    host = host.split(";")[-1].strip("[]")  # "src;dst" connect syntax: the destination
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
