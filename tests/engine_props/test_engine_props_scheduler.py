"""Stateful property test of Scheduler + BlockManager (no model).

Hypothesis drives random sequences of add (with shared prefixes, so the prefix cache hits),
abort, step and forced preemption under random budgets, block sizes, seats, caps, lanes and
priorities. The model is played by a fake KV cache (slot -> (token, position)) that checks every
position a request attends to holds its own token, and a deterministic fake sampler (the next
token is a function of the sequence, so identical prompts have identical continuations and
their output blocks are shared too). After every rule: `check_integrity()`, no block leaked, the
queues agree with the statuses; after every step: budget, seats, caps and lane order; at the
end, every request finished or was aborted and every block is free.
"""

from __future__ import annotations

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)

from laneserve.gpu_worker.block_manager import BlockManager
from laneserve.gpu_worker.request import Lane, Request, RequestStatus
from laneserve.gpu_worker.scheduler import Scheduler
from laneserve.gpu_worker.scheduler_config import SchedulerConfig
from tests.engine_props.props_helpers import prop_settings

PREFIXES = [[], [3, 1, 4, 1, 5, 9, 2, 6], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7], [7] * 20]


def fake_next_token(tokens: list[int]) -> int:
    """The fake model's 'sampled' token: a function of the sequence only."""
    return (sum(tokens) * 31 + len(tokens)) % 13 + 1


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        block_size=st.sampled_from([1, 2, 4, 4, 8, 16]),
        pool_factor=st.sampled_from([1, 2, 4]),
        max_num_seqs=st.integers(1, 6),
        budget=st.integers(1, 48),
        threshold=st.none() | st.integers(1, 24),
        inter_cap=st.none() | st.integers(1, 16),
        batch_budget=st.none() | st.integers(1, 32),
        prefix=st.sampled_from([True, True, True, False]),
    )
    def setup(
        self,
        block_size,
        pool_factor,
        max_num_seqs,
        budget,
        threshold,
        inter_cap,
        batch_budget,
        prefix,
    ):
        self.max_model_len = 48
        num_blocks = -(-self.max_model_len // block_size) * pool_factor
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix)
        self.cfg = SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=self.max_model_len,
            long_prefill_token_threshold=threshold,
            interactive_batch_token_cap=inter_cap,
            batch_token_budget=batch_budget,
        )
        self.sched = Scheduler(self.cfg, self.bm)
        self.kv: dict[tuple[int, int], tuple[int, int]] = {}
        self.live: dict[str, Request] = {}
        self.max_tokens: dict[str, int] = {}
        self.done: dict[str, RequestStatus] = {}
        self.clock = 0.0
        self.num_added = 0
        self.prompts: list[list[int]] = []
        self.all_requests: list[Request] = []

    # ------------------------------------------------------------------ rules

    @rule(
        prefix=st.sampled_from(PREFIXES),
        body=st.lists(st.integers(1, 40), min_size=0, max_size=20),
        lane=st.sampled_from([Lane.INTERACTIVE, Lane.BATCH]),
        priority=st.integers(0, 2),
        max_tokens=st.integers(1, 12),
        same_time=st.booleans(),
    )
    def add(self, prefix, body, lane, priority, max_tokens, same_time):
        prompt = (prefix + body)[: self.max_model_len - 1] or [1]
        if not same_time:
            self.clock += 1.0
        rid = f"r{self.num_added}"
        self.num_added += 1
        req = Request(rid, prompt, None, lane=lane, priority=priority, arrival_time=self.clock)
        self.sched.add_request(req)
        self.all_requests.append(req)
        self.prompts.append(prompt)
        self.live[rid] = req
        self.max_tokens[rid] = max_tokens

    @rule(
        pick=st.integers(0, 10**6),
        extra=st.lists(st.integers(1, 40), max_size=6),
        lane=st.sampled_from([Lane.INTERACTIVE, Lane.BATCH]),
        max_tokens=st.integers(1, 12),
    )
    def add_again(self, pick, extra, lane, max_tokens):
        """A prompt that repeats an earlier one (a prefix-cache hit once that one computed)."""
        if not self.prompts:
            return
        earlier = self.prompts[pick % len(self.prompts)]
        self.add(earlier, extra, lane, 0, max_tokens, False)

    @rule(pick=st.integers(0, 10**6))
    def abort(self, pick):
        if not self.live:
            return
        rid = sorted(self.live)[pick % len(self.live)]
        assert self.sched.abort_request(rid) is self.live[rid]
        self._finished(rid)

    @rule(pick=st.integers(0, 10**6))
    def preempt(self, pick):
        if not self.sched.running:
            return
        req = self.sched.running[pick % len(self.sched.running)]
        before = req.num_preemptions
        assert self.sched.preempt_request(req.request_id)
        assert req.status is RequestStatus.PREEMPTED and req.num_computed_tokens == 0
        assert req.block_table == [] and req.num_preemptions == before + 1

    @rule()
    def step(self):
        self._step()

    # ------------------------------------------------------------------ one step

    def _step(self) -> int:
        sched, cfg = self.sched, self.cfg
        waiting_before = list(sched.waiting)
        interactive_present = any(r.lane is Lane.INTERACTIVE for r in self.live.values())
        out = sched.schedule()
        entries = out.scheduled
        keys = [sched._key(e.request) for e in entries]
        assert keys == sorted(keys), "scheduled out of lane/priority/arrival order"
        assert out.num_batched_tokens == sum(e.num_new_tokens for e in entries)
        assert out.num_batched_tokens <= cfg.max_num_batched_tokens
        assert len(sched.running) <= cfg.max_num_seqs
        batch_tokens = sum(e.num_new_tokens for e in entries if e.request.lane is Lane.BATCH)
        caps = [cfg.batch_token_budget]
        if interactive_present and cfg.interactive_batch_token_cap is not None:
            caps += [cfg.interactive_batch_token_cap, max(1, cfg.max_num_batched_tokens // 2)]
        caps = [c for c in caps if c is not None]
        if caps:
            assert batch_tokens <= min(caps), f"batch lane took {batch_tokens} > caps {caps}"
        ids = [e.request.request_id for e in entries]
        assert len(set(ids)) == len(ids)
        for e in entries:
            req = e.request
            assert req.status is RequestStatus.RUNNING
            assert e.num_new_tokens >= 1
            assert e.num_computed_tokens == req.num_computed_tokens
            assert e.num_computed_tokens + e.num_new_tokens <= req.num_tokens
            assert e.samples == (e.num_computed_tokens + e.num_new_tokens == req.num_tokens)
            decode = req.num_output_tokens > 0 and e.num_computed_tokens == req.num_tokens - 1
            if cfg.long_prefill_token_threshold is not None and not decode:
                assert e.num_new_tokens <= cfg.long_prefill_token_threshold
        # admission never overtakes inside the waiting order (lanes first)
        pool = sorted({id(r): r for r in waiting_before + out.preempted}.values(), key=sched._key)
        admitted = [r for r in pool if r.status is RequestStatus.RUNNING]
        assert admitted == pool[: len(admitted)], "a waiting request was overtaken"
        self._play_model(entries)
        sched.update_after_step(out)
        for e in entries:
            req = e.request
            if not e.samples:
                continue
            req.append_output_token_ids(fake_next_token(req.all_token_ids))
            if (
                req.num_output_tokens >= self.max_tokens[req.request_id]
                or req.num_tokens >= self.max_model_len
            ):
                status = RequestStatus.FINISHED_LENGTH
                sched.finish_request(req, status)
                self._finished(req.request_id)
        return len(entries)

    def _play_model(self, entries) -> None:
        """All of a step's writes land before its reads (each layer writes the new K/V before
        its attention reads the cache), so a request may read a prompt block an identical
        prompt computes in the same step; a block is only written by its own request, or while
        it is uncomputed (registered this step, shared by a sibling that hit it)."""
        bs = self.bm.block_size
        for e in entries:
            req, start, n = e.request, e.num_computed_tokens, e.num_new_tokens
            tokens, table = req.all_token_ids, req.block_table
            assert len(table) * bs >= start + n, f"{req.request_id}: too few blocks"
            for pos in range(start, start + n):
                block = table[pos // bs]
                assert self.bm.blocks[block].ref_count == 1 or self.bm.is_uncomputed(block), (
                    f"write into shared computed block {block}"
                )
                self.kv[(block, pos % bs)] = (tokens[pos], pos)
        for e in entries:
            req, start = e.request, e.num_computed_tokens
            tokens, table = req.all_token_ids, req.block_table
            for pos in range(start):
                assert self.kv.get((table[pos // bs], pos % bs)) == (tokens[pos], pos), (
                    f"{req.request_id} reads stale KV at position {pos}"
                )

    def _finished(self, rid: str) -> None:
        req = self.live.pop(rid)
        assert req.status.is_finished and req.block_table == []
        self.done[rid] = req.status

    # ------------------------------------------------------------------ invariants

    @invariant()
    def bookkeeping(self):
        if not hasattr(self, "sched"):
            return
        sched, bm = self.sched, self.bm
        bm.check_integrity()
        assert set(sched.requests) == set(self.live)
        assert {r.request_id for r in sched.running} | {r.request_id for r in sched.waiting} == set(
            self.live
        )
        assert all(r.status is RequestStatus.RUNNING for r in sched.running)
        assert all(
            r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED) for r in sched.waiting
        )
        assert all(r.block_table == [] and r.num_computed_tokens == 0 for r in sched.waiting)
        keys = [sched._key(r) for r in sched.waiting]
        assert keys == sorted(keys)
        used = sum(len(r.block_table) for r in sched.running)
        shared = sum(max(b.ref_count - 1, 0) for b in bm.blocks)
        assert bm.num_free_blocks + used - shared == bm.num_total_blocks, "a block leaked"
        assert bm.prefix_cache_hits <= bm.prefix_cache_queries
        # the hit rate counts first admissions only, never a re-admission after a preemption
        admitted = [r for r in self.all_requests if r.first_scheduled_time is not None]
        queries = sum(r.num_prompt_tokens for r in admitted) if bm.enable_prefix_caching else 0
        assert bm.prefix_cache_queries == queries
        assert bm.prefix_cache_hits == sum(max(r.num_cached_tokens, 0) for r in admitted)

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        for _ in range(20_000):  # liveness: every request finishes without outside help
            if not self.sched.has_unfinished_requests():
                break
            self._step()
            self.bookkeeping()
        assert not self.live and not self.sched.has_unfinished_requests(), (
            f"requests never finished: {sorted(self.live)}"
        )
        assert set(self.done) == {f"r{i}" for i in range(self.num_added)}
        assert self.bm.num_free_blocks == self.bm.num_total_blocks
        # coverage of the interesting paths, shown by --hypothesis-show-statistics
        event(f"preempted: {self.sched.num_preemptions > 0}")
        event(f"prefix hits: {self.bm.prefix_cache_hits > 0}")
        event(f"aborted: {RequestStatus.FINISHED_ABORTED in self.done.values()}")


SchedulerMachine.TestCase.settings = prop_settings(100, stateful_step_count=80)
test_scheduler_block_manager_state_machine = SchedulerMachine.TestCase
