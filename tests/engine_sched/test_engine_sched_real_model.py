"""The scheduler and block manager driving the real paged-KV model (SmolLM2, float32, CPU).

Greedy tokens must not depend on how the scheduler cuts the work: each prompt run alone with
no prefix cache must give the same tokens as all prompts together under a tiny token budget,
prefix-cache hits on a shared preamble and a KV pool small enough to force preemption.
"""

from __future__ import annotations

import pytest
import torch

from laneserve.gpu_worker.block_manager import BlockManager
from laneserve.gpu_worker.request import Lane, Request, RequestStatus
from laneserve.gpu_worker.scheduler import Scheduler
from laneserve.gpu_worker.scheduler_config import SchedulerConfig

pytestmark = pytest.mark.slow

PREAMBLE = "You are a careful assistant. Answer in one short sentence, then stop. "
QUESTIONS = [
    "What is the capital of France?",
    "Name a primary color.",
    "How many legs does a spider have?",
]
MAX_NEW = 4
BLOCK = 4


@pytest.fixture(scope="module")
def runner_and_prompts(smollm2_dir):
    from laneserve.gpu_worker.model_loader import load_model_files
    from laneserve.gpu_worker.model_runner import ModelRunner
    from laneserve.gpu_worker.models.llama import LlamaForCausalLM

    loaded = load_model_files(smollm2_dir)
    model = LlamaForCausalLM(loaded.config, loaded.weights, torch.float32, "cpu")
    runner = ModelRunner(model, block_size=BLOCK, num_blocks=64)
    prompts = [loaded.tokenizer(PREAMBLE + q)["input_ids"] for q in QUESTIONS]
    return runner, prompts


def generate(runner, prompts, *, budget, num_blocks, prefix, max_num_seqs=16, lanes=None):
    """Greedy decoding of `prompts` through Scheduler + ModelRunner; returns tokens and stats."""
    bm = BlockManager(num_blocks, BLOCK, enable_prefix_caching=prefix)
    cfg = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=num_blocks * BLOCK,
        watermark=0.0,
        interactive_batch_token_cap=5,
    )
    sched = Scheduler(cfg, bm)
    reqs = []
    for i, ids in enumerate(prompts):
        lane = Lane.BATCH if lanes is None else lanes[i]
        reqs.append(Request(f"r{i}", ids, MAX_NEW, lane=lane, arrival_time=float(i)))
        sched.add_request(reqs[-1])
    for _ in range(2000):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        entries = out.scheduled
        inputs = runner.prepare_inputs(
            [
                e.request.token_ids_slice(
                    e.num_computed_tokens, e.num_computed_tokens + e.num_new_tokens
                )
                for e in entries
            ],
            [e.num_computed_tokens for e in entries],
            [e.request.block_table for e in entries],
            [e.samples for e in entries],
        )
        assert inputs.sample_rows == [b for b, e in enumerate(entries) if e.samples]
        logits = runner.execute(inputs)
        sched.update_after_step(out)
        for row, b in enumerate(inputs.sample_rows):
            req = entries[b].request
            req.append_output_token_ids(int(logits[row].argmax()))
            if req.num_output_tokens == MAX_NEW:
                sched.finish_request(req, RequestStatus.FINISHED_LENGTH)
        bm.check_integrity()
    assert not sched.has_unfinished_requests()
    assert bm.num_free_blocks == bm.num_total_blocks
    return [r.output_token_ids for r in reqs], reqs, sched


def test_greedy_tokens_do_not_depend_on_scheduling(runner_and_prompts):
    runner, prompts = runner_and_prompts
    alone = [generate(runner, [p], budget=4096, num_blocks=64, prefix=False)[0][0] for p in prompts]
    # tight: 7-token budget, shared preamble hits, 9 blocks of 4 tokens -> preemption
    tight, reqs, sched = generate(
        runner,
        prompts,
        budget=7,
        num_blocks=9,
        prefix=True,
        lanes=[Lane.BATCH, Lane.INTERACTIVE] * 2,
    )
    assert tight == alone
    assert sched.num_preemptions > 0
    assert sum(r.num_cached_tokens for r in reqs) > 0
    assert sched.block_manager.prefix_cache_hits > 0
