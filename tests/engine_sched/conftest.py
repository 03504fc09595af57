"""Fixtures for model-free scheduler / block-manager tests.

`make_sched` builds a Scheduler over a real BlockManager and checks the block manager's
integrity when the test ends; `EngineSim` stands in for the engine loop (it advances
`num_computed_tokens` through `update_after_step`, appends fake sampled tokens and finishes
requests at their `max_tokens`).
"""

from __future__ import annotations

import itertools

import pytest

from laneserve.gpu_worker.block_manager import BlockManager
from laneserve.gpu_worker.request import Lane, Request, RequestStatus
from laneserve.gpu_worker.scheduler import Scheduler
from laneserve.gpu_worker.scheduler_config import SchedulerConfig
from laneserve.gpu_worker.scheduler_output import SchedulerOutput


class EngineSim:
    """Drives a Scheduler like the engine would, with fake sampled token ids.

    `sampling_params` of the simulated requests is an int: the number of tokens to generate.
    """

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.bm = sched.block_manager
        self.finished: list[Request] = []
        self.kv: dict[tuple[int, int], tuple[int, int]] = {}
        self._ids = itertools.count(1)
        self._fake_token = itertools.count(50_000)

    def add(
        self,
        rid: str,
        prompt_len: int,
        *,
        max_tokens: int = 4,
        token: int | None = None,
        lane: str = "batch",
        priority: int = 0,
        arrival: float | None = None,
        prompt: list[int] | None = None,
    ) -> Request:
        if prompt is None:
            prompt = [next(self._ids) if token is None else token] * prompt_len
        kwargs = {} if arrival is None else {"arrival_time": arrival}
        req = Request(rid, prompt, max_tokens, lane=Lane(lane), priority=priority, **kwargs)
        self.sched.add_request(req)
        return req

    def _check_and_write_kv(self, out: SchedulerOutput) -> None:
        """Play the model runner on a fake KV cache: slot -> (token id, position).

        Every position a request attends to ([0, start)) must hold its own token, whether it
        was computed by the request itself or came from a prefix-cache hit; new tokens are
        written at [start, start + n) into blocks no other request holds (or, for a prompt
        block registered this step, that a sibling hit but nobody has computed yet). As in the model
        (each layer writes the step's new K/V before its attention reads the cache), all
        writes of a step land before any read, so a request may read prompt blocks that an
        identical prompt computes in the same step.
        """
        bs = self.bm.block_size
        for entry in out.scheduled:
            req, start, n = entry.request, entry.num_computed_tokens, entry.num_new_tokens
            tokens = req.all_token_ids
            table = req.block_table
            assert len(table) * bs >= start + n, f"{req.request_id}: too few blocks"
            for pos in range(start, start + n):
                block = table[pos // bs]
                assert self.bm.blocks[block].ref_count == 1 or self.bm.is_uncomputed(block), (
                    f"write into shared computed block {block}"
                )
                self.kv[(block, pos % bs)] = (tokens[pos], pos)
        for entry in out.scheduled:
            req, start = entry.request, entry.num_computed_tokens
            tokens, table = req.all_token_ids, req.block_table
            for pos in range(start):
                slot = (table[pos // bs], pos % bs)
                assert self.kv.get(slot) == (tokens[pos], pos), (
                    f"{req.request_id} reads stale KV at position {pos}"
                )

    def step(self) -> SchedulerOutput:
        out = self.sched.schedule()
        assert out.num_batched_tokens <= self.sched.config.max_num_batched_tokens
        assert len(self.sched.running) <= self.sched.config.max_num_seqs
        self._check_and_write_kv(out)
        self.sched.update_after_step(out)
        for entry in out.scheduled:
            req = entry.request
            if not entry.samples:
                continue
            assert req.num_computed_tokens == req.num_tokens
            req.append_output_token_ids([next(self._fake_token)])
            if req.num_output_tokens >= req.sampling_params:
                self.sched.finish_request(req, RequestStatus.FINISHED_LENGTH)
                self.finished.append(req)
        self.bm.check_integrity()
        return out

    def run(self, max_steps: int = 10_000) -> int:
        for n in range(1, max_steps + 1):
            self.step()
            if not self.sched.has_unfinished_requests():
                return n
        raise AssertionError(f"not finished after {max_steps} steps")


@pytest.fixture
def make_sched():
    """Factory: make_sched(num_blocks=..., block_size=..., prefix=True, **SchedulerConfig kwargs)."""
    managers: list[BlockManager] = []

    def factory(num_blocks: int = 1024, block_size: int = 16, prefix: bool = True, **cfg):
        cfg.setdefault("max_model_len", min(4096, num_blocks * block_size))
        bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix)
        managers.append(bm)
        return Scheduler(SchedulerConfig(**cfg), bm)

    yield factory
    for bm in managers:
        bm.check_integrity()


@pytest.fixture
def make_bm():
    """Factory for BlockManagers whose integrity is checked at teardown."""
    managers: list[BlockManager] = []

    def factory(num_blocks: int = 16, block_size: int = 4, prefix: bool = True) -> BlockManager:
        bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix)
        managers.append(bm)
        return bm

    yield factory
    for bm in managers:
        bm.check_integrity()


@pytest.fixture
def sim(make_sched):
    """Factory: sim(**make_sched kwargs) -> EngineSim."""
    return lambda **kw: EngineSim(make_sched(**kw))
