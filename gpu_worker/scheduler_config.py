"""`SchedulerConfig`: the scheduler's knobs (step token budget, seats, chunking, the batch lane's
caps, the priority-preemption guard), checked on construction, and taken from an engine config
by `SchedulerConfig.from_engine`. The scheduler itself is gpu_worker/scheduler.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from laneserve.contracts import defaults
from laneserve.gpu_worker.config import ENGINE_DEFAULTS, EngineConfig


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Scheduling knobs (all counts in tokens unless said).

    Attributes:
        max_num_seqs: most requests running at once (the decode batch size cap).
        max_num_batched_tokens: token budget of one step (prefill chunks + decodes); may be
            smaller than `max_num_seqs` (then not every running request decodes each step).
        max_model_len: longest sequence (prompt + output) a request may reach; the KV pool
            must hold at least one such sequence.
        long_prefill_token_threshold: largest prefill chunk of one request per step, or None
            for no limit beyond the budget (small chunks smooth TPOT of the others).
        watermark: fraction of all blocks kept free when admitting a waiting request, so
            running requests can grow a little before anything is preempted (vLLM's 1%).
        interactive_batch_token_cap: batch-lane tokens per step (decodes + prefill chunks)
            while interactive requests are present, or None for no cap (DESIGN "Lanes inside
            one worker"). 512 suits a GPU; a CPU worker serving interactive traffic uses a few
            tokens, since there every batch token lengthens the interactive step.
        batch_token_budget: batch-lane tokens per step at any time, or None (the default, as
            DESIGN asks) for the whole budget when no interactive request is present. Opt-in:
            it bounds how long a newly arrived interactive request waits for a running batch
            step, at the cost of batch steps smaller than the budget.
        priority_preemption_limit: the ping-pong guard of priority preemption inside a lane:
            a request preempted this many times for a more urgent one of its lane is not
            preempted so again for `priority_preemption_cooldown_steps` steps after it runs
            again (it keeps its seat and makes progress; the urgent request waits).
        priority_preemption_cooldown_steps: length of that protection, in engine steps.
    """

    max_num_seqs: int = ENGINE_DEFAULTS.max_num_seqs
    max_num_batched_tokens: int = ENGINE_DEFAULTS.max_num_batched_tokens
    max_model_len: int = defaults.MAX_MODEL_LEN
    long_prefill_token_threshold: int | None = None
    watermark: float = 0.01
    interactive_batch_token_cap: int | None = ENGINE_DEFAULTS.interactive_batch_token_cap
    batch_token_budget: int | None = None
    priority_preemption_limit: int = 2
    priority_preemption_cooldown_steps: int = 64

    @classmethod
    def from_engine(cls, config: EngineConfig, max_model_len: int) -> SchedulerConfig:
        """The scheduling part of an engine config whose step knobs are resolved
        (`EngineConfig.with_profile`); `max_model_len` is what the engine settled on."""
        return cls(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=max_model_len,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            interactive_batch_token_cap=config.interactive_batch_token_cap,
            batch_token_budget=config.batch_token_budget,
        )

    def __post_init__(self) -> None:
        for name in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_model_len",
            "priority_preemption_limit",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in (
            "long_prefill_token_threshold",
            "interactive_batch_token_cap",
            "batch_token_budget",
        ):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 or None, got {value}")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
