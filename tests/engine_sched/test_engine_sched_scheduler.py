"""Scheduler behaviour without a model: budgets, chunking, lanes, preemption, admission."""

from __future__ import annotations

import random

import pytest

from laneserve.gpu_worker.request import Lane, RequestStatus
from laneserve.gpu_worker.scheduler_config import SchedulerConfig


def split(out):
    return [(e.request.request_id, e.num_new_tokens) for e in out.scheduled]


def test_budget_split_three_800_token_prompts(sim):
    s = sim(max_num_batched_tokens=1024, interactive_batch_token_cap=None)
    for rid in ("a", "b", "c"):
        s.add(rid, 800, max_tokens=2)
    out = s.step()
    assert split(out) == [("a", 800), ("b", 224)]  # c gets 0
    assert out.num_batched_tokens == 1024
    assert [e.samples for e in out.scheduled] == [True, False]
    out = s.step()  # a decodes 1, b finishes its prompt (576), c gets the rest (447)
    assert split(out) == [("a", 1), ("b", 576), ("c", 447)]
    assert [e.samples for e in out.scheduled] == [True, True, False]
    assert s.run() > 0
    assert [r.num_prefill_chunks for r in sorted(s.finished, key=lambda r: r.request_id)] == [
        1,
        2,
        2,
    ]


def test_budget_smaller_than_max_num_seqs(sim):
    s = sim(max_num_batched_tokens=4, max_num_seqs=16)
    reqs = [s.add(f"r{i}", 3, max_tokens=5) for i in range(10)]
    first = s.step()
    assert split(first) == [("r0", 3), ("r1", 1)]
    steps = s.run()
    assert all(r.num_output_tokens == 5 for r in reqs)
    # 10 * (3 prompt + 4 decode inputs) = 70 tokens at <= 4 per step.
    assert steps >= 70 // 4
    assert s.bm.num_free_blocks == s.bm.num_total_blocks


def test_long_prefill_token_threshold_chunks_prompts(sim):
    s = sim(max_num_batched_tokens=1024, long_prefill_token_threshold=100)
    a = s.add("a", 250, max_tokens=1)
    b = s.add("b", 250, max_tokens=1)
    assert split(s.step()) == [("a", 100), ("b", 100)]
    assert split(s.step()) == [("a", 100), ("b", 100)]
    out = s.step()
    assert split(out) == [("a", 50), ("b", 50)]
    assert all(e.samples for e in out.scheduled)
    assert a.num_prefill_chunks == b.num_prefill_chunks == 3
    assert not s.sched.has_unfinished_requests()


def test_chunk_that_divides_prompt_exactly(sim):
    s = sim(max_num_batched_tokens=16)
    r = s.add("a", 64, max_tokens=3)
    outs = [s.step() for _ in range(4)]
    assert [split(o) for o in outs] == [[("a", 16)]] * 4
    assert [o.scheduled[0].samples for o in outs] == [False, False, False, True]
    s.run()
    assert r.num_prefill_chunks == 4 and r.num_output_tokens == 3


def test_lane_then_priority_then_arrival_order(sim):
    s = sim(max_num_batched_tokens=10_000, interactive_batch_token_cap=None)
    s.add("batch-old", 10, arrival=1.0)
    s.add("batch-urgent", 10, arrival=2.0, priority=-5)
    s.add("inter-late", 10, lane="interactive", arrival=4.0)
    s.add("inter-early", 10, lane="interactive", arrival=3.0)
    s.add("inter-lowprio", 10, lane="interactive", arrival=0.5, priority=3)
    assert [rid for rid, _ in split(s.step())] == [
        "inter-early",
        "inter-late",
        "inter-lowprio",
        "batch-urgent",
        "batch-old",
    ]


def test_interactive_gets_budget_before_older_batch(sim):
    s = sim(max_num_batched_tokens=100, interactive_batch_token_cap=None)
    s.add("batch", 80, arrival=1.0)
    s.add("inter", 80, lane="interactive", arrival=2.0)
    assert split(s.step()) == [("inter", 80), ("batch", 20)]


def test_batch_tokens_capped_only_while_interactive_present(sim):
    s = sim(max_num_batched_tokens=1000, interactive_batch_token_cap=64)
    s.add("b1", 300, max_tokens=3)
    s.add("b2", 300, max_tokens=3)
    assert split(s.step()) == [("b1", 300), ("b2", 300)]  # no interactive: full budget
    s.add("i", 200, lane="interactive", max_tokens=50)
    s.add("b3", 300, max_tokens=3)
    # interactive first; batch decodes and prefill share the cap of 64, in scheduling order
    assert split(s.step()) == [("i", 200), ("b1", 1), ("b2", 1), ("b3", 62)]
    assert split(s.step()) == [("i", 1), ("b1", 1), ("b2", 1), ("b3", 62)]


def test_batch_decodes_beyond_the_cap_skip_the_step_and_resume(sim):
    s = sim(max_num_batched_tokens=1000, interactive_batch_token_cap=2)
    for name in ("b1", "b2", "b3"):
        s.add(name, 10, max_tokens=20)
    assert split(s.step()) == [("b1", 10), ("b2", 10), ("b3", 10)]
    s.add("i", 5, lane="interactive", max_tokens=3)
    # only two batch tokens per step while "i" is present: the batch decodes take turns
    assert split(s.step()) == [("i", 5), ("b1", 1), ("b2", 1)]
    assert split(s.step()) == [("i", 1), ("b1", 1), ("b3", 1)]
    assert split(s.step()) == [("i", 1), ("b2", 1), ("b3", 1)]  # "i" has its 3 tokens now
    assert split(s.step()) == [("b1", 1), ("b2", 1), ("b3", 1)]  # cap lifted


def test_preemption_order_on_kv_exhaustion(sim):
    # 8 blocks of 4 tokens, four 8-token prompts fill the pool exactly; each then needs a block.
    s = sim(
        num_blocks=8,
        block_size=4,
        prefix=False,
        watermark=0.0,
        max_model_len=32,
        interactive_batch_token_cap=None,
    )
    a = s.add("batch-a", 8, arrival=1.0, max_tokens=3)
    b = s.add("batch-b-newest", 8, arrival=2.0, max_tokens=3)
    c = s.add("batch-c-urgent", 8, arrival=3.0, priority=-1, max_tokens=3)
    i = s.add("inter", 8, lane="interactive", arrival=4.0, max_tokens=3)
    out = s.step()
    assert [r for r, _ in split(out)] == ["inter", "batch-c-urgent", "batch-a", "batch-b-newest"]
    assert s.bm.num_free_blocks == 0
    out = s.step()
    # inter grows first: preempts the lowest ranked (batch, priority 0, newest) = b;
    # c takes the second freed block; a finds none and nothing ranks below it: itself.
    assert out.preempted == [b, a]
    assert split(out) == [("inter", 1), ("batch-c-urgent", 1)]
    assert a.status is b.status is RequestStatus.PREEMPTED
    assert a.num_computed_tokens == b.num_computed_tokens == 0 and not a.block_table
    assert s.sched.num_preemptions == 2
    assert s.sched.waiting == [a, b]  # back in order: older first
    s.run()
    assert all(r.num_output_tokens == 3 for r in (a, b, c, i))
    assert (a.num_preemptions, b.num_preemptions, c.num_preemptions, i.num_preemptions) == (
        1,
        1,
        0,
        0,
    )
    assert s.bm.num_free_blocks == s.bm.num_total_blocks


def test_interactive_admission_preempts_newest_batch_when_max_num_seqs_full(sim):
    s = sim(max_num_seqs=2, max_num_batched_tokens=512)
    old = s.add("batch-old", 20, arrival=1.0, max_tokens=10)
    new = s.add("batch-new", 20, arrival=2.0, max_tokens=10)
    s.step()
    late = s.add("batch-late", 20, arrival=2.5, max_tokens=10)
    s.step()
    assert late.status is RequestStatus.WAITING  # batch waits for a seat
    inter = s.add("inter", 30, lane="interactive", arrival=3.0, max_tokens=2)
    out = s.step()
    assert out.preempted == [new]
    assert split(out) == [("inter", 30), ("batch-old", 1)]
    assert out.num_batched_tokens == 31  # the undone decode of batch-new gave its token back
    assert new.status is RequestStatus.PREEMPTED and not new.block_table
    assert s.sched.num_running == 2
    s.run()
    assert inter.num_output_tokens == 2
    assert all(r.num_output_tokens == 10 for r in (old, new, late))


def test_interactive_admission_preempts_batch_when_kv_full(sim):
    s = sim(num_blocks=10, block_size=4, prefix=False, watermark=0.0, max_model_len=40)
    b1 = s.add("b1", 16, arrival=1.0, max_tokens=8)
    b2 = s.add("b2", 16, arrival=2.0, max_tokens=8)
    s.step()
    assert s.bm.num_free_blocks == 2
    inter = s.add("inter", 12, lane="interactive", arrival=3.0, max_tokens=2)
    out = s.step()
    assert out.preempted == [b2]
    assert ("inter", 12) in split(out)
    s.run()
    assert inter.num_output_tokens == 2 and b1.num_output_tokens == b2.num_output_tokens == 8


def test_batch_never_admitted_ahead_of_blocked_interactive(sim):
    s = sim(num_blocks=6, block_size=4, prefix=False, watermark=0.0, max_model_len=24)
    i1 = s.add("i1", 16, lane="interactive", max_tokens=4)
    s.step()
    s.add("i2", 12, lane="interactive", max_tokens=1)  # needs 3 blocks, only 2 free
    s.add("b", 4, max_tokens=1)  # would fit, but must not overtake i2
    out = s.step()
    assert split(out) == [("i1", 1)]
    s.run()
    assert i1.num_output_tokens == 4


def test_watermark_holds_back_admission(sim):
    s = sim(num_blocks=100, block_size=4, prefix=False, watermark=0.1, max_model_len=400)
    s.add("a", 4 * 80, max_tokens=50)
    s.step()  # nothing running before: no watermark, 80 blocks taken
    s.add("b", 4 * 11, max_tokens=1)  # a grows to 81 blocks; 19 - 11 = 8 < 10 watermark
    assert split(s.step()) == [("a", 1)]
    assert s.sched.num_waiting == 1


def test_kv_exhaustion_preemption_then_all_complete(sim):
    rng = random.Random(0)
    s = sim(
        num_blocks=24,
        block_size=4,
        watermark=0.0,
        max_model_len=96,
        max_num_batched_tokens=32,
        long_prefill_token_threshold=16,
    )
    reqs = []
    for i in range(30):
        lane = "interactive" if i % 4 == 0 else "batch"
        # shared 8-token preamble for half of them exercises prefix hits under preemption
        prefix = [7] * 8 if i % 2 else []
        body = [rng.randrange(1, 1000) for _ in range(rng.randrange(1, 40))]
        reqs.append(
            s.add(
                f"r{i}",
                0,
                prompt=prefix + body,
                lane=lane,
                max_tokens=rng.randrange(1, 30),
                priority=rng.randrange(3),
            )
        )
    s.run()
    assert s.sched.num_preemptions > 0
    assert all(r.num_output_tokens == r.sampling_params for r in reqs)
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in reqs)
    assert s.bm.num_free_blocks == s.bm.num_total_blocks
    assert s.bm.prefix_cache_hits > 0
    stats = s.sched.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"] == 24
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["num_preemptions"] == sum(r.num_preemptions for r in reqs)


def test_prefix_hit_sets_num_cached_tokens(sim):
    s = sim(block_size=4)
    a = s.add("a", 0, prompt=list(range(1, 19)), max_tokens=1)  # 18 tokens: 4 full blocks
    s.run()
    b = s.add("b", 0, prompt=list(range(1, 19)) + [99], max_tokens=1)
    out = s.step()
    assert b.num_cached_tokens == 16 and split(out) == [("b", 3)]
    c = s.add("c", 0, prompt=list(range(1, 17)), max_tokens=1)  # exactly 4 blocks
    out = s.step()
    assert c.num_cached_tokens == 12 and split(out) == [("c", 4)]  # last token recomputed
    assert a.num_cached_tokens == 0


def test_abort_waiting_and_running_frees_blocks(sim):
    s = sim(max_num_batched_tokens=64, block_size=4)
    a = s.add("a", 100, max_tokens=5)
    b = s.add("b", 10, max_tokens=5)
    s.step()  # a mid-prefill, b waiting
    assert a.block_table and b.status is RequestStatus.WAITING
    assert s.sched.abort_request("a") is a
    assert s.sched.abort_request("b") is b
    assert s.sched.abort_request("b") is None
    assert a.status is RequestStatus.FINISHED_ABORTED and a.finish_reason == "abort"
    assert not a.block_table and a.finished_time is not None
    assert not s.sched.has_unfinished_requests()
    assert s.bm.num_free_blocks == s.bm.num_total_blocks


def test_update_after_step_skips_request_finished_mid_step(sim):
    s = sim()
    a = s.add("a", 10)
    out = s.sched.schedule()
    s.sched.abort_request("a")
    s.sched.update_after_step(out)
    assert a.num_computed_tokens == 0


def test_bad_input_and_config(sim, make_sched):
    s = sim()
    s.add("a", 3)
    with pytest.raises(ValueError, match="duplicate"):
        s.add("a", 3)
    with pytest.raises(ValueError, match="empty prompt"):
        s.add("e", 0)
    with pytest.raises(AssertionError, match="max_model_len"):
        s.add("long", 5000)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_num_batched_tokens=0)
    with pytest.raises(ValueError, match="watermark"):
        SchedulerConfig(watermark=1.5)
    with pytest.raises(ValueError, match="cannot hold one max_model_len"):
        make_sched(num_blocks=4, block_size=4, max_model_len=17)
    s.sched.abort_request("a")


def test_timestamps_and_token_gaps(sim):
    s = sim()
    r = s.add("a", 5, max_tokens=4, lane=Lane.INTERACTIVE)
    s.run()
    assert r.arrival_time <= r.first_scheduled_time <= r.first_token_time <= r.last_token_time
    assert r.last_token_time <= r.finished_time
    assert len(r.token_gaps_ms) == 3 and all(g >= 0 for g in r.token_gaps_ms)
    assert r.num_cached_tokens == 0 and r.num_prefill_chunks == 1


def test_interactive_does_not_preempt_batch_that_cannot_make_room(sim):
    s = sim(num_blocks=10, block_size=4, prefix=False, watermark=0.0, max_model_len=40)
    i1 = s.add("i1", 32, lane="interactive", max_tokens=3)
    b = s.add("b", 2, max_tokens=3)
    s.step()
    i2 = s.add("i2", 12, lane="interactive", max_tokens=1)
    out = s.step()  # i1 takes the last free block; b's one block would not make room for i2
    assert out.preempted == [] and s.sched.num_preemptions == 0
    assert split(out) == [("i1", 1), ("b", 1)]
    s.run()
    assert i2.num_output_tokens == 1 and b.num_output_tokens == 3 and i1.num_output_tokens == 3
    assert s.sched.num_preemptions == 0


@pytest.mark.parametrize("seed", range(4))
def test_random_workload_keeps_invariants(sim, seed):
    """Random arrivals, lanes, priorities, aborts and shared preambles on a tight KV pool.

    EngineSim checks every step that each request reads only its own tokens' KV (hits
    included) and never writes a shared block; integrity is checked after every step.
    """
    rng = random.Random(seed)
    s = sim(
        num_blocks=rng.choice([12, 20, 40]),
        block_size=rng.choice([2, 4, 8]),
        watermark=0.05,
        max_num_seqs=rng.choice([2, 4, 16]),
        max_num_batched_tokens=rng.choice([3, 8, 32]),
        long_prefill_token_threshold=rng.choice([None, 5]),
        interactive_batch_token_cap=rng.choice([None, 4]),
    )
    max_len = s.sched.config.max_model_len
    preambles = [[rng.randrange(1, 50) for _ in range(rng.randrange(1, 12))] for _ in range(3)]
    reqs, aborted = [], set()
    for t in range(400):
        if len(reqs) < 40 and rng.random() < 0.3:
            prompt = rng.choice(preambles + [[]]) + [
                rng.randrange(1, 50) for _ in range(rng.randrange(1, 15))
            ]
            max_tokens = rng.randrange(1, max(2, min(20, max_len - len(prompt))))
            reqs.append(
                s.add(
                    f"r{len(reqs)}",
                    0,
                    prompt=prompt,
                    max_tokens=max_tokens,
                    lane=rng.choice(["interactive", "batch"]),
                    priority=rng.randrange(3),
                    arrival=float(t),
                )
            )
        if reqs and rng.random() < 0.03:
            victim = rng.choice(reqs)
            if s.sched.abort_request(victim.request_id) is not None:
                aborted.add(victim.request_id)
        s.step()
    s.run()
    stats = s.sched.stats()
    print(f"seed {seed}: {len(reqs)} requests, {len(aborted)} aborted, {stats}")
    for r in reqs:
        if r.request_id not in aborted:
            assert r.num_output_tokens == r.sampling_params, r.request_id
    assert s.bm.num_free_blocks == s.bm.num_total_blocks


def test_interactive_seat_preemption_only_when_kv_would_fit(sim):
    s = sim(
        num_blocks=10, block_size=4, prefix=False, watermark=0.0, max_model_len=40, max_num_seqs=3
    )
    i1 = s.add("i1", 22, lane="interactive", arrival=0.0, max_tokens=3)  # 6 blocks
    b1 = s.add("b1", 2, arrival=1.0, max_tokens=6)
    b2 = s.add("b2", 2, arrival=2.0, max_tokens=6)
    s.step()
    i2 = s.add("i2", 20, lane="interactive", arrival=3.0, max_tokens=1)  # 5 blocks
    out = s.step()  # seats full; free 2 + batch 2 < 5: preempting would not help
    assert out.preempted == [] and i2.status is RequestStatus.WAITING
    out = s.step()  # i1 decodes its last token and finishes
    assert i1.is_finished and i2.status is RequestStatus.WAITING
    out = s.step()  # i1's seat and blocks are free: i2 enters without preempting anyone
    assert ("i2", 20) in split(out) and out.preempted == []
    s.run()
    assert s.sched.num_preemptions == 0
    assert i1.num_output_tokens == 3 and b1.num_output_tokens == b2.num_output_tokens == 6


def test_shared_batch_prefix_counts_as_reclaimable(sim):
    s = sim(num_blocks=8, block_size=4, watermark=0.0, max_model_len=32, max_num_seqs=8)
    pre = [5] * 16  # 4 shared blocks
    b1 = s.add("b1", 0, prompt=pre + [1], arrival=1.0, max_tokens=3)
    s.step()
    b2 = s.add("b2", 0, prompt=pre + [2], arrival=2.0, max_tokens=3)
    s.step()
    assert b2.num_cached_tokens == 16 and s.bm.num_free_blocks == 2
    inter = s.add("inter", 20, lane="interactive", arrival=3.0, max_tokens=1)  # needs 5 blocks
    out = s.step()  # only preempting both batch requests frees the shared preamble
    assert out.preempted == [b2, b1]
    s.run()
    assert inter.num_output_tokens == 1 and b1.num_output_tokens == b2.num_output_tokens == 3


def test_batch_token_budget_bounds_batch_steps_but_not_interactive(sim):
    s = sim(max_num_batched_tokens=256, batch_token_budget=48, interactive_batch_token_cap=8)
    s.add("b1", 100, max_tokens=5)
    s.add("b2", 100, max_tokens=5)
    assert split(s.step()) == [("b1", 48)]  # batch alone: 48 tokens, not the 256 budget
    s.add("i", 200, lane="interactive", max_tokens=2)
    # interactive prefills its 200 tokens in one step; batch gets the interactive cap of 8
    assert split(s.step()) == [("i", 200), ("b1", 8)]
