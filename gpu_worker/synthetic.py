"""A synthetic engine with the ``Engine`` interface: fake tokens at a configurable rate.

No model, no torch: it exists so the broker and worker processes can be tested and benchmarked
without weights (``laneserve worker --synthetic``). It mimics what the worker sees from the real
engine (`gpu_worker.engine_protocol.Engine`, docs/interfaces.md "gpu_worker engine"):

- ``add_request(request_id, prompt_token_ids, sampling_params=None, lane="batch", priority=0,
  arrival_time=None)`` (ids only; a text prompt is encoded first by ``prompts``, one id per
  word: `WordPrompts`)
- ``step() -> list[EngineOutput]`` — one token for every running request per step, interactive
  requests admitted first (``max_num_seqs`` running at most), the step paced to ``step_s``;
- ``abort_request(request_id)``, ``has_unfinished_requests()``, ``stats()``.

KV accounting is simulated with ``num_blocks`` blocks of ``block_size`` tokens so that tests can
check that an abort returns ``num_free_blocks`` to its baseline. Output token ``i`` of a request
is id ``(seed + i) % 1000`` with text ``" w{id}"``, so output is deterministic.
"""

from __future__ import annotations

import collections
import math
import time
from dataclasses import dataclass, field
from typing import Any

from laneserve.contracts import defaults, latency
from laneserve.contracts.engine_io import EngineOutput, EngineRequest
from laneserve.gpu_worker.config import ENGINE_DEFAULTS


class WordPrompts:
    """The synthetic engine's prompt front end (`engine_protocol.PromptFrontEnd`): one id per
    whitespace-separated word (at least one), ids given out in order of first sight, and
    `decode` back to the words (for ``fail_on`` and the test faults)."""

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}
        self.words: list[str] = []
        self.num_prompts_tokenized = 0

    def encode(
        self,
        prompt: str | None = None,
        prompt_token_ids: list[int] | None = None,
        messages: list[dict] | None = None,
    ) -> list[int]:
        """Ids of exactly one prompt form. Raises ValueError otherwise."""
        if sum(x is not None for x in (prompt, prompt_token_ids, messages)) != 1:
            raise ValueError("give exactly one of prompt, prompt_token_ids, messages")
        if prompt_token_ids is not None:
            return list(prompt_token_ids)
        if messages is not None:
            prompt = " ".join(str(m.get("content", "")) for m in messages)
        if not isinstance(prompt, str):
            raise ValueError("prompt must be a string")
        self.num_prompts_tokenized += 1
        return [self.ids.setdefault(w, len(self.ids)) for w in prompt.split() or [""]]

    def decode(self, token_ids: list[int]) -> str:
        """The words of ids this front end gave out ("" for any other id)."""
        if len(self.words) < len(self.ids):
            self.words = list(self.ids)
        n = len(self.words)
        return " ".join(self.words[t] if type(t) is int and 0 <= t < n else "" for t in token_ids)


@dataclass(slots=True)
class _SynthRequest:
    request_id: str
    lane: str
    prompt_tokens: int
    max_tokens: int
    seed: int
    arrival: float  # monotonic seconds
    blocks: int = 0
    output: int = 0
    first_scheduled: float = 0.0
    token_times: list[float] = field(default_factory=list)


class SyntheticEngine:
    """Fake engine. ``step_s``: seconds per engine step (each running request gets one token per
    step, so ``1 / step_s`` tokens/s per stream); ``prefill_s``: extra delay of a request's first
    step; ``fail_on``: a prompt containing this string finishes with an engine error (tests);
    ``stamp``: each token's text is ``" t<time.monotonic_ns()>"`` at emission, so a benchmark on
    the same host can measure transport latency (CLOCK_MONOTONIC is system-wide on Linux);
    ``cost_scale``: multiplies ``step_s`` and ``prefill_s`` (a 2x slower machine for adaptation
    benchmarks, ``laneserve worker --synthetic-cost-scale 2``)."""

    model_name = "synthetic"

    def __init__(
        self,
        *,
        step_s: float = 0.01,
        prefill_s: float = 0.0,
        max_num_seqs: int = ENGINE_DEFAULTS.max_num_seqs,
        num_blocks: int = 4096,
        block_size: int = 16,
        default_max_tokens: int = 16,
        max_model_len: int = defaults.MAX_MODEL_LEN,
        fail_on: str | None = None,
        stamp: bool = False,
        cost_scale: float = 1.0,
    ) -> None:
        if step_s < 0 or max_num_seqs < 1 or num_blocks < 1 or block_size < 1:
            raise ValueError("step_s >= 0, max_num_seqs, num_blocks, block_size >= 1 required")
        if not cost_scale > 0:
            raise ValueError(f"cost_scale must be > 0, got {cost_scale}")
        self.step_s = step_s * cost_scale
        self.prefill_s = prefill_s * cost_scale
        self.max_num_seqs = max_num_seqs
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.default_max_tokens = default_max_tokens
        self.max_model_len = max_model_len
        self.fail_on = fail_on
        self.stamp = stamp
        self.waiting: collections.deque[_SynthRequest] = collections.deque()
        self.running: dict[str, _SynthRequest] = {}
        self.free_blocks = num_blocks
        self.kv_pool = {"device": "synthetic", "num_blocks": num_blocks, "block_size": block_size,
                        "num_tokens": num_blocks * block_size,
                        "max_model_len": min(max_model_len, num_blocks * block_size)}  # fmt: skip
        self._last_step = 0.0
        self._errors: list[EngineOutput] = []
        self.prompts = WordPrompts()
        self.tokenizer = self.prompts  # its `decode` (the test faults read prompts with it)
        self.num_steps = 0

    # ------------------------------------------------------------------ Engine interface

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: dict | Any | None = None,
        lane: str = "batch",
        priority: int = 0,
        arrival_time: float | None = None,
        task: str = "generate",
    ) -> None:
        """`add` an `EngineRequest` of these fields."""
        self.add(EngineRequest(request_id, prompt_token_ids, sampling_params, lane, priority,
                               arrival_time, task))  # fmt: skip

    def add(self, request: EngineRequest) -> None:
        """Queue a request. Raises ValueError on a bad prompt or sampling params, a duplicate
        request id, or ``task="embed"`` (fake tokens have no hidden states to pool)."""
        if request.task != "generate":
            raise ValueError("the synthetic engine computes no embeddings (task 'embed')")
        request_id, lane, arrival_time = request.request_id, request.lane, request.arrival_time
        sampling_params = request.sampling_params
        if request_id in self.running or any(r.request_id == request_id for r in self.waiting):
            raise ValueError(f"duplicate request_id {request_id!r}")
        ids = request.prompt_token_ids
        if not isinstance(ids, list):
            raise ValueError("prompt_token_ids must be a list of ints")
        n_prompt = len(ids)
        text = self.prompts.decode(ids) if self.fail_on else ""
        sp = sampling_params if isinstance(sampling_params, dict) else {}
        max_tokens = sp.get("max_tokens", self.default_max_tokens)
        if type(max_tokens) is not int or max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive int, got {max_tokens!r}")
        if n_prompt + max_tokens > self.max_model_len:
            raise ValueError(f"prompt_tokens + max_tokens > max_model_len ({self.max_model_len})")
        seed = sp.get("seed") or 0
        req = _SynthRequest(
            request_id=request_id,
            lane=lane,
            prompt_tokens=n_prompt,
            max_tokens=max_tokens,
            seed=int(seed),
            arrival=arrival_time if arrival_time is not None else time.monotonic(),
            output=len(request.output_token_ids or []),  # resumed: goes on from there
        )
        if self.fail_on and self.fail_on in text:
            self._errors.append(
                EngineOutput(request_id, "", [], True, "error", error="synthetic engine failure")
            )
            return
        if lane == "interactive":
            # interactive before batch, FIFO within a lane
            idx = sum(1 for r in self.waiting if r.lane == "interactive")
            self.waiting.insert(idx, req)
        else:
            self.waiting.append(req)

    def abort_request(self, request_id: str) -> None:
        """Drop a request and free its blocks; no output is produced for it afterwards."""
        req = self.running.pop(request_id, None)
        if req is not None:
            self.free_blocks += req.blocks
            return
        for r in self.waiting:
            if r.request_id == request_id:
                self.waiting.remove(r)
                return

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.waiting or self._errors)

    def step(self) -> list[EngineOutput]:
        """One engine step: admit waiting requests, one token for each running request."""
        self._pace()
        now = time.monotonic()
        out, self._errors = self._errors, []
        self._admit(now)
        for req in list(self.running.values()):
            tok = (req.seed + req.output) % 1000
            req.output += 1
            req.token_times.append(now)
            need = math.ceil((req.prompt_tokens + req.output) / self.block_size)
            if need > req.blocks and self.free_blocks > 0:
                self.free_blocks -= 1
                req.blocks += 1
            done = req.output >= req.max_tokens
            text = f" t{time.monotonic_ns()}" if self.stamp else f" w{tok}"
            if done:
                out.append(EngineOutput(req.request_id, text, [tok], True, "length",
                                        metrics=self._metrics(req)))  # fmt: skip
                self.running.pop(req.request_id)
                self.free_blocks += req.blocks
            else:
                out.append(EngineOutput(req.request_id, text, [tok]))
        self.num_steps += 1
        return out

    def stats(self) -> dict[str, Any]:
        """``num_total_blocks, num_free_blocks, num_running, num_waiting, prefix_cache_queries,
        prefix_cache_hits, num_preemptions, spec_draft_tokens, spec_accepted_tokens,
        spec_num_drafts`` as in
        ``LLM.stats()`` (the synthetic engine never speculates)."""
        return {
            "num_total_blocks": self.num_blocks,
            "num_free_blocks": self.free_blocks,
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
            "prefix_cache_queries": 0,
            "prefix_cache_hits": 0,
            "num_preemptions": 0,
            "spec_draft_tokens": 0,
            "spec_accepted_tokens": 0,
            "spec_num_drafts": 0,
        }

    # ------------------------------------------------------------------ internals

    def _pace(self) -> None:
        if self.step_s <= 0:
            return
        wait = self._last_step + self.step_s - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        self._last_step = max(time.monotonic(), self._last_step + self.step_s)

    def _admit(self, now: float) -> None:
        while self.waiting and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            need = math.ceil((req.prompt_tokens + 1) / self.block_size)
            if need > self.free_blocks:
                return
            self.waiting.popleft()
            self.free_blocks -= need
            req.blocks = need
            req.first_scheduled = now
            self.running[req.request_id] = req
            if self.prefill_s:
                time.sleep(self.prefill_s)

    def _metrics(self, req: _SynthRequest) -> dict[str, Any]:
        times = req.token_times
        gaps = [latency.interval_ms(a, b) for a, b in zip(times, times[1:], strict=False)]
        decode_ms = latency.decode_ms(times[0], times[-1])
        n = req.output
        return {
            "queue_ms": latency.interval_ms(req.arrival, req.first_scheduled),
            "prefill_ms": latency.prefill_ms(req.first_scheduled, times[0]),
            "decode_ms": decode_ms,
            "tpot_ms": latency.tpot_ms(decode_ms, n),
            "itl_p99_ms": latency.itl_p99_ms(gaps),
            "prompt_tokens": req.prompt_tokens,
            "cached_tokens": 0,
            "completion_tokens": n,
            "preemptions": 0,
            "prefill_chunks": 1,
            "first_scheduled_delay_ms": (req.first_scheduled - req.arrival) * 1000.0,
            "first_token_delay_ms": (times[0] - req.arrival) * 1000.0,
        }
