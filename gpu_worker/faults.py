"""Test-only fault injection: an `Engine` wrapper the worker entry point installs when asked.

Three faults, each enabled by a registered test-only variable that the worker entry point reads
once at start (`FaultPlan.from_env`); with none set the worker drives the engine directly and
nothing here runs:

- ``LANESERVE_FAULT_STEP=TEXT``: an engine step whose batch holds a request whose prompt or
  messages contain TEXT raises inside the model call, so the engine's own recovery runs (the
  step's requests end with an error, their KV blocks are freed, the engine keeps serving). Needs
  the real engine (`LLMEngine.execute_model`).
- ``LANESERVE_FAULT_CRASH=TEXT``: a request whose prompt or messages contain TEXT kills the worker
  process (``os._exit(1)``) when it is added, the way a request that crashes its worker every time
  would (tests/reliability, fault scenario 2).
- ``LANESERVE_FAULT_SLOWDOWN=F`` (F >= 1): every model call takes F times as long (the engine
  sleeps (F - 1) x the call's own time after it), a machine F times slower for the SLO
  controller's adaptation benchmark (`scripts/bench_lanes.py --slowdown 2`): its start-up profile
  and cached step costs are the real machine's, every step it then measures is F times that.
  Needs the real engine.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass
from typing import Any

from laneserve.contracts import env
from laneserve.contracts.engine_io import EngineOutput, EngineRequest
from laneserve.gpu_worker.engine_protocol import Engine

logger = logging.getLogger(__name__)

STEP_VAR = "LANESERVE_FAULT_STEP"
CRASH_VAR = "LANESERVE_FAULT_CRASH"
SLOWDOWN_VAR = "LANESERVE_FAULT_SLOWDOWN"


@dataclass(frozen=True, slots=True)
class FaultPlan:
    """Which faults to inject: prompt texts that trigger them (None: that fault is off) and the
    model calls' slowdown factor (None: real speed)."""

    step_marker: str | None = None
    crash_marker: str | None = None
    slowdown: float | None = None

    def __post_init__(self) -> None:
        if self.slowdown is not None and not 1.0 <= self.slowdown < math.inf:
            raise ValueError(f"{SLOWDOWN_VAR} must be a finite factor >= 1, got {self.slowdown}")

    @classmethod
    def from_env(cls) -> FaultPlan:
        return cls(
            step_marker=env.get(STEP_VAR),
            crash_marker=env.get(CRASH_VAR),
            slowdown=env.get(SLOWDOWN_VAR),
        )

    @property
    def enabled(self) -> bool:
        return bool(self.step_marker or self.crash_marker or self.slowdown)


def with_faults(engine: Engine, plan: FaultPlan) -> Engine:
    """`engine` itself when `plan` injects nothing, else a `FaultInjectingEngine` around it."""
    return FaultInjectingEngine(engine, plan) if plan.enabled else engine


class FaultInjectingEngine:
    """An `Engine` that delegates to `engine` and injects the faults of `plan`.

    Raises (constructor):
        ValueError: a step fault or a slowdown asked of an engine without `execute_model`.
    """

    def __init__(self, engine: Engine, plan: FaultPlan) -> None:
        self.engine = engine
        self.plan = plan
        self.model_name = engine.model_name
        self.kv_pool = getattr(engine, "kv_pool", {})
        self.prompts = engine.prompts
        self._marked: set[str] = set()  # live requests whose prompt carries the step marker
        if plan.step_marker or plan.slowdown:
            execute = getattr(engine, "execute_model", None)
            if execute is None:
                var = STEP_VAR if plan.step_marker else SLOWDOWN_VAR
                raise ValueError(f"{var} needs the real engine (no execute_model)")
            if plan.slowdown:
                execute = _slowed(execute, plan.slowdown)
            if plan.step_marker:
                execute = self._failing(execute)
            engine.execute_model = execute  # type: ignore[attr-defined]
        logger.warning("test fault injection on: %s", plan)

    def _failing(self, execute: Any) -> Any:
        from laneserve.gpu_worker.errors import EngineError

        def execute_model(out: Any) -> Any:
            if any(e.request.request_id in self._marked for e in out.scheduled):
                raise EngineError(f"injected fault ({STEP_VAR})")
            return execute(out)

        return execute_model

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: Any = None,
        lane: str = "batch",
        priority: int = 0,
        arrival_time: float | None = None,
        task: str = "generate",
    ) -> object:
        return self.add(EngineRequest(request_id, prompt_token_ids, sampling_params, lane,
                                      priority, arrival_time, task))  # fmt: skip

    def add(self, request: EngineRequest) -> object:
        request_id = request.request_id
        text = ""
        if self.plan.crash_marker or self.plan.step_marker:  # the prompt's text, from its ids
            text = self.engine.tokenizer.decode(request.prompt_token_ids)
        if self.plan.crash_marker and self.plan.crash_marker in text:
            logger.error("%s matched request %s: exiting", CRASH_VAR, request_id)
            os._exit(1)
        result = self.engine.add(request)
        if self.plan.step_marker and self.plan.step_marker in text:
            self._marked.add(request_id)
        return result

    def step(self) -> list[EngineOutput]:
        deltas = self.engine.step()
        if self._marked:
            for d in deltas:
                if d.finished:
                    self._marked.discard(d.request_id)
        return deltas

    def abort_request(self, request_id: str) -> None:
        self._marked.discard(request_id)
        self.engine.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests()

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()


def _slowed(execute: Any, factor: float) -> Any:
    """`execute` followed by a sleep of (factor - 1) x its own duration."""

    def execute_model(out: Any) -> Any:
        started = time.perf_counter()
        try:
            return execute(out)
        finally:
            time.sleep((factor - 1.0) * (time.perf_counter() - started))

    return execute_model
