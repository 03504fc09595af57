"""What one `Scheduler.schedule()` hands the engine: `SchedulerOutput`, a list of
`ScheduledRequest` (each request's share of the step: its new tokens, whether it samples, its
speculative drafts) and the requests preempted while building it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from laneserve.gpu_worker.request import Request


class ScheduledRequest(NamedTuple):
    """One request's share of a step.

    Attributes:
        request: the request.
        num_new_tokens: tokens computed this step, positions
            `[num_computed_tokens, num_computed_tokens + num_new_tokens)`.
        samples: True when the step reaches the end of the request's tokens, so the engine
            samples one new token from its last position's logits.
        num_computed_tokens: `request.num_computed_tokens` when scheduled (the first position).
        spec_token_ids: draft tokens verified this step (speculative decoding): the last
            `len(spec_token_ids)` of the `num_new_tokens`, after the request's last known token.
    """

    request: Request
    num_new_tokens: int
    samples: bool = False
    num_computed_tokens: int = 0
    spec_token_ids: tuple[int, ...] = ()


@dataclass(slots=True)
class SchedulerOutput:
    """Result of one `Scheduler.schedule()`.

    Attributes:
        scheduled: requests computing tokens this step, in scheduling order.
        preempted: requests preempted (by recompute) while building this step.
        num_batched_tokens: sum of `num_new_tokens` (<= max_num_batched_tokens).
    """

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_batched_tokens: int = 0
    interleaved: bool = False  # run between a batch step's layers (gpu_worker/interleave.py)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
