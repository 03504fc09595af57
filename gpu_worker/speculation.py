"""`Speculation`: speculative decoding as the engine's step sees it, on or off.

The engine's step is `schedule -> execute -> update` whether speculation is on or not: the
scheduler asks `propose` for drafts before it hands out the budget (`Scheduler.propose_drafts`),
the runner's timed forward reports to `observe_execute`, and `update` gives the verified runs to
`record` (the rejected drafts the scheduler rolls back) and the whole step to `observe_wall`.
Without a speculative config every call is a no-op (`controller` None), so the engine has no
`spec is not None` branches. The drafting itself is `spec_decode.SpecController`'s.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from laneserve.gpu_worker.spec_decode import SpecController, SpecRequest, TokenHistory

if TYPE_CHECKING:
    from laneserve.gpu_worker.request import Request
    from laneserve.gpu_worker.sampling_params import SamplingParams

SpecOf = Callable[["Request"], tuple[SpecRequest | None, "SamplingParams"]]


class Speculation:
    """The engine's speculative decoding (`config`: `EngineConfig.speculative_config`, None or
    disabled: off). `spec_of(request)` gives a running request's spec state and params."""

    def __init__(self, config: Any, spec_of: SpecOf, max_model_len: int) -> None:
        on = config is not None and config.enabled
        self.controller: SpecController | None = SpecController(config) if on else None
        self._spec_of = spec_of
        self._max_model_len = max_model_len
        self._runs: list[tuple[Request, SpecRequest, int, int]] = []

    def new_request(
        self, prompt_token_ids: list[int], params: SamplingParams
    ) -> SpecRequest | None:
        """A new request's spec state; None when off or for a constrained request (its rows
        carry one grammar mask each, so it is never given drafts)."""
        if self.controller is None or params.structured_outputs is not None:
            return None
        return SpecRequest(TokenHistory(prompt_token_ids))

    def propose(self, running: Sequence[Request]) -> None:
        """Set the running requests' `spec_token_ids` for the coming step (before scheduling)."""
        if self.controller is not None:
            self.controller.propose(running, self._spec_of, self._max_model_len)

    @contextlib.contextmanager
    def aside(self) -> Iterator[None]:
        """A step outside the propose cycle (gpu_worker/interleave.py runs one inside another):
        no sample for the yield guard, whose rows are those `propose` saw decoding for the step
        in flight (kept for it)."""
        c = self.controller
        rows = 0 if c is None else c._step_rows
        if c is not None:
            c._step_rows = 0
        try:
            yield
        finally:
            if c is not None:
                c._step_rows = rows

    def observe_execute(self, num_tokens: int, started: float) -> None:
        """A step's forward and sampling ran from `started` (`time.perf_counter()` s) over
        `num_tokens` tokens: the step-cost model's sample."""
        if self.controller is not None:
            self.controller.observe_step(num_tokens, (time.perf_counter() - started) * 1000.0)

    def record(self, sampled: Sequence[Any]) -> dict[str, int] | None:
        """Account the step's verified drafts (`engine._Sampled` rows without an error); the
        rejected drafts per request id for `Scheduler.update_after_step` (None when off: a
        request missing from it had every draft rejected)."""
        if self.controller is None:
            return None
        self._runs = [(r.state.request, r.state.spec, r.num_drafts, r.num_accepted)
                      for r in sampled if r.num_drafts and r.error is None]  # fmt: skip
        return self.controller.record(self._runs)

    def observe_wall(self, out: Any, sampled: Sequence[Any], started: float) -> None:
        """The whole step from before `propose` (`started`, `time.perf_counter()` s) to its
        outputs, for the measured check on drafting (`SpecController.observe_wall`)."""
        if self.controller is None:
            return
        emitted = sum(r[3] for r in self._runs) + sum(row.error is None for row in sampled)
        self.controller.observe_wall(
            len(out.scheduled),
            out.num_batched_tokens,
            sum(r[2] for r in self._runs),
            emitted,
            (time.perf_counter() - started) * 1000.0,
        )
