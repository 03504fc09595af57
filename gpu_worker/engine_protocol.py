"""The interface the worker process drives: `Engine`.

`LLMEngine` (gpu_worker/engine.py, the real model) and `SyntheticEngine` (gpu_worker/synthetic.py,
fake tokens) implement it, and so does the test-only `FaultInjectingEngine`
(gpu_worker/faults.py). `gpu_worker.worker.Worker` depends on nothing else, so the worker's IO side
never imports torch for its own sake. Torch-free.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from laneserve.contracts.engine_io import EngineOutput, EngineRequest

__all__ = ["Engine", "PromptFrontEnd"]


class PromptFrontEnd(Protocol):
    """Text to token ids before an `EngineRequest` is built (`PromptEncoder`,
    gpu_worker/prompt_encoder.py, for a model's tokenizer)."""

    num_prompts_tokenized: int

    def encode(
        self,
        prompt: str | None = None,
        prompt_token_ids: list[int] | None = None,
        messages: list[dict] | None = None,
    ) -> list[int]:
        """Checked ids of exactly one prompt form (chat template applied to `messages`).
        Raises ValueError (InvalidRequestError) for a bad prompt."""
        ...


@runtime_checkable
class Engine(Protocol):
    """A streaming engine: requests go in with `add` (`add_request`), token deltas come out of `step`.

    Attributes:
        model_name: the name the worker announces to the broker.
        kv_pool: the KV pool's numbers the worker announces (``num_blocks``, ``block_size``,
            ``num_tokens``, ``max_model_len``; a real engine adds bytes, dtype and the profiled
            activation peak), shown by ``laneserve status``.
        prompts: the front end that templates and tokenizes a text prompt (a wire request from a
            sender without a tokenizer) before the worker builds the `EngineRequest`; `add`
            takes ids only.
    """

    model_name: str
    kv_pool: dict[str, Any]
    prompts: PromptFrontEnd

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
        """Queue a request: `add` of an `EngineRequest` of these fields.

        `sampling_params` is a `SamplingParams` or its wire dict; `arrival_time` is
        `time.monotonic()` seconds when the request reached this process. `task`: "generate",
        or "embed" (prefill only; the final delta carries `embedding`); an engine that computes
        no embeddings raises ValueError for it.

        Raises:
            ValueError (InvalidRequestError, PromptTooLongError): bad input, duplicate id.
        """
        ...

    def add(self, request: EngineRequest) -> object:
        """Queue an `EngineRequest` (what the worker hands over). Raises as `add_request`."""
        ...

    def step(self) -> list[EngineOutput]:
        """One engine step; the deltas it produced (a token, a final, an error), maybe none."""
        ...

    def abort_request(self, request_id: str) -> None:
        """Stop a request and free what it holds (unknown ids are ignored)."""
        ...

    def has_unfinished_requests(self) -> bool:
        """True while any request is queued, running, or owes a final delta."""
        ...

    def stats(self) -> dict[str, Any]:
        """Load figures: num_total_blocks, num_free_blocks, num_running, num_waiting,
        prefix_cache_queries, prefix_cache_hits, num_preemptions (more are allowed)."""
        ...
