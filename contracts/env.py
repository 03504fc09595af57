"""The environment registry: every ``LANESERVE_*`` variable, its type, default and meaning.

Code reads the environment only through :func:`get` (or :func:`laneserve_home`), never with
``os.environ`` directly, so this table is the whole list (the README's configuration table and
``laneserve status`` can print it). Test-only knobs are marked ``test_only``.

Usage::

    from laneserve.contracts import env
    url = env.get("LANESERVE_DB_URL")          # None when unset
    home = env.laneserve_home()                 # Path, ~ expanded
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class EnvError(ValueError):
    """A registered variable holds a value that does not parse as its type."""


@dataclass(frozen=True, slots=True)
class EnvVar:
    name: str
    parse: Callable[[str], Any]
    default: Any
    meaning: str
    test_only: bool = False


def _path(raw: str) -> Path:
    return Path(raw).expanduser()


def _flag(raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected 0/1, got {raw!r}")


def _str(raw: str) -> str | None:
    return raw.strip() or None


_VARS: tuple[EnvVar, ...] = (
    EnvVar(
        "LANESERVE_HOME",
        _path,
        None,
        "models, SQLite database, files, ipc sockets, stack.json, keys (default ~/.laneserve)",
    ),
    EnvVar(
        "LANESERVE_DB_URL",
        _str,
        None,
        "SQLAlchemy URL of the database (default sqlite:///$LANESERVE_HOME/laneserve.db)",
    ),
    EnvVar(
        "LANESERVE_API_KEY", _str, None, "the user API key the gateway requires and clients send"
    ),
    EnvVar("LANESERVE_URL", _str, None, "base URL of a (remote) stack's HTTP API for the CLI"),
    EnvVar(
        "LANESERVE_RETENTION_DAYS",
        float,
        None,
        "age in days after which API request rows and snapshots (recorder), job files and "
        "job line bodies (jobs runner) are pruned; 0 keeps all (default 30)",
    ),
    EnvVar(
        "LANESERVE_ATTENTION_BACKEND",
        lambda s: s.strip().lower() or None,
        None,
        "torch or triton for every kernels op (default: by device)",
    ),
    EnvVar(
        "LANESERVE_MALLOC_TUNING",
        _flag,
        True,
        "0 leaves glibc malloc's defaults; otherwise CPU workers keep freed activations",
    ),
    EnvVar(
        "LANESERVE_CPU_KERNELS",
        _flag,
        True,
        "build and use the C++ CPU kernels (kernels/cpu_ext.py); 0 = the PyTorch path only",
    ),
    EnvVar(
        "LANESERVE_KQUANT_INT8",
        _flag,
        True,
        "0 keeps K-quant GGUF linears (Q4_K, Q5_K, Q6_K) off the int8 GEMV "
        "(kernels/csrc/kquant_q8k.cpp: activations rounded to int8 per 256, as llama.cpp): "
        "decode rows then run the exact fp32 GEMV; read at load too: with 1 on the AVX-512 "
        "VNNI route K-quant parts are repacked to the x16 layout (gpu_worker/kquant.py)",
    ),
    EnvVar(
        "LANESERVE_AMX",
        _flag,
        True,
        "0 keeps bf16 linears off the AMX matmuls (kernels/csrc/amx_matmul.cpp) on a CPU that has "
        "AMX-BF16: torch's int4 kernel, the GEMVs and the dense copy as elsewhere",
    ),
    EnvVar(
        "LANESERVE_RESTART_PROFILE",
        _path,
        None,
        "file where a worker keeps the start-up profile it uses, and a restart of it (same "
        "model and options) takes it back without profiling again (`laneserve up` sets one per "
        "worker)",
    ),
    EnvVar(
        "LANESERVE_STEP_COST_CACHE",
        _flag,
        True,
        "0 measures a worker's start-up step-cost profile on every start instead of reusing "
        "the one cached for this machine, model and options",
    ),
    EnvVar(
        "LANESERVE_INTERLEAVE",
        _flag,
        True,
        "0: a CPU worker runs no interactive step between the layers of a batch-only step "
        "(gpu_worker/interleave.py), so batch-only steps stay within the TTFT slack",
    ),
    EnvVar(
        "LANESERVE_STEP_TRACE",
        _path,
        None,
        "worker: append one JSON line per measured engine step (what the SLO controller saw, "
        "planned, predicted and measured) to this file",
    ),
    EnvVar(
        "LANESERVE_CPU_SINGLE_THREAD_TOKENS",
        int,
        None,
        "CPU steps of at most this many tokens run on one torch thread",
    ),
    EnvVar(
        "LANESERVE_PEERS_DIR",
        _path,
        None,
        "benchmark peers' venvs (scripts/setup_peers.sh; default ~/.cache/laneserve-peers)",
    ),
    EnvVar(
        "LANESERVE_CHROMIUM",
        _str,
        None,
        "path of the headless Chromium for browser tests",
        test_only=True,
    ),
    EnvVar(
        "LANESERVE_DASHBOARD_SCREENSHOT",
        _path,
        None,
        "folder the dashboard browser tests keep their screenshots in (default: pytest's tmp)",
        test_only=True,
    ),
    EnvVar(
        "LANESERVE_TEST_PG_URL", _str, None, "PostgreSQL URL for the postgres tests", test_only=True
    ),
    EnvVar(
        "LANESERVE_REQUIRE_ALL",
        _flag,
        False,
        "tests that would skip for a missing service fail instead (CI)",
        test_only=True,
    ),
    EnvVar(
        "LANESERVE_HYPOTHESIS_EXAMPLES",
        int,
        None,
        "examples per property test, random instead of the fixed CI set (default: CI budget)",
        test_only=True,
    ),
    EnvVar(
        "LANESERVE_FAULT_STEP",
        _str,
        None,
        "worker: an engine step holding a prompt with this text raises in the model call",
        test_only=True,
    ),
    EnvVar(
        "LANESERVE_FAULT_CRASH",
        _str,
        None,
        "worker: a request whose prompt has this text makes the worker exit",
        test_only=True,
    ),
    EnvVar(
        "LANESERVE_FAULT_SLOWDOWN",
        float,
        None,
        "worker: every model call takes this many times as long (SLO adaptation benchmark)",
        test_only=True,
    ),
    # Not ours, read to decide what laneserve sets (see gpu_worker/openmp.py, kernels/__init__.py)
    EnvVar(
        "OMP_WAIT_POLICY",
        _str,
        None,
        "libgomp wait policy, read when torch loads (default here: PASSIVE + a short spin)",
    ),
    EnvVar("GOMP_SPINCOUNT", _str, None, "libgomp spins before sleeping (default here: 3000)"),
    EnvVar("OMP_NUM_THREADS", _str, None, "OpenMP threads (`laneserve up` sets it per worker)"),
    EnvVar(
        "XDG_CACHE_HOME",
        _path,
        None,
        "user cache root (default ~/.cache): the step-cost cache, torch's extension cache",
    ),
    EnvVar("TRITON_INTERPRET", _flag, False, "Triton runs kernels in its CPU interpreter"),
    EnvVar("CUDA_VISIBLE_DEVICES", _str, None, "CUDA devices a process may use"),
    EnvVar("TORCH_EXTENSIONS_DIR", _path, None, "torch's C++ extension build root"),
    EnvVar("CXXFLAGS", _str, None, "compiler flags (part of the C++ kernels' build key)"),
    EnvVar("CFLAGS", _str, None, "compiler flags (part of the C++ kernels' build key)"),
    EnvVar("LDFLAGS", _str, None, "linker flags (part of the C++ kernels' build key)"),
)

REGISTRY: Mapping[str, EnvVar] = {var.name: var for var in _VARS}


def get(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """The parsed value of registered variable ``name`` (its default when unset or empty).

    Raises:
        KeyError: ``name`` is not registered (add it to ``_VARS`` with its meaning).
        EnvError: the value does not parse as the variable's type.
    """
    var = REGISTRY[name]
    raw = (os.environ if environ is None else environ).get(name)
    if raw is None or raw.strip() == "":
        return var.default
    try:
        return var.parse(raw)
    except ValueError as exc:
        raise EnvError(f"{name}={raw!r}: {exc}") from exc


def laneserve_home(environ: Mapping[str, str] | None = None) -> Path:
    """``$LANESERVE_HOME`` with ``~`` expanded, default ``~/.laneserve`` (not created here)."""
    return get("LANESERVE_HOME", environ) or Path.home() / ".laneserve"
