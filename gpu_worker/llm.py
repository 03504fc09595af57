"""Offline API: `LLM(model).generate(prompts, params)` on top of `LLMEngine` (vLLM's `LLM` shape)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from laneserve.gpu_worker.config import EngineConfig
from laneserve.gpu_worker.model_files import DEFAULT_MODEL
from laneserve.gpu_worker.openmp import apply_openmp_policy
from laneserve.gpu_worker.outputs import Logprob, prompt_logprob_dicts
from laneserve.gpu_worker.sampling_params import SamplingParams


@dataclass(slots=True)
class RequestOutput:
    """A finished request.

    Attributes:
        token_ids: output ids, including the EOS id that ended the request.
        text: output text without special tokens (cut before a matched stop string unless
            `include_stop_str_in_output`).
        finish_reason: "stop" | "length" | "abort" | "error".
        num_cached_tokens: prompt tokens served from the prefix cache.
        metrics: DESIGN.md per-phase fields measured in the engine (ms) and token counts.
        logprobs: per output token `{"token_id", "logprob", "top": [(id, logprob), ...]}` when
            requested.
        prompt_logprobs: with `SamplingParams.prompt_logprobs`, vLLM's shape: per prompt
            position None (the first) or `{token_id: Logprob(logprob, rank, decoded_token)}`
            with the prompt's token and the top-n.
        embedding: from `LLM.embed`, the pooled, L2-normalized final hidden state
            (`hidden_size` floats; the engine's `pooling_type`).
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    metrics: dict[str, Any] = field(default_factory=dict)
    logprobs: list[dict] | None = None
    error: str | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    embedding: list[float] | None = None


class LLM:
    """Run a model offline over a list of prompts with continuous batching.

    Arguments are `EngineConfig` fields (gpu_worker/config.py, with its defaults; the step knobs
    take `ENGINE_DEFAULTS`); see DESIGN.md for their meaning. `dtype="auto"` picks bfloat16 on a
    GPU or a bf16-capable CPU and float32 otherwise. `quantization` (vLLM's name): "auto" runs
    a GGUF's own Q4_0 / Q4_1 / Q8_0 weights on weight-only int4 / int8 kernels on CPU, "none"
    dequantizes them (`dtype="float32", quantization="none"` is the exactness mode), "int8" /
    "int4" put every linear on that kernel.
    """

    def __init__(self, model: str = DEFAULT_MODEL, dtype: str = "auto", **kwargs: Any):
        # the process owns the cores: spinning threads (gpu_worker/openmp.py); takes effect
        # when torch is not loaded yet
        apply_openmp_policy(exclusive=True)
        from laneserve.gpu_worker.engine import LLMEngine

        self.engine = LLMEngine(EngineConfig(model=model, dtype=dtype, **kwargs))
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]] | str,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        lane: str = "batch",
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs in input order.

        Raises:
            InvalidRequestError / PromptTooLongError: a bad prompt (nothing is run then).
        """
        return self._run(_prompt_kinds(prompts), sampling_params, lane)

    def chat(
        self,
        conversations: Sequence[Sequence[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        lane: str = "batch",
    ) -> list[RequestOutput]:
        """Generate a reply to each conversation (the model's chat template, generation prompt on)."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # a single conversation
        return self._run([{"messages": list(c)} for c in conversations], sampling_params, lane)

    def embed(
        self, prompts: Sequence[str] | Sequence[Sequence[int]] | str, lane: str = "batch"
    ) -> list[RequestOutput]:
        """Embed every prompt (text or token ids), vLLM's `LLM.embed`: prefill only, each
        output's `embedding` is the pooled, normalized final hidden state (`pooling_type`).

        Raises:
            InvalidRequestError / PromptTooLongError: a bad prompt (nothing is run then).
        """
        return self._run(_prompt_kinds(prompts), None, lane, task="embed")

    def _run(
        self, kinds: list[dict], sampling_params, lane: str, task: str = "generate"
    ) -> list[RequestOutput]:
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(kinds)
        else:
            params = list(sampling_params)
            if len(params) != len(kinds):
                raise ValueError(f"{len(params)} sampling_params for {len(kinds)} prompts")
        engine = self.engine
        # Template and tokenize every prompt first (the front end's encoder: the engine takes
        # ids only), so a bad one leaves nothing half-submitted.
        encoded = [engine.prompts.encode(**k) for k in kinds]
        outputs: dict[str, RequestOutput] = {}
        order: list[str] = []
        try:
            for ids, p in zip(encoded, params, strict=True):
                rid = f"offline-{next(self._ids)}"
                req = engine.add_request(
                    rid, prompt_token_ids=ids, sampling_params=p, lane=lane, task=task
                )
                outputs[rid] = RequestOutput(
                    rid, list(req.prompt_token_ids), logprobs=[] if p.logprobs is not None else None
                )
                order.append(rid)
            pending = set(order)
            while pending:
                for d in engine.step():
                    out = outputs.get(d.request_id)
                    if out is None:
                        continue
                    out.token_ids.extend(d.new_token_ids)
                    out.text += d.new_text
                    if d.prompt_logprobs is not None:
                        out.prompt_logprobs = prompt_logprob_dicts(d.prompt_logprobs, self._decode)
                    if d.logprobs and out.logprobs is not None:
                        out.logprobs.extend(d.logprobs)
                    if d.embedding is not None:
                        out.embedding = np.frombuffer(d.embedding, "<f4").tolist()
                    if d.finished:
                        out.finish_reason = d.finish_reason
                        out.metrics = d.metrics or {}
                        out.num_cached_tokens = int(out.metrics.get("cached_tokens") or 0)
                        out.error = d.error
                        pending.discard(d.request_id)
        finally:
            for rid in order:
                if outputs[rid].finish_reason is None:
                    engine.abort_request(rid)
            while engine.has_unfinished_requests():  # report the aborts so no state lingers
                engine.step()
        return [outputs[rid] for rid in order]

    def _decode(self, token_id: int) -> str:
        return self.engine.tokenizer.decode([token_id])

    def stats(self) -> dict[str, Any]:
        """num_total_blocks, num_free_blocks, num_running, num_waiting, prefix_cache_queries,
        prefix_cache_hits, num_preemptions (and more)."""
        return self.engine.stats()

    def check_integrity(self) -> None:
        self.engine.check_integrity()


def _prompt_kinds(prompts: Sequence[str] | Sequence[Sequence[int]] | str) -> list[dict]:
    """`generate`/`embed`'s prompts as the prompt encoder's fields: text or token ids each."""
    if isinstance(prompts, str):
        prompts = [prompts]
    return [{"prompt": p} if isinstance(p, str) else {"prompt_token_ids": list(p)} for p in prompts]
