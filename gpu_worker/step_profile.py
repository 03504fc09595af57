"""The SLO controller's start-up profile and its cache: `profile_engine` builds the
`BudgetController` for an engine from a step-cost prior that it measures (`measure_step_cost_prior`:
a few rounds of idle decodes, decode batches and prefills, fitted by least squares) or reads back
from the step-cost cache (``$XDG_CACHE_HOME/laneserve/step_cost``, keyed by everything a step's
cost depends on: `step_cost_cache_key`), checked against a few idle decode steps timed now
(`steps_agree`). A worker restarted by `laneserve up` (`LANESERVE_RESTART_PROFILE`) takes back the
profile its previous start used without timing anything: it restarts mid-traffic, when an idle
check would disagree and profile again for seconds while its requeued lines wait. See
gpu_worker/step_budget.py for the controller itself.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

from laneserve.contracts import env
from laneserve.gpu_worker.hardware import cpu_identity
from laneserve.gpu_worker.slo import parse_slo
from laneserve.gpu_worker.step_budget import TYPICAL_PROMPT, BudgetController, default_targets
from laneserve.gpu_worker.step_cost import (
    NUM_FEATURES,
    StepCostModel,
    StepFeatures,
    fit_least_squares,
)

logger = logging.getLogger(__name__)

# (prompt tokens, requests, output tokens): an idle stream, a decode batch, prefills, and decodes
# over a longer context (five steps of 4 rows at ~1k tokens: with one such step the context
# coefficient rested on a single timing, 0-3.2 ms/ktoken in four profiles of one quiet process)
_PROFILE = ((8, 1, 6), (16, 8, 4), (64, 1, 1), (TYPICAL_PROMPT, 1, 1), (TYPICAL_PROMPT, 4, 6))


def profile_engine(engine: Any, slo_text: str | None) -> BudgetController:
    """The controller for `engine` (an `LLMEngine` whose scheduler has no controller yet), its
    cost-model prior from a start-up profile: measured now (`measure_step_cost_prior`) and kept
    in the step-cost cache, or read from there when this machine already profiled this model
    with these options (`step_cost_cache_key`; a warm start then only warms the engine up).
    Either way a few idle decode steps are timed against the profile's idle step
    (`steps_agree`): a cached profile that disagrees is measured again, and a fresh one that
    disagrees (the load changed while it ran) is used but not cached. A restarted worker reads
    back the prior its previous start kept in `LANESERVE_RESTART_PROFILE` (same key) and only
    warms up. Targets the operator left out are derived from the prior; the caller attaches the
    controller to the scheduler."""
    logger.info("weights loaded: start-up profile of the step cost")
    given = parse_slo(slo_text)
    key = step_cost_cache_key(engine)
    restart = env.get("LANESERVE_RESTART_PROFILE")
    cached = _read_prior(restart, key) if restart else None
    source = "from this worker's previous start"
    if cached is not None:  # a restart (kill -9, crash) mid-traffic: the load is not idle now
        _run_profile(engine, _WARMUP, None, round_=0)
    else:
        theta, idle_step, source = _checked_prior(engine, key)
        cached = (theta, idle_step)
        if restart:
            _write_prior(restart, theta, idle_step, key)
    theta, idle_step = cached
    _reset_after_profile(engine)
    model = StepCostModel(theta)
    targets = default_targets(model, given, idle_step)
    logger.info(
        "step cost prior %s (ms, ms/token, ms/row, ms/ktoken, ms/kpair), idle decode step "
        "%.2f ms %s; SLO %s",
        [round(c, 4) for c in theta], idle_step, source, targets,
    )  # fmt: skip
    return BudgetController(
        targets, model, engine.scheduler.config.max_num_batched_tokens,
        given_ttft="ttft" in given.get("interactive", {}),
        given_tpot="tpot" in given.get("interactive", {}),
        serves_interactive="interactive" in engine.config.lanes,
    )  # fmt: skip


def _checked_prior(engine: Any, key: str) -> tuple[list[float], float, str]:
    """(prior, idle decode step ms, where it came from): the cached prior when an idle decode
    step timed now agrees with it, else a profile measured now (cached when it is steady)."""
    cached = read_cached_prior(key)
    source = "from the step-cost cache"
    if cached is not None:
        _run_profile(engine, _WARMUP, None, round_=0)  # first-call costs before the first request
        now = idle_decode_step_ms(engine, round_=100)  # rounds of its own: no prompt repeats
        if not steps_agree(now, cached[1]):  # measured under load, or the machine changed
            logger.warning(
                "cached idle decode step %.2f ms, measured now %.2f ms: profiling again",
                cached[1], now or 0.0,
            )  # fmt: skip
            cached = None
    if cached is None:
        theta, idle_step, n = measure_step_cost_prior(engine)
        again = idle_decode_step_ms(engine, round_=101)
        if steps_agree(again, idle_step):
            write_cached_prior(key, theta, idle_step)
            source = f"from {n} profiled steps"
        else:  # the load changed while profiling: this start uses it, no later one does
            logger.warning(
                "idle decode step %.2f ms in the profile, %.2f ms right after it: the "
                "profile is not cached", idle_step, again or 0.0,
            )  # fmt: skip
            source = f"from {n} profiled steps, not cached (the load changed meanwhile)"
        return theta, idle_step, source
    return cached[0], cached[1], source


_WARMUP = ((8, 1, 2), (64, 1, 1))  # a cached prior's start: one short decode, one chunk
_IDLE_CHECK = ((8, 1, 6),)  # five idle single-stream decode steps
# An idle decode step measured at start-up and one from the profile (cached, or just measured)
# agree within this factor, or the profile is not trusted: an entry profiled while something
# else loaded the cores once held a 66.8 ms idle step (6-8 ms unloaded, the same Zen 5) and set
# every later start's interactive TPOT target 9x too loose; profiles of the same options on
# one unloaded machine gave idle steps within 1.3x of each other.
IDLE_STEP_AGREEMENT = 1.5


def steps_agree(a_ms: float | None, b_ms: float) -> bool:
    """Whether two idle decode step times agree within `IDLE_STEP_AGREEMENT` (None: no step
    was measured, nothing to disagree with)."""
    return a_ms is None or max(a_ms, b_ms) <= IDLE_STEP_AGREEMENT * min(a_ms, b_ms)


def idle_decode_step_ms(engine: Any, round_: int) -> float | None:
    """The median of `_IDLE_CHECK`'s single-stream decode steps on `engine` (ms), or None when
    none ran as one (speculative decoding verified drafts in every one)."""
    samples: list[tuple[StepFeatures, float]] = []
    _run_profile(engine, _IDLE_CHECK, samples, round_=round_)
    single = [ms for f, ms in samples if f.tokens == 1 and f.rows == 1]
    return statistics.median(single) if single else None


def _run_profile(engine: Any, shapes: tuple, samples: list | None, round_: int) -> None:
    """Run `shapes` ((prompt tokens, requests, output tokens), ...) to completion on `engine`,
    appending (features, ms) of every step to `samples` unless it is None. Each `round_` has
    its own prompts, so a later round never reads an earlier one's from the prefix cache. A
    sequence longer than the engine takes (a small KV pool caps `max_model_len`) is shortened to
    fit; requests that do not fit the pool together are preempted as traffic would be."""
    from laneserve.gpu_worker.sampling_params import SamplingParams

    sched = engine.scheduler
    vocab = engine.token_id_limit
    for k, (longest, n, out) in enumerate(shapes):
        prompt = max(1, min(longest, sched.config.max_model_len - out))
        params = SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True)
        for j in range(n):
            ids = [(7 + 31 * (k * 17 + j + 97 * round_) + i) % vocab for i in range(prompt)]
            engine.add_request(f"__profile-{round_}-{k}-{j}", prompt_token_ids=ids,
                               sampling_params=params)  # fmt: skip
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            engine.step()
            ms = (time.perf_counter() - t0) * 1000.0
            if sched.last_features is not None and samples is not None:
                samples.append((sched.last_features, ms))


def _reset_after_profile(engine: Any) -> None:
    bm = engine.block_manager
    bm.reset_prefix_cache()  # the profile's counters and cached blocks are not traffic
    bm.prefix_cache_queries = bm.prefix_cache_hits = 0
    engine.num_steps = engine.num_generated_tokens = engine.num_prefill_tokens = 0
    spec = engine.speculation.controller
    if spec is not None:  # the profile's drafts are not traffic either (/metrics)
        spec.reset_totals()


def least_of_rounds(
    first: list[tuple[StepFeatures, float]], second: list[tuple[StepFeatures, float]]
) -> list[tuple[StepFeatures, float]]:
    """Two measured rounds of the same shapes as one: step by step the lesser time where both
    rounds ran the same steps (other processes only ever add time: a worker that `laneserve
    up` starts profiles while its siblings import and start), else every step of both."""
    if [f for f, _ in first] != [f for f, _ in second]:
        return first + second
    return [(f, min(a, b)) for (f, a), (_, b) in zip(first, second, strict=True)]


def measure_step_cost_prior(engine: Any) -> tuple[list[float], float, int]:
    """A warm-up round of `_PROFILE`'s shapes (first-call costs), then two measured ones
    (`least_of_rounds`); the least squares fit of the step costs (intercept at least 0.01 ms,
    no negative coefficient), the idle single-stream decode step (ms: the median of the
    profile's batch-1 decode steps) and the number of steps fitted. About 2.4 s on a 2-core
    Zen 5 with the bundled model; the two-round profile before took ~10 s on a 2-core AVX2 CPU
    in float32, so about 15 s there (not measured)."""
    _run_profile(engine, _PROFILE, None, round_=0)
    first: list[tuple[StepFeatures, float]] = []
    second: list[tuple[StepFeatures, float]] = []
    _run_profile(engine, _PROFILE, first, round_=1)
    _run_profile(engine, _PROFILE, second, round_=2)
    samples = least_of_rounds(first, second)
    theta = fit_least_squares(samples)
    theta[0] = max(theta[0], 0.01)
    theta[1:] = [max(c, 0.0) for c in theta[1:]]
    single = [ms for f, ms in samples if f.tokens == 1 and f.rows == 1]
    idle_step = statistics.median(single) if single else StepCostModel(theta).predict(
        StepFeatures(1, 1, TYPICAL_PROMPT))  # fmt: skip
    return [float(c) for c in theta], float(idle_step), len(samples)


# ---------------------------------------------------------------------- the step-cost cache

# 2: the idle decode step is kept beside the prior; 3: prefill attention, a fifth coefficient;
# 4: the lesser of two measured rounds per step
STEP_COST_CACHE_VERSION = 4
_OPENMP_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")


def step_cost_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/laneserve/step_cost`` (``~/.cache`` by default), beside torch's own
    extension cache."""
    return (env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "laneserve" / "step_cost"


def step_cost_cache_key(engine: Any) -> str:
    """What a step's cost depends on: the model file (path, size, mtime), the engine options
    (all but the SLO text), the resolved dtype, device and weight kernels, torch's version and
    thread count, the CPU (model name and flags), the OpenMP policy, the profile's shapes, the C++
    kernels' build, `LANESERVE_AMX` and the rows routed to AMX."""
    import torch

    from laneserve.gpu_worker import gemv_blocks
    from laneserve.kernels import cpu_ext

    config = {k: v for k, v in dataclasses.asdict(engine.config).items() if k != "slo"}
    path = Path(engine.model_path)
    try:
        stat = path.stat()
        model = [str(path.resolve()), stat.st_size, stat.st_mtime]
    except OSError:
        model = [str(path)]
    parts = {
        "version": STEP_COST_CACHE_VERSION,
        "model": model,
        "config": config,
        "dtype": str(engine.dtype),
        "device": str(engine.device),
        "quantization": engine.quantization,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu": cpu_identity(),
        "openmp": {name: env.get(name) for name in _OPENMP_VARS},
        "profile": _PROFILE,
        # the C++ kernels' source and CPU flags (their build), whether AMX may run them, and
        # the row counts routed to them
        "kernels": [
            cpu_ext.build_directory().name,
            env.get("LANESERVE_AMX"),
            gemv_blocks.AMX_MIN_TOKENS,
            gemv_blocks.AMX_MAX_TOKENS,
        ],
    }
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def read_cached_prior(key: str) -> tuple[list[float], float] | None:
    """(prior, idle decode step ms) cached under `key`, or None (not there, unreadable, or not
    `NUM_FEATURES` finite coefficients and a positive step; `LANESERVE_STEP_COST_CACHE=0`
    always gives None)."""
    if not env.get("LANESERVE_STEP_COST_CACHE"):
        return None
    return _read_prior(step_cost_cache_dir() / f"{key}.json")


def _read_prior(path: Path, key: str | None = None) -> tuple[list[float], float] | None:
    """The prior kept in `path` (and written for `key`, when given), or None."""
    try:
        data = json.loads(path.read_text())
        theta = [float(c) for c in data["theta"]]
        idle_step = float(data["idle_step_ms"])
        if key is not None and data["key"] != key:
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if len(theta) != NUM_FEATURES or not all(math.isfinite(c) and c >= 0.0 for c in theta):
        return None
    if not (math.isfinite(idle_step) and idle_step > 0.0):
        return None
    return theta, idle_step


def write_cached_prior(key: str, theta: list[float], idle_step_ms: float) -> None:
    """Keep `theta` and the idle decode step under `key` (atomically; a cache that cannot be
    written costs the next start its profile, nothing else)."""
    if not env.get("LANESERVE_STEP_COST_CACHE"):
        return
    _write_prior(step_cost_cache_dir() / f"{key}.json", theta, idle_step_ms, key)


def _write_prior(path: Path, theta: list[float], idle_step_ms: float, key: str) -> None:
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    record = {"theta": theta, "idle_step_ms": idle_step_ms, "key": key, "written": time.time()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(record))
        os.replace(tmp, path)
    except OSError as exc:
        logger.warning("cannot keep the step-cost profile in %s (%s)", path, exc)
