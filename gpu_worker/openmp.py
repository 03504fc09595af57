"""The OpenMP wait policy of engine processes (torch's CPU thread pool is GNU libgomp).

libgomp reads ``OMP_WAIT_POLICY`` and ``GOMP_SPINCOUNT`` once, when the library loads, which is
when torch is imported; setting them afterwards changes nothing in that process. So the policy is
applied by the entry points before they import torch (`apply_openmp_policy`: the worker command,
the offline `LLM`) and put in the environment of the children `laneserve up` starts
(`policy_env`); importing `gpu_worker` changes nothing.

Why a short spin:

- libgomp's default spins ~3 ms at every barrier, which makes torch's CPU ops 10-30x slower when
  another process holds a core (0.4 ms -> 20 ms for a [4, 576] x [576, 1536] matmul);
- a fully passive team pays ~40 us to wake its threads at *every* parallel region (a bf16
  batch-64 decode step of SmolLM2: 160 ms);
- a short spin (3000 iterations, ~30 us) catches the next op's region while the threads are still
  awake (the same step: 97 ms) and gives the core up soon after.

That short spin is for a process that shares the cores: the worker that `laneserve up` starts
beside the broker, the API server and the dashboard. The offline `LLM` owns them
(``exclusive=True``): its threads spin at every barrier (``OMP_WAIT_POLICY=ACTIVE``). On a
2-core Sapphire Rapids machine, laneserve alone, the two policies alternated
(`scripts/bench_offline.py`, four pairs): offline 223 / 283 / 323 / 319 tok/s active against
201 / 198 / 283 / 221 with the short spin, single stream 58 / 77 / 80 / 64 against
50 / 59 / 76 / 54 (the issue that asked for this measured 407 vs 299 there); a longer spin
(``GOMP_SPINCOUNT=30000``) was no better than the short one.

An explicit ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` in the environment wins (the test suite,
which runs many processes on 2 cores, sets both to passive).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping

from laneserve.contracts import env

logger = logging.getLogger(__name__)

DEFAULT_WAIT_POLICY = "PASSIVE"
DEFAULT_GOMP_SPINCOUNT = "3000"
EXCLUSIVE_WAIT_POLICY = "ACTIVE"
POLICY_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def policy_env(
    environ: Mapping[str, str] | None = None, *, exclusive: bool = False
) -> dict[str, str]:
    """The variables to add to `environ` (default: this process's) for the short-spin policy, or
    with `exclusive` (a process that owns the cores: the offline `LLM`) the spinning one: none
    when it sets either variable already."""
    if any(env.get(name, environ) for name in POLICY_VARIABLES):
        return {}
    if exclusive:
        return {"OMP_WAIT_POLICY": EXCLUSIVE_WAIT_POLICY}
    return {"OMP_WAIT_POLICY": DEFAULT_WAIT_POLICY, "GOMP_SPINCOUNT": DEFAULT_GOMP_SPINCOUNT}


def apply_openmp_policy(*, exclusive: bool = False) -> bool:
    """Put the policy (`policy_env`) in this process's environment before torch loads; returns
    whether the process runs under it (False: torch was imported first, libgomp kept what it
    read then)."""
    extra = policy_env(exclusive=exclusive)
    if "torch" in sys.modules:
        if extra:
            logger.debug("torch loaded before the OpenMP policy was set; libgomp keeps its own")
        return not extra
    os.environ.update(extra)
    return True


def openmp_is_purely_passive(environ: Mapping[str, str] | None = None) -> bool:
    """Whether libgomp's threads sleep at once at a barrier (no spin before sleeping)."""
    spin = env.get("GOMP_SPINCOUNT", environ)
    if spin is not None:
        return spin == "0"
    return (env.get("OMP_WAIT_POLICY", environ) or "").upper() == "PASSIVE"
