"""Phase-free continuous-batching scheduler with lanes, chunked prefill and preemption.

The idea is vLLM v1's: there is no prefill phase and decode phase. Every request has
`num_computed_tokens` and catches up to `num_tokens` under a per-step token budget, so prefill
chunks and decodes share one step. One `schedule()`:

1. **Running requests**, in scheduling order (interactive first, then `priority`, then arrival):
   a decode takes 1 token, an unfinished prefill takes
   `min(remaining, budget, long_prefill_token_threshold, batch cap)`. When the block manager
   cannot hold the new tokens, the lowest-ranked running request not yet scheduled this step
   (batch before interactive, then the least urgent priority, then the newest) is preempted
   by recompute: its blocks are freed, `num_computed_tokens` goes back to 0 and it returns to
   the waiting queue (where its old arrival time puts it ahead of newer requests of its class).
   That victim may be the request itself.
2. **Waiting requests**, in the same order, only when step 1 preempted nothing (as in vLLM):
   prefix-cache lookup, then admission under `max_num_seqs`, the token budget and a free-block
   watermark. A request that cannot be admitted because `max_num_seqs` or the KV blocks are
   taken preempts the lowest-ranked running request it outranks -- any batch request for an
   interactive one, a less urgent `priority` of its own lane otherwise (undoing its slot in
   this step when it had one) -- but only when preempting all of those would make room,
   counting only blocks that freeing really returns. A request preempted
   `priority_preemption_limit` times is protected from priority preemption for a while after it
   runs again (the ping-pong guard). A request that does not fit blocks the ones behind it (no
   overtaking inside the order, so batch never jumps an interactive request).

Lanes inside one worker (DESIGN.md): while any interactive request is running or waiting, the
batch lane's tokens per step (decodes and prefill chunks alike, in scheduling order) are capped
at `interactive_batch_token_cap` (and at half the budget); batch requests beyond the cap keep
their KV and seats and simply skip the step. Without interactive traffic batch gets the whole
budget, unless an operator sets `batch_token_budget` (an opt-in limit on every batch step).
Under a cap, batch requests take turns: each capped step starts after the last batch request
the previous one served, so the skipped ones differ from step to step. The SLO controller may
also cap the batch decodes of a batch-only step (`StepBudget.batch_decode_rows`, so prefill keeps
its share of a step bounded by the TTFT slack); the skipped decodes take turns the same way.

The engine loop is ``out = schedule(); run the model on out.scheduled; update_after_step(out);
append the sampled token of every entry with samples=True; finish_request(...) the ones that stop``.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import logging
import time
from collections.abc import Callable

from laneserve.gpu_worker.block_manager import NULL_BLOCK, BlockManager
from laneserve.gpu_worker.request import Lane, Request, RequestStatus
from laneserve.gpu_worker.scheduler_config import SchedulerConfig
from laneserve.gpu_worker.scheduler_output import ScheduledRequest, SchedulerOutput
from laneserve.gpu_worker.step_budget import BudgetController, StepView
from laneserve.gpu_worker.step_cost import StepFeatures, chunk_pairs

__all__ = ["Scheduler", "step_features"]

logger = logging.getLogger(__name__)


def _is_decode(req: Request, start: int) -> bool:
    """True when computing from position `start` is a plain decode (the last sampled token)."""
    return req.num_output_tokens > 0 and start == req.num_tokens - 1


def step_features(out: SchedulerOutput) -> StepFeatures:
    """What a step runs, for the step-cost model: tokens, rows that sample, KV context read,
    and the prefill chunks' attention pairs (a draft verification's rows decode)."""
    scheduled = out.scheduled
    return StepFeatures(
        out.num_batched_tokens,
        sum(e.samples for e in scheduled),
        sum(e.num_computed_tokens + e.num_new_tokens for e in scheduled),
        sum(
            chunk_pairs(e.num_new_tokens, e.num_computed_tokens)
            for e in scheduled
            if e.num_new_tokens > 1 and not e.spec_token_ids
        ),
    )


class _StepState:
    """Mutable bookkeeping for building one step."""

    __slots__ = (
        "budget", "batch_cap_left", "batch_decodes_left", "batch_drafts_left", "entries",
        "preempted", "interleaved",
    )  # fmt: skip

    def __init__(
        self,
        budget: int,
        batch_cap: int | None,
        batch_decodes: int | None = None,
        batch_drafts: int | None = None,
        interleaved: bool = False,
    ) -> None:
        self.budget = budget
        self.interleaved = interleaved  # `schedule_interleaved`: no preemption, no seat limit
        self.batch_cap_left = batch_cap  # None: batch tokens uncapped this step
        self.batch_decodes_left = batch_decodes  # None: every batch decode may run this step
        self.batch_drafts_left = batch_drafts  # None: batch drafts bounded by the budget only
        self.entries: dict[str, ScheduledRequest] = {}
        self.preempted: list[Request] = []


class Scheduler:
    """Decides, each step, which requests compute how many tokens.

    Args:
        config: the scheduling knobs.
        block_manager: the KV block manager shared with the model runner.

    Raises:
        ValueError: when the KV pool cannot hold one `max_model_len` sequence.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        step_budget: BudgetController | None = None,
    ) -> None:
        need = block_manager.num_blocks_for(config.max_model_len)
        if need > block_manager.num_total_blocks:
            raise ValueError(
                f"KV cache of {block_manager.num_total_blocks} blocks x {block_manager.block_size} "
                f"tokens cannot hold one max_model_len={config.max_model_len} sequence "
                f"({need} blocks)"
            )
        self.config = config
        self.block_manager = block_manager
        self.waiting: list[Request] = []  # sorted by _key
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # unfinished requests by id
        self.num_preemptions = 0  # total since start
        self._seq = itertools.count()  # ties on equal keys keep add order
        self._keys: dict[str, tuple[int, int, float, int]] = {}  # fixed at add_request
        self._num_interactive = 0  # unfinished interactive requests (running or waiting)
        self._watermark_blocks = int(config.watermark * block_manager.num_total_blocks)
        self._num_steps = 0  # schedule() calls
        self._protected_until: dict[str, int] = {}  # ping-pong guard: request id -> step
        self._last_batch_key: tuple | None = None  # last batch request served under a cap
        # SLO-driven budgets (gpu_worker/step_budget.py); None: the fixed knobs alone
        self.step_budget = step_budget
        self.last_features: StepFeatures | None = None  # what the last non-empty step ran
        # speculative drafts of the running requests, set before each step's budget is handed
        # out (the engine's `Speculation.propose`; no drafts by default)
        self.propose_drafts: Callable[[list[Request]], None] = lambda running: None

    # --- queue views ---
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def stats(self) -> dict[str, int | float]:
        """Queue and KV figures for `LLM.stats()` and worker snapshots.

        Keys: num_total_blocks, num_free_blocks, kv_usage (0..1), num_running, num_waiting,
        prefix_cache_queries, prefix_cache_hits (tokens), num_preemptions (total).
        """
        bm = self.block_manager
        return {
            "num_total_blocks": bm.num_total_blocks,
            "num_free_blocks": bm.num_free_blocks,
            "kv_usage": bm.usage,
            "num_running": self.num_running,
            "num_waiting": self.num_waiting,
            "prefix_cache_queries": bm.prefix_cache_queries,
            "prefix_cache_hits": bm.prefix_cache_hits,
            "num_preemptions": self.num_preemptions,
        } | (self.step_budget.stats() if self.step_budget is not None else {})

    def _key(self, req: Request) -> tuple[int, int, float, int]:
        """Scheduling order: lane rank, priority, arrival time, add order (ascending = first)."""
        return self._keys[req.request_id]

    def _has_interactive(self) -> bool:
        return self._num_interactive > 0

    # --- request life cycle ---
    def add_request(self, request: Request) -> None:
        """Queue a new request (status WAITING).

        Raises:
            ValueError: duplicate `request_id`, or an empty prompt.
        """
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request_id {request.request_id!r}")
        if not request.prompt_token_ids:
            raise ValueError(f"request {request.request_id!r} has an empty prompt")
        assert request.num_tokens <= self.config.max_model_len, (
            f"request {request.request_id!r} has {request.num_tokens} tokens > max_model_len="
            f"{self.config.max_model_len}; the engine must reject it before add_request"
        )
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self._keys[request.request_id] = (*request.sort_key, next(self._seq))
        self._num_interactive += request.lane is Lane.INTERACTIVE
        if self.step_budget is not None and request.lane is Lane.INTERACTIVE:
            self.step_budget.note_arrival(len(request.prompt_token_ids))
        self._enqueue_waiting(request)

    def _enqueue_waiting(self, request: Request) -> None:
        bisect.insort(self.waiting, request, key=self._key)

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        """Finish `request` with a FINISHED_* `status`: free its blocks, drop it from the queues."""
        assert status.is_finished, f"finish_request with non-finished status {status}"
        if request.status.is_finished:
            return
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.block_manager.free(request)
        request.status = status
        request.finished_time = time.monotonic()
        del self.requests[request.request_id]
        del self._keys[request.request_id]
        self._protected_until.pop(request.request_id, None)
        self._num_interactive -= request.lane is Lane.INTERACTIVE
        if self.step_budget is not None:
            self.step_budget.on_finish(request)

    def abort_request(self, request_id: str) -> Request | None:
        """Abort an unfinished request; returns it, or None if unknown or already finished."""
        request = self.requests.get(request_id)
        if request is not None:
            self.finish_request(request, RequestStatus.FINISHED_ABORTED)
        return request

    def preempt_request(self, request_id: str) -> bool:
        """Preempt a running request by recompute between steps (as when blocks run out: its
        blocks are freed, `num_computed_tokens` goes back to 0 and it waits again). For tests
        and operators; returns False when the request is not running."""
        request = self.requests.get(request_id)
        if request is None or request.status is not RequestStatus.RUNNING:
            return False
        self._preempt(_StepState(0, None), request)
        return True

    # --- one step ---
    def schedule(self) -> SchedulerOutput:
        """Build the next step (see the module docstring for the algorithm)."""
        self.propose_drafts(self.running)
        budget = self.config.max_num_batched_tokens
        cap = self.config.batch_token_budget
        inter_cap = self.config.interactive_batch_token_cap
        if inter_cap is not None and self._has_interactive():
            # leave at least half the step to interactive (waiting ones come last)
            inter_cap = max(1, min(inter_cap, self.config.max_num_batched_tokens // 2))
            cap = inter_cap if cap is None else min(cap, inter_cap)
        ctl = self.step_budget
        if ctl is not None:  # the SLO plan, within the fixed knobs
            ctl.observe_pending(time.monotonic())
            plan = ctl.plan(self._step_view())
            budget = min(budget, plan.token_budget)
            if plan.batch_tokens is not None:
                cap = plan.batch_tokens if cap is None else min(cap, plan.batch_tokens)
        self._num_steps += 1
        step = (
            _StepState(budget, cap, plan.batch_decode_rows, plan.batch_drafts)
            if ctl is not None
            else _StepState(budget, cap)
        )
        self._schedule_running(step)
        if not step.preempted:
            self._schedule_waiting(step)
        keys = self._keys
        scheduled = sorted(step.entries.values(), key=lambda e: keys[e.request.request_id])
        out = SchedulerOutput(
            scheduled=scheduled,
            preempted=step.preempted,
            num_batched_tokens=sum(e.num_new_tokens for e in scheduled),
        )
        self.last_features = None
        if scheduled:
            self.last_features = step_features(out)
            if ctl is not None:
                ctl.on_scheduled(
                    self.last_features,
                    any(e.spec_token_ids and e.request.lane is Lane.INTERACTIVE for e in scheduled),
                )
        return out

    def schedule_interleaved(self, budget: int | None = None) -> SchedulerOutput:
        """A step of interactive requests alone, run between the layers of a batch-only step in
        flight (gpu_worker/interleave.py): the running interactive requests, then waiting ones
        the free KV blocks hold, past `max_num_seqs` if need be. No batch request, preemption
        (the step in flight writes its requests' blocks), drafts or SLO plan; `budget` tokens
        (`BudgetController.interleaved_budget`) within `max_num_batched_tokens`."""
        budget = min(
            budget or self.config.max_num_batched_tokens, self.config.max_num_batched_tokens
        )
        step = _StepState(budget, 0, interleaved=True)
        self._schedule_running(step)
        self._schedule_waiting(step)
        scheduled = sorted(step.entries.values(), key=lambda e: self._key(e.request))
        n = sum(e.num_new_tokens for e in scheduled)
        return SchedulerOutput(scheduled, [], n, interleaved=True)

    def _step_view(self) -> StepView:
        """The running interactive streams (requests already emitting tokens), the running
        batch requests, their KV context, the prompt tokens interactive requests still have to
        prefill (waiting ones and running ones without output), the batch lane's prompts to
        prefill (`StepView.batch_prefill_parts`), each lane's deepest prefill, and the drafts."""
        streams = batch = context = batch_context = prompt = batch_prefill = batch_decodes = 0
        batch_depth, prompt_depth, drafts, batch_drafts, parts = 0, 0, 0, 0, []
        for r in sorted(self.running, key=self._key):  # a step's order (`_running_order`)
            if r.lane is Lane.BATCH:
                batch += 1
                batch_context += r.num_computed_tokens
                if _is_decode(r, r.num_computed_tokens):
                    batch_decodes += 1
                    batch_drafts += len(r.spec_token_ids)
                else:
                    batch_prefill += r.num_tokens - r.num_computed_tokens
                    batch_depth = max(batch_depth, r.num_computed_tokens)
                    parts.append((r.num_computed_tokens, r.num_tokens - r.num_computed_tokens))
            elif r.num_output_tokens:
                streams += 1
                context += r.num_computed_tokens
                drafts += len(r.spec_token_ids)
            else:
                prompt += r.num_tokens - r.num_computed_tokens
                prompt_depth = max(prompt_depth, r.num_computed_tokens)
        seats = self.config.max_num_seqs - len(self.running)
        for r in self.waiting:
            if r.lane is Lane.INTERACTIVE:  # interactive requests come first in the order
                prompt += r.num_tokens
            elif seats <= 0 or batch_prefill >= self.config.max_num_batched_tokens:
                break  # no seat for more, or more than a step could take anyway
            else:  # every prompt a free seat could take (one alone starved admission of
                seats -= 1  # short prompts: a 50-line job of ~100-token lines ran 3x slower)
                batch_prefill += r.num_tokens
                parts.append((0, r.num_tokens))
        return StepView(
            streams, batch, context, prompt, batch_context, batch_prefill, batch_decodes,
            batch_depth, prompt_depth, drafts, batch_drafts, tuple(parts),
        )  # fmt: skip

    def _chunk(self, step: _StepState, req: Request, remaining: int) -> int:
        """Tokens `req` may compute this step, given `remaining` tokens to catch up."""
        n = min(remaining, step.budget)
        threshold = self.config.long_prefill_token_threshold
        if threshold is not None:
            n = min(n, threshold)
        if req.lane is Lane.BATCH and step.batch_cap_left is not None:
            n = min(n, step.batch_cap_left)
        return n

    def _num_drafts(
        self, step: _StepState, req: Request, num_after: int, decodes_after: int,
        prefills_after: int,
    ) -> int:  # fmt: skip
        """Draft tokens a decoding `req` may add to its 1 token this step (speculative decoding):
        what is left of the budget and batch cap once every running request after it in the
        order that could still take a token has one, so drafts never displace another
        request's decode or starve a running prefill. Batch requests after it count as far as
        the batch cap lets them in, their decodes as far as the step's batch decode rows do
        (beside capped batch work a stream's drafts were once never sent); a batch request's
        drafts also stay within the plan's batch drafts (`StepBudget.batch_drafts`), so they
        never take the prefill chunk the plan priced in their place."""
        batch_after = decodes_after + prefills_after
        if step.batch_decodes_left is not None:
            decodes_after = min(decodes_after, max(step.batch_decodes_left, 0))
        batch_in = decodes_after + prefills_after
        if step.batch_cap_left is not None:
            batch_in = min(batch_in, max(step.batch_cap_left, 0))
        n = min(len(req.spec_token_ids), step.budget - 1 - (num_after - batch_after + batch_in))
        if req.lane is Lane.BATCH:
            if step.batch_cap_left is not None:
                n = min(n, step.batch_cap_left - 1 - batch_in)
            if step.batch_drafts_left is not None:
                n = min(n, step.batch_drafts_left)
        return max(n, 0)

    def _commit(self, step: _StepState, req: Request, n: int) -> None:
        """Record that `req` computes `n` tokens this step."""
        start = req.num_computed_tokens
        if not _is_decode(req, start):
            req.num_prefill_chunks += 1
        if req.lane is Lane.BATCH and step.batch_cap_left is not None:
            step.batch_cap_left -= n
        if req.first_scheduled_time is None:
            req.first_scheduled_time = time.monotonic()
        step.budget -= n
        samples = start + n >= req.num_tokens
        spec = tuple(req.spec_token_ids[: max(start + n - req.num_tokens, 0)])  # drafts sent
        if spec and req.lane is Lane.BATCH and step.batch_drafts_left is not None:
            step.batch_drafts_left -= len(spec)
        step.entries[req.request_id] = ScheduledRequest(req, n, samples, start, spec)

    def _running_order(self, step: _StepState) -> list[Request]:
        """Running requests in scheduling order. Under a batch cap, the batch decodes come
        first, starting after the last one the previous capped step served (round robin, so
        the decodes a cap skips change every step and every batch request progresses), then
        the batch prefills in order."""
        self.running.sort(key=self._key)  # nearly sorted already: O(n)
        if step.batch_cap_left is None and step.batch_decodes_left is None:
            return list(self.running)
        first = next((i for i, r in enumerate(self.running) if r.lane is Lane.BATCH), None)
        if first is None:
            return list(self.running)
        batch = self.running[first:]
        decodes = [r for r in batch if _is_decode(r, r.num_computed_tokens)]
        prefills = [r for r in batch if not _is_decode(r, r.num_computed_tokens)]
        cut = 0
        if self._last_batch_key is not None:
            cut = bisect.bisect_right(decodes, self._last_batch_key, key=self._key)
        return self.running[:first] + decodes[cut:] + decodes[:cut] + prefills

    def _schedule_running(self, step: _StepState) -> None:
        order = collections.deque(self._running_order(step))
        batch_prefills = sum(
            1 for r in order if r.lane is Lane.BATCH and not _is_decode(r, r.num_computed_tokens)
        )
        batch_decodes = sum(1 for r in order if r.lane is Lane.BATCH) - batch_prefills
        while order and step.budget > 0:
            req = order.popleft()
            if req.lane is Lane.BATCH:
                if _is_decode(req, req.num_computed_tokens):
                    batch_decodes -= 1
                else:
                    batch_prefills -= 1
            remaining = req.num_tokens - req.num_computed_tokens
            assert remaining >= 1, f"running request {req.request_id} has nothing to compute"
            assert req.num_tokens <= self.config.max_model_len, (
                f"{req.request_id} has {req.num_tokens} tokens > max_model_len; the engine must "
                "finish a request (finish_reason 'length') when it reaches max_model_len"
            )
            n = self._chunk(step, req, remaining)
            if n <= 0:
                continue
            capped_rows = req.lane is Lane.BATCH and step.batch_decodes_left is not None
            if capped_rows and _is_decode(req, req.num_computed_tokens):
                if step.batch_decodes_left <= 0:
                    continue  # this step's batch decodes are taken; it keeps its seat and KV
                step.batch_decodes_left -= 1
            if remaining == 1 and req.spec_token_ids:
                n += self._num_drafts(step, req, len(order), batch_decodes, batch_prefills)
            while not self.block_manager.allocate_slots(req, n):
                if n > remaining:  # drop the drafts before preempting anyone for them
                    n = remaining
                    continue
                if step.interleaved:
                    break  # no room without preempting: it waits for the step in flight
                victim = max(order, key=self._key) if order else req  # lowest ranked left
                if victim is not req:
                    order.remove(victim)
                self._preempt(step, victim)
                if victim is req:
                    break
            else:
                self._commit(step, req, n)
                capped = step.batch_cap_left is not None or step.batch_decodes_left is not None
                if capped and req.lane is Lane.BATCH and _is_decode(req, req.num_computed_tokens):
                    self._last_batch_key = self._key(req)

    def _schedule_waiting(self, step: _StepState) -> None:
        bm = self.block_manager
        while self.waiting and step.budget > 0:
            req = self.waiting[0]
            assert req.num_computed_tokens == 0, f"waiting {req.request_id} has computed tokens"
            hit_blocks, num_hit = bm.get_computed_blocks(req)
            if step.interleaved:  # the step in flight writes its new blocks layer by layer
                cut = next((i for i, b in enumerate(hit_blocks) if bm.is_uncomputed(b)), None)
                if cut is not None:
                    hit_blocks, num_hit = hit_blocks[:cut], cut * bm.block_size
            n = self._chunk(step, req, req.num_tokens - num_hit)
            if n <= 0:
                break
            seats_full = len(self.running) >= self.config.max_num_seqs and not step.interleaved
            reserve = self._watermark_blocks if self.running else 0
            while seats_full or not bm.allocate_slots(req, n, hit_blocks, reserve_blocks=reserve):
                # Preempt a lower-ranked request only when preempting them all makes room.
                victims = [] if step.interleaved else self._victims(req)
                if not self._can_make_room(req, n, hit_blocks, reserve, victims):
                    return
                self._preempt_lowest(step, req, victims)
                seats_full = len(self.running) >= self.config.max_num_seqs
                # Preemption may free (and then evict) the blocks of the hit: look up again.
                hit_blocks, num_hit = bm.get_computed_blocks(req)
                n = self._chunk(step, req, req.num_tokens - num_hit)
                reserve = self._watermark_blocks if self.running else 0
            self.waiting.pop(0)
            if req.num_preemptions >= self.config.priority_preemption_limit:
                until = self._num_steps + self.config.priority_preemption_cooldown_steps
                self._protected_until[req.request_id] = until
            req.num_computed_tokens = num_hit
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._commit(step, req, n)

    def _victims(self, req: Request) -> list[Request]:
        """Running requests that waiting `req` may preempt: any of a lower lane (interactive
        preempts batch), and those of its own lane with a less urgent `priority` unless the
        ping-pong guard protects them. Never a request whose prompt blocks computed this step
        are already shared (freeing it would leave the sharer without KV)."""
        bm = self.block_manager
        out = []
        for r in self.running:
            if r.lane.rank > req.lane.rank:
                pass
            elif r.lane is not req.lane or r.priority <= req.priority:
                continue
            elif self._protected_until.get(r.request_id, 0) > self._num_steps:
                continue
            if not bm.shares_uncomputed(r):
                out.append(r)
        return out

    def _can_make_room(
        self, req: Request, n: int, hit_blocks: list[int], reserve: int, victims: list[Request]
    ) -> bool:
        """Whether preempting every one of `victims` would let `req` allocate `n` tokens.

        Only blocks that freeing would really return count: the victims must hold all of a
        block's references, and a block of `req`'s own prefix hit does not count (freeing it
        returns it to the free list, but `req` takes it straight back).
        """
        if not victims:
            return False
        bm = self.block_manager
        uses = collections.Counter(b for r in victims for b in r.block_table if b != NULL_BLOCK)
        hit = set(hit_blocks)
        reclaim = sum(1 for b, c in uses.items() if bm.blocks[b].ref_count == c and b not in hit)
        return bm.num_free_after(req, n, hit_blocks) + reclaim >= reserve

    def _preempt_lowest(self, step: _StepState, req: Request, victims: list[Request]) -> None:
        """Preempt the lowest-ranked of `victims`, undoing its share of this step if it had one;
        a same-lane (priority) preemption counts towards the ping-pong guard."""
        victim = max(victims, key=self._key)
        entry = step.entries.pop(victim.request_id, None)
        if entry is not None:  # undo its share of this step
            step.budget += entry.num_new_tokens
            if not _is_decode(victim, entry.num_computed_tokens):
                victim.num_prefill_chunks -= 1
            if victim.lane is Lane.BATCH and step.batch_cap_left is not None:
                step.batch_cap_left += entry.num_new_tokens
        if victim.lane is req.lane:
            logger.info(
                "priority preemption: %s (priority %d) for %s (priority %d)",
                victim.request_id, victim.priority, req.request_id, req.priority,
            )  # fmt: skip
        self._preempt(step, victim)

    def _preempt(self, step: _StepState, req: Request) -> None:
        """Preempt `req` by recompute: free its blocks and put it back in the waiting queue."""
        logger.debug("preempting %s (%s, priority %d)", req.request_id, req.lane, req.priority)
        self.running.remove(req)
        self.block_manager.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        step.preempted.append(req)
        self._enqueue_waiting(req)

    def update_after_step(
        self, output: SchedulerOutput, num_rejected: dict[str, int] | None = None
    ) -> None:
        """Advance `num_computed_tokens` of every scheduled request and cache its full blocks.

        Call once per step, after the model ran and before appending the sampled tokens.
        Requests finished or aborted since `schedule()` are skipped. `num_rejected` (speculative
        decoding): per request id, drafts of its `spec_token_ids` that were rejected; only the
        input token and the accepted drafts count as computed, and the lookahead blocks past
        the next position are returned. Blocks are registered in the prefix cache only up to
        the tokens known before this step's output (accepted drafts register next step, with
        their tokens), so a block holding rejected K/V is never registered.
        """
        if self.step_budget is not None and not output.interleaved:
            self.step_budget.on_step_done()  # (the step in flight's, not an interleaved one's)
        for entry in output.scheduled:
            req = entry.request
            if req.status is not RequestStatus.RUNNING:
                continue
            assert req.num_computed_tokens == entry.num_computed_tokens, (
                f"{req.request_id} changed num_computed_tokens during the step"
            )
            req.num_computed_tokens += entry.num_new_tokens
            if entry.spec_token_ids:
                rejected = len(entry.spec_token_ids)
                if num_rejected is not None:
                    rejected = num_rejected.get(req.request_id, rejected)
                req.num_computed_tokens -= rejected
                self.block_manager.trim(req, req.num_computed_tokens + 1)
            self.block_manager.cache_full_blocks(req, min(req.num_computed_tokens, req.num_tokens))
            self.block_manager.free_outside_window(req)  # registered first, then out of the window
