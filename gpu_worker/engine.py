"""LLMEngine: the streaming core the worker process drives (`add_request / step / abort_request`).

One `step()` is DESIGN.md's `schedule -> execute -> process outputs`:

1. schedule: `Scheduler.schedule()` hands out the token budget (decodes, prefill chunks,
   preemptions; speculative drafts proposed first through `Speculation`);
2. execute (`_execute`): `ModelRunner` runs one flattened varlen forward over the paged KV
   cache and the `Sampler` picks (or verifies) the tokens of every request whose step reached
   its last known token;
3. update (`_update`): the scheduler advances (rejected drafts rolled back), the detokenizer
   turns tokens into a text delta and the stop checks (EOS, stop ids, stop strings,
   max_tokens, max_model_len) finish requests.

It returns one `EngineOutput` per request that produced something (a token, a final, an error).
Speculation on or off, the three calls are the same (`gpu_worker/speculation.py`).

Fault isolation: an exception in the forward pass fails the requests of that step; everything
after it is per request -- a request whose sampling or output processing (detokenizer, stop
checks) raises ends alone with finish_reason "error" (the broker's `engine_error`), and the other
requests keep running. Prompt token ids are checked at admission against the tokenizer's length
as well as the model's `vocab_size` (which may be padded beyond the tokenizer), so an id the
tokenizer cannot decode is an `InvalidRequestError` and never reaches a step.

Length contract: a prompt longer than `max_model_len - 1` tokens raises `PromptTooLongError`
(at least one output token must fit). When prompt + max_tokens exceeds `max_model_len`, the
request is accepted and finishes with finish_reason "length" once the sequence reaches
`max_model_len`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from laneserve.contracts.engine_io import EngineOutput, EngineRequest, label_logprobs
from laneserve.gpu_worker.block_manager import BlockManager
from laneserve.gpu_worker.config import ENGINE_DEFAULTS, EngineConfig
from laneserve.gpu_worker.detokenizer import IncrementalDetokenizer
from laneserve.gpu_worker.errors import InvalidRequestError, PromptTooLongError
from laneserve.gpu_worker.hardware import default_device, resolve_dtype
from laneserve.gpu_worker.interleave import Interleaver
from laneserve.gpu_worker.kv_pool import plan_kv_pool
from laneserve.gpu_worker.model_files import model_display_name, resolve_model_path
from laneserve.gpu_worker.model_loader import load_model_files
from laneserve.gpu_worker.model_runner import ModelRunner
from laneserve.gpu_worker.models.llama import LlamaForCausalLM
from laneserve.gpu_worker.models.registry import build_model
from laneserve.gpu_worker.pooling import embedding_bytes, gather_pooled
from laneserve.gpu_worker.prompt_encoder import PromptEncoder
from laneserve.gpu_worker.prompt_logprobs import (
    attach_prompt_logprobs,
    flat_rows,
    prompt_logprob_rows,
    record_prompt_logprobs,
)
from laneserve.gpu_worker.quantization import resolve_mode
from laneserve.gpu_worker.request import Lane, Request, RequestStatus
from laneserve.gpu_worker.request_state import RequestState
from laneserve.gpu_worker.sampler import Sampler
from laneserve.gpu_worker.sampling_params import SamplingParams
from laneserve.gpu_worker.scheduler import Scheduler
from laneserve.gpu_worker.scheduler_config import SchedulerConfig
from laneserve.gpu_worker.scheduler_output import SchedulerOutput
from laneserve.gpu_worker.spec_decode import SpecRequest, spec_totals, verify
from laneserve.gpu_worker.speculation import Speculation
from laneserve.gpu_worker.structured_output import (
    GrammarCompiler,
    GrammarMask,
    StructuredOutputs,
    expand_mask_rows,
)

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Sampled:
    """One request's sampled tokens of a step (one, or with speculative decoding its accepted
    drafts plus one) and their logprobs, or the error that ended it."""

    state: RequestState
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict | None] = field(default_factory=list)
    error: str | None = None
    num_drafts: int = 0  # drafts verified this step
    num_accepted: int = 0  # of which accepted


class LLMEngine:
    """Continuous-batching engine over one model on one device (an `engine_protocol.Engine`).

    Step knobs the config leaves at None take `ENGINE_DEFAULTS` (a worker resolves its lane
    profile before, see gpu_worker/config.py).

    Raises (constructor):
        ModelLoadError: the model cannot be found or loaded.
        ValueError: inconsistent options (dtype, KV pool smaller than max_model_len, ...).
    """

    def __init__(self, config: EngineConfig):
        config = config.with_profile(ENGINE_DEFAULTS)  # step knobs left to the lane profile
        self.config = config
        model = self._load_model(config)
        pool = plan_kv_pool(model, config, self.dtype, self.device)
        self.max_model_len = pool.max_model_len
        self.kv_pool = pool.info
        self._build_step_parts(model, pool.num_blocks)
        self.states: dict[str, RequestState] = {}
        self._pending: list[EngineOutput] = []  # aborts/errors reported at the next step
        self._embedded: list[RequestState] = []  # embed requests this step completed
        self.num_steps = 0
        self.num_generated_tokens = 0
        self.num_prefill_tokens = 0  # prompt positions computed (prefix-cache hits excluded)
        logger.info(
            "engine ready: model=%s dtype=%s device=%s blocks=%d x %d (KV %.2f GiB) max_model_len=%d",
            self.model_name, self.dtype, self.device, pool.num_blocks, config.block_size,
            self.runner.kv_cache_bytes() / 2**30, self.max_model_len,
        )  # fmt: skip
        if config.slo_control:  # SLO-driven step budgets, from a profile of the finished engine
            from laneserve.gpu_worker.step_profile import profile_engine

            self.scheduler.step_budget = profile_engine(self, config.slo)

    def _load_model(self, config: EngineConfig) -> LlamaForCausalLM:
        """Resolve the device, dtype, model path and weight kernels; load the model files and
        build the model (its tokenizer and config kept on the engine)."""
        self.device = torch.device(config.device) if config.device else default_device()
        self.dtype = resolve_dtype(config.dtype, self.device)
        path = resolve_model_path(config.model)
        quantization = resolve_mode(config.quantization, self.device, self.dtype)
        self.model_path, self.quantization = path, quantization
        loaded = load_model_files(path, quantization=quantization)
        self.model_name = model_display_name(config.model)
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.load_seconds = loaded.load_seconds
        weights, loaded.weights = loaded.weights, {}  # the model's own: freed as it takes them
        return build_model(
            loaded.config, weights, self.dtype, self.device, quantization, release_weights=True
        )

    def _build_step_parts(self, model: LlamaForCausalLM, num_blocks: int) -> None:
        """The model runner over a KV pool of `num_blocks`, the block manager, scheduler,
        sampler and grammar compiler."""
        config, max_len = self.config, self.max_model_len
        self.runner = ModelRunner(
            model,
            config.block_size,
            num_blocks,
            use_cuda_graphs=not config.enforce_eager,
            max_num_seqs=config.max_num_seqs,
            max_model_len=max_len,
        )
        self.block_manager = BlockManager(
            num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            sliding_window=self.model_config.kv_sliding_window,
        )
        self.scheduler = Scheduler(SchedulerConfig.from_engine(config, max_len), self.block_manager)
        self.speculation = Speculation(config.speculative_config, self._spec_of, max_len)
        self.scheduler.propose_drafts = self.speculation.propose  # drafts are the scheduler's
        self.interleave = Interleaver(self)  # the worker's interactive steps between layers
        self.eos_token_ids = frozenset(model.config.eos_token_ids)
        self.sampler = Sampler(sorted(self.eos_token_ids))
        # the front end's prompt encoder (the worker's, the offline LLM's): `add` takes ids only
        self.prompts = PromptEncoder(self.tokenizer, self.model_config.vocab_size)
        self.apply_chat_template = self.prompts.apply_chat_template
        self.token_id_limit = self.prompts.token_id_limit
        self.token_text = self.prompts.prompt_tokenizer.token_text  # logprobs' token texts
        self.structured = StructuredOutputs(
            GrammarCompiler(
                self.tokenizer, self.model_config.vocab_size, sorted(self.eos_token_ids)
            )
        )

    # ------------------------------------------------------------------ requests

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | dict | None = None,
        lane: str = "batch",
        priority: int = 0,
        arrival_time: float | None = None,
        task: str = "generate",
    ) -> Request:
        """`add` an `EngineRequest` of these fields (a text prompt: `self.prompts.encode` first)."""
        return self.add(EngineRequest(request_id, prompt_token_ids, sampling_params, lane,
                                      priority, arrival_time, task))  # fmt: skip

    def add(self, request: EngineRequest) -> Request:
        """Queue a request; its outputs come from later `step()` calls.

        `request.sampling_params` is a `SamplingParams`, its `to_dict()` form (the wire format)
        or None (defaults); the prompt is token ids (a text or chat prompt is encoded before,
        by the front end: `self.prompts`, gpu_worker/prompt_encoder.py).
        `request.task` "embed": prefill only, its final output carries the pooled hidden state
        (`config.pooling_type`, gpu_worker/pooling.py); sampling params are ignored.

        Raises:
            InvalidRequestError: bad prompt, params or lane; duplicate id.
            PromptTooLongError: the prompt leaves no room for one output token.
        """
        request_id, sampling_params, task = (
            request.request_id,
            request.sampling_params,
            request.task,
        )
        if request_id in self.states:
            raise InvalidRequestError(f"duplicate request_id {request_id!r}")
        params = SamplingParams.for_task(sampling_params, task)
        if request.output_token_ids and params.structured_outputs is not None:
            raise InvalidRequestError("a request with structured outputs cannot be resumed")
        try:
            lane_enum = Lane(request.lane)
        except ValueError:
            raise InvalidRequestError(
                f"lane must be 'interactive' or 'batch', got {request.lane!r}"
            ) from None
        ids = self.prompts.check_ids(request.prompt_token_ids)
        resumed = request.output_token_ids or []
        resumed = self.prompts.check_ids(resumed, "output_token_ids") if resumed else []
        if len(ids) + len(resumed) >= self.max_model_len:
            raise PromptTooLongError(
                len(ids),
                self.max_model_len,
                f"prompt has {len(ids)} tokens; max_model_len={self.max_model_len} allows at most "
                f"{self.max_model_len - 1} prompt tokens (one output token must fit)",
            )
        req = Request(
            request_id=request_id,
            prompt_token_ids=ids,
            sampling_params=params,
            lane=lane_enum,
            priority=int(request.priority),
            arrival_time=time.monotonic() if request.arrival_time is None else request.arrival_time,
            pooling_type=self.config.pooling_type if task == "embed" else None,
            output_token_ids=resumed,
            num_resumed_tokens=len(resumed),
        )
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device="cpu")
            generator.manual_seed(params.seed)
        if params.structured_outputs is not None:  # scheduled once its grammar is compiled
            self.structured.add(request_id, params.structured_outputs)
        else:
            self.scheduler.add_request(req)
        detokenizer = IncrementalDetokenizer(self.tokenizer, ids, params)
        detokenizer.resume(resumed)  # their text went out with the earlier attempt
        self.states[request_id] = RequestState(req, detokenizer, generator, params)
        if task == "generate":
            self.states[request_id].spec = self.speculation.new_request(ids + resumed, params)
        if params.prompt_logprobs is not None:
            # position 0 has no logprob; its entry names the token (the API's echo needs it)
            first = {"token_id": ids[0], "logprob": None, "rank": None, "top": []}
            self.states[request_id].prompt_logprobs = [first]
        return req

    def abort_request(self, request_id: str) -> None:
        """Stop a request and free its KV blocks; its final delta (reason "abort") comes next step."""
        if self.interleave.defer_abort(request_id):
            return  # in the step in flight: aborted when it ends
        state = self.states.pop(request_id, None)
        if state is None:
            return
        if not self.structured.discard(request_id):
            self.scheduler.abort_request(request_id)
        self._pending.append(self._final(state, "", [], "abort"))

    def has_unfinished_requests(self) -> bool:
        return bool(self.states) or bool(self._pending)

    # ------------------------------------------------------------------ one step

    def step(self) -> list[EngineOutput]:
        """Run one engine step, `schedule -> execute -> update`; returns the outputs it produced
        (possibly none)."""
        outputs, self._pending = self._pending, []
        self._embedded = []
        if self.structured.num_pending:
            outputs.extend(self._admit_compiled())
        started = time.perf_counter()
        out = self.scheduler.schedule()  # speculative drafts proposed first (`Speculation`)
        if out.is_empty:
            return outputs
        sampled = self._execute(out, outputs)
        spent, aborts = self.interleave.end_step()
        if sampled is not None:
            outputs.extend(self._update(out, sampled, started + spent))
        for request_id in aborts:
            self.abort_request(request_id)
        return outputs

    def _execute(self, out: SchedulerOutput, outputs: list[EngineOutput]) -> list[_Sampled] | None:
        """Run the scheduled step (`execute_model`). A failed forward fails this step's
        requests (their finals go to `outputs`), not the engine: None then."""
        self.num_steps += 1
        try:
            started, before = time.perf_counter(), self.interleave.spent_s
            sampled = self.execute_model(out)
            started += self.interleave.spent_s - before  # interleaved steps' time: not this one's
            self.speculation.observe_execute(out.num_batched_tokens, started)
            return sampled
        except Exception as exc:
            logger.exception("engine step failed; failing %d requests", len(out.scheduled))
            for entry in out.scheduled:
                state = self.states.pop(entry.request.request_id, None)
                if state is not None:
                    self.scheduler.finish_request(state.request, RequestStatus.FINISHED_ERROR)
                    outputs.append(
                        self._final(state, "", [], "error", error=f"engine step failed: {exc}")
                    )
            return None

    def _update(
        self, out: SchedulerOutput, sampled: list[_Sampled], started: float
    ) -> list[EngineOutput]:
        """Advance the scheduler past the step (rejected drafts rolled back) and turn each
        request's sampled tokens into its output; a request whose output processing raises
        ends alone with finish_reason "error"."""
        self.num_prefill_tokens += sum(
            max(0, min(e.num_computed_tokens + e.num_new_tokens, e.request.num_prompt_tokens)
                - e.num_computed_tokens)
            for e in out.scheduled
        )  # fmt: skip
        self.scheduler.update_after_step(out, self.speculation.record(sampled))
        now = time.monotonic()
        outputs = []
        outputs.extend(self._finish_embed(state, now) for state in self._embedded)
        for row in sampled:
            if row.error is None:
                try:
                    outputs.append(
                        attach_prompt_logprobs(row.state, self._process_tokens(row, now))
                    )
                    continue
                except Exception as exc:  # this request's output only: the others go on
                    logger.exception(
                        "output processing failed for %s", row.state.request.request_id
                    )
                    row.error = f"output processing failed: {type(exc).__name__}: {exc}"
            outputs.append(self._fail(row.state, row.error))
        self.speculation.observe_wall(out, sampled, started)
        return outputs

    def _spec_of(self, req: Request) -> tuple[SpecRequest | None, SamplingParams]:
        state = self.states[req.request_id]
        return state.spec, state.params

    def _admit_compiled(self) -> list[EngineOutput]:
        """Schedule the requests whose grammar is compiled; end those whose compile failed.
        With nothing else to run, wait briefly for a compile rather than spin."""
        idle = not self.scheduler.requests
        deltas = []
        for ready in self.structured.take_ready(wait_s=0.05 if idle else 0.0):
            state = self.states.get(ready.request_id)
            if state is None:
                continue
            if ready.error is not None:
                self.states.pop(ready.request_id)
                deltas.append(self._final(state, "", [], "error", error=ready.error))
                continue
            state.matcher = ready.matcher
            self.scheduler.add_request(state.request)
        return deltas

    def _finish_embed(self, state: RequestState, now: float) -> EngineOutput:
        """End an embed request whose prompt is computed: free its blocks at once, send the
        pooled vector. Its prefill ends now; it has no output token, so no decode or TPOT."""
        req = state.request
        try:
            vector = embedding_bytes(state.pooled, req.pooling_type, req.num_prompt_tokens)
        except Exception as exc:  # this request only
            logger.exception("pooling failed for %s", req.request_id)
            return self._fail(state, f"pooling failed: {type(exc).__name__}: {exc}")
        req.first_token_time = now
        self.states.pop(req.request_id, None)
        self.scheduler.finish_request(req, RequestStatus.FINISHED_STOPPED)
        return self._final(state, "", [], "stop")._replace(embedding=vector)

    def _fail(self, state: RequestState, error: str) -> EngineOutput:
        """End one request with finish_reason "error" (the broker reports `engine_error`)."""
        self.states.pop(state.request.request_id, None)
        self.scheduler.finish_request(state.request, RequestStatus.FINISHED_ERROR)
        return self._final(state, "", [], "error", error=error[:2000])

    def execute_model(self, out: SchedulerOutput) -> list[_Sampled]:
        """Run the model on one scheduled step and sample one token for every request that
        emits one. What it raises fails that step's requests (`step`); a row whose sampling
        fails comes back with its error (`_sample`). A wrapper may decorate it on an instance
        (gpu_worker/faults.py injects test faults so)."""
        entries = out.scheduled
        num_drafts = [len(e.spec_token_ids) for e in entries]
        inputs = self.runner.prepare_inputs(
            [
                e.request.token_ids_slice(
                    e.num_computed_tokens, e.num_computed_tokens + e.num_new_tokens - nd
                )
                + list(e.spec_token_ids)
                for e, nd in zip(entries, num_drafts, strict=True)
            ],
            [e.num_computed_tokens for e in entries],
            [e.request.block_table for e in entries],
            [e.samples for e in entries],
            num_drafts,
            [e.request.pooling_type for e in entries],
        )
        num_sampled = inputs.logits_indices.shape[0]
        prompt_rows = prompt_logprob_rows(entries, self.states)
        if prompt_rows:  # extra logits rows for the prompt positions of requests that ask
            inputs.logits_indices = torch.cat(
                [inputs.logits_indices, flat_rows(prompt_rows, inputs.logits_indices.device)]
            )
        states = [self.states[entries[i].request.request_id] for i in inputs.sample_rows]
        # constrained rows: greedy ones are sampled without a mask first (`redo_refused`), the
        # others' bitmasks are computed while the forward pass runs
        greedy = [s.matcher if s.params.greedy else None for s in states]
        greedy = [None if g is None or g.mask_first() else g for g in greedy]
        masks = self.structured.start_bitmask(
            [None if g else s.matcher for g, s in zip(greedy, states, strict=True)]
        )
        inputs.pause = self.interleave.layer_hook(out)
        logits = self.runner.execute(inputs)
        if inputs.pooled is not None:  # embed requests: their final hidden rows
            logits, hidden = logits
            self._embedded = gather_pooled(entries, inputs.pooled, hidden, self.states)
        if prompt_rows:
            record_prompt_logprobs(prompt_rows, logits[num_sampled:])
            logits = logits[:num_sampled]
        if not inputs.sample_rows:
            return []
        drafts = [entries[i].spec_token_ids for i in inputs.sample_rows]
        masks = None if masks is None else expand_mask_rows(masks.result(), drafts)
        rows = self._sample(logits, states, drafts, masks)
        return self.structured.redo_refused(
            rows, greedy, drafts,
            lambda at, idx, mask: self._sample(
                logits[at], [states[i] for i in idx], [()] * len(idx), mask
            ),
        )  # fmt: skip

    def _sample(
        self,
        logits: torch.Tensor,
        states: list[RequestState],
        drafts: list[tuple[int, ...]],
        masks: GrammarMask | None = None,
    ) -> list[_Sampled]:
        """Sample the `[sum(1 + len(drafts[i])), V]` logits of `states` as one batch (request i
        owns `1 + len(drafts[i])` consecutive rows; `masks` rows index those rows); when that
        raises, restore the seeded generators and sample request by request, so only the
        requests that fail on their own end (with their error) and the others get the tokens
        the batch would have given them."""
        saved = [None if s.generator is None else s.generator.get_state() for s in states]
        try:
            return self._sample_rows(logits, states, drafts, masks)
        except Exception:
            logger.exception("batched sampling failed; sampling %d rows one by one", len(states))
        rows: list[_Sampled] = []
        start = 0
        for i, state in enumerate(states):
            end = start + 1 + len(drafts[i])
            if saved[i] is not None:
                state.generator.set_state(saved[i])
            try:
                row_mask = None if masks is None else masks.row(start)
                rows += self._sample_rows(logits[start:end], [state], drafts[i : i + 1], row_mask)
            except Exception as exc:
                logger.exception("sampling failed for %s", state.request.request_id)
                rows.append(_Sampled(state, error=f"sampling failed: {type(exc).__name__}: {exc}"))
            start = end
        return rows

    def _sample_rows(
        self,
        logits: torch.Tensor,
        states: list[RequestState],
        drafts: list[tuple[int, ...]],
        masks: GrammarMask | None,
    ) -> list[_Sampled]:
        runs = verify(
            self.sampler,
            logits,
            [s.params for s in states],
            [s.generator for s in states],
            [s.request.prompt_token_ids for s in states],
            [s.request.output_token_ids for s in states],
            drafts,
            masks,
        )
        return [
            _Sampled(s, r.token_ids, r.logprobs, num_drafts=len(d), num_accepted=r.num_accepted)
            for s, r, d in zip(states, runs, drafts, strict=True)
        ]

    def _process_tokens(self, row: _Sampled, now: float) -> EngineOutput:
        """Append a step's tokens of one request, one by one, until one of them stops it (EOS,
        stop id, stop string, max_tokens, max_model_len): the tokens after it are dropped, so a
        stop inside an accepted speculative run cuts the run at the right token."""
        state = row.state
        req, params = state.request, state.params
        texts: list[str] = []
        kept: list[int] = []
        reason = None
        grammar_done = False
        for token_id in row.token_ids:
            if state.matcher is not None and state.matcher.accept([token_id]) != 1:
                raise RuntimeError(
                    f"token {token_id} breaks the grammar: {state.matcher.error()[:200]}"
                )
            req.append_output_token_ids(token_id, now)
            if state.spec is not None:
                state.spec.history.extend((token_id,))
            kept.append(token_id)
            self.num_generated_tokens += 1
            n_out = req.num_output_tokens
            stop_token = n_out > params.min_tokens - 1 and (
                (token_id in self.eos_token_ids and not params.ignore_eos)
                or token_id in params.stop_token_ids
            )
            upd = state.detokenizer.update([token_id], stop_terminated=stop_token)
            texts.append(upd.delta_text)
            grammar_done = (
                state.matcher is not None and state.matcher.is_terminated and not stop_token
            )
            if stop_token or upd.stop_matched is not None or grammar_done:
                reason = "stop"
            elif n_out >= params.max_tokens or req.num_tokens >= self.max_model_len:
                reason = "length"
            if reason is not None:
                break
        text = "".join(texts)
        lps = row.logprobs[: len(kept)]
        lp = label_logprobs(lps, self.token_text) if any(x is not None for x in lps) else None
        if reason is None:
            state.text_parts.append(text)
            return EngineOutput(req.request_id, text, kept, False, logprobs=lp)
        if reason == "length" or grammar_done:
            text += state.detokenizer.flush()
        self.states.pop(req.request_id, None)
        self.scheduler.finish_request(
            req,
            RequestStatus.FINISHED_STOPPED if reason == "stop" else RequestStatus.FINISHED_LENGTH,
        )
        return self._final(state, text, kept, reason, logprobs=lp)

    def _final(
        self,
        state: RequestState,
        text: str,
        token_ids: list[int],
        reason: str,
        logprobs: list | None = None,
        error: str | None = None,
    ) -> EngineOutput:
        state.text_parts.append(text)
        if state.request.finished_time is None:
            state.request.finished_time = time.monotonic()
        req = state.request
        return EngineOutput(
            req.request_id, text, token_ids, True, reason, logprobs, req.metrics(), error
        )

    # ------------------------------------------------------------------ introspection

    def stats(self) -> dict[str, Any]:
        """Queue and KV figures: num_total_blocks, num_free_blocks, kv_usage, num_running,
        num_waiting, prefix_cache_queries, prefix_cache_hits (tokens), num_preemptions,
        num_steps, num_generated_tokens, num_prefill_tokens (prompt positions computed, cache hits
        excluded), num_prompts_tokenized (prompts its front end, `self.prompts`, templated or
        tokenized: the edge sends ids), num_interleaved_steps (gpu_worker/interleave.py), and
        speculative decoding's totals spec_draft_tokens,
        spec_accepted_tokens, spec_num_drafts, spec_propose_ms (`spec_decode.spec_totals`)."""
        stats = dict(self.scheduler.stats())
        stats.update(
            num_steps=self.num_steps,
            num_generated_tokens=self.num_generated_tokens,
            num_prefill_tokens=self.num_prefill_tokens,
            num_prompts_tokenized=self.prompts.num_prompts_tokenized,
            num_interleaved_steps=self.interleave.num_steps,
            **spec_totals(self.speculation.controller),
        )
        return stats

    def check_integrity(self) -> None:
        """Verify KV bookkeeping invariants (raises AssertionError with a message)."""
        self.block_manager.check_integrity()
        live = set(self.scheduler.requests)
        known = {rid for rid in self.states if not self.structured.is_pending(rid)}
        assert live == known, f"engine/scheduler request sets differ: {live ^ known}"
