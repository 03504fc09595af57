"""Scheduler fixes of issue 19, without a model: reclaimable blocks under shared prefixes,
priority preemption inside a lane (with its ping-pong guard), same-step prefix sharing, and
round-robin of the batch decodes a cap skips."""

from __future__ import annotations

import collections

from laneserve.gpu_worker.request import RequestStatus


def split(out):
    return [(e.request.request_id, e.num_new_tokens) for e in out.scheduled]


# ------------------------------------------------------------------ reclaimable blocks


def test_hit_blocks_held_by_batch_are_not_counted_as_reclaimable(sim):
    """An interactive prompt sharing its prefix with a running batch request must not preempt
    every batch request when even that would not make room: the shared blocks go straight back
    to the interactive request, so freeing them reclaims nothing."""
    s = sim(num_blocks=8, block_size=4, watermark=0.0, max_model_len=32,
            max_num_batched_tokens=1000, interactive_batch_token_cap=None)  # fmt: skip
    pre = list(range(1, 9))  # two full blocks
    i0 = s.add("i0", 0, prompt=[90] * 6, lane="interactive", max_tokens=3)  # 2 blocks
    b = s.add("b", 0, prompt=pre + [9], max_tokens=3)  # 3 blocks, the first two shared below
    c = s.add("c", 0, prompt=[70] * 5, max_tokens=3)  # 2 blocks
    s.step()
    assert s.bm.num_free_blocks == 1
    # 28 tokens = 7 blocks: 2 hit (held by b) + 5 new; at most 6 blocks are not i0's
    i = s.add("i", 0, prompt=pre + [80] * 20, lane="interactive", max_tokens=1)
    out = s.step()
    assert out.preempted == [] and s.sched.num_preemptions == 0
    assert i.status is RequestStatus.WAITING
    assert split(out) == [("i0", 1), ("b", 1), ("c", 1)]
    s.run()
    assert i.num_output_tokens == 1 and i0.num_output_tokens == 3
    assert b.num_output_tokens == c.num_output_tokens == 3


# ------------------------------------------------------------------ priority inside a lane


def test_urgent_request_preempts_least_urgent_of_its_lane_when_seats_are_full(sim):
    s = sim(max_num_seqs=2, max_num_batched_tokens=512, interactive_batch_token_cap=None)
    low = s.add("low", 10, priority=5, arrival=1.0, max_tokens=8)
    mid = s.add("mid", 10, priority=1, arrival=2.0, max_tokens=8)
    s.step()
    urgent = s.add("urgent", 10, priority=0, arrival=3.0, max_tokens=2)
    out = s.step()
    assert out.preempted == [low]
    assert split(out) == [("urgent", 10), ("mid", 1)]
    assert low.status is RequestStatus.PREEMPTED and not low.block_table
    same = s.add("same", 10, priority=1, arrival=4.0, max_tokens=2)
    out = s.step()  # equal priority never preempts: "same" waits for a seat
    assert out.preempted == [] and same.status is RequestStatus.WAITING
    s.run()
    assert urgent.num_output_tokens == 2 and low.num_output_tokens == mid.num_output_tokens == 8


def test_urgent_interactive_preempts_less_urgent_interactive_when_kv_is_full(sim):
    s = sim(num_blocks=8, block_size=4, prefix=False, watermark=0.0, max_model_len=32,
            max_num_batched_tokens=1000)  # fmt: skip
    lazy = s.add("lazy", 12, lane="interactive", priority=3, arrival=1.0, max_tokens=3)
    keen = s.add("keen", 12, lane="interactive", priority=0, arrival=2.0, max_tokens=3)
    s.step()
    assert s.bm.num_free_blocks == 2
    vip = s.add("vip", 12, lane="interactive", priority=-1, arrival=3.0, max_tokens=1)
    out = s.step()
    assert out.preempted == [lazy]
    assert ("vip", 12) in split(out) and keen.status is RequestStatus.RUNNING
    s.run()
    assert vip.num_output_tokens == 1 and lazy.num_output_tokens == keen.num_output_tokens == 3


def test_ping_pong_guard_protects_a_request_preempted_too_often(sim):
    s = sim(max_num_seqs=1, max_num_batched_tokens=512, priority_preemption_limit=2,
            priority_preemption_cooldown_steps=5)  # fmt: skip
    victim = s.add("victim", 10, priority=9, arrival=0.0, max_tokens=40)
    s.step()
    for k in range(2):  # two urgent arrivals, each preempts the victim once
        s.add(f"u{k}", 4, priority=0, arrival=1.0 + k, max_tokens=1)
        assert s.step().preempted == [victim]
        while victim.status is not RequestStatus.RUNNING:
            s.step()
    assert victim.num_preemptions == 2
    late = s.add("late", 4, priority=0, arrival=9.0, max_tokens=1)
    for _ in range(4):  # protected for 5 steps after re-admission: "late" waits
        out = s.step()
        assert out.preempted == [] and late.status is RequestStatus.WAITING
    while late.status is RequestStatus.WAITING:  # protection over: priority wins again
        s.step()
    assert victim.num_preemptions == 3
    s.run()
    assert victim.num_output_tokens == 40 and late.num_output_tokens == 1


# ------------------------------------------------------------------ same-step prefix sharing


def test_identical_prompts_admitted_in_one_step_share_their_blocks(sim):
    s = sim(num_blocks=64, block_size=4, max_num_batched_tokens=1000)
    prompt = list(range(100, 133))  # 33 tokens: 8 full blocks + 1
    a = s.add("a", 0, prompt=prompt, max_tokens=3)
    b = s.add("b", 0, prompt=prompt, max_tokens=3)  # a sibling (n=2)
    c = s.add("c", 0, prompt=prompt[:20] + [7] * 13, max_tokens=3)  # shares 5 blocks
    out = s.step()
    assert split(out) == [("a", 33), ("b", 1), ("c", 13)]  # one prefill of the prompt
    assert (b.num_cached_tokens, c.num_cached_tokens) == (32, 20)
    assert a.block_table[:8] == b.block_table[:8] and a.block_table[:5] == c.block_table[:5]
    assert s.bm.num_free_blocks == 64 - 9 - 1 - 4
    s.run()  # EngineSim checks each read position holds the request's own token
    assert all(r.num_output_tokens == 3 for r in (a, b, c))


def test_blocks_of_a_failed_step_are_not_hits(sim):
    """A prompt block registered at allocation whose step never ran forgets its hash when its
    writer is freed (the engine fails the step's requests when the forward pass raises)."""
    s = sim(num_blocks=32, block_size=4, max_num_batched_tokens=1000)
    prompt = list(range(200, 217))
    a = s.add("a", 0, prompt=prompt, max_tokens=2)
    s.sched.schedule()  # the model would run here and raise
    s.sched.finish_request(a, RequestStatus.FINISHED_ERROR)
    assert s.bm.num_cached_blocks == 0
    b = s.add("b", 0, prompt=prompt, max_tokens=2)
    out = s.step()
    assert split(out) == [("b", 17)] and b.num_cached_tokens == 0
    s.run()


def test_writer_of_shared_uncomputed_blocks_is_not_preempted(sim):
    """Preempting the writer of blocks an admitted request already shares this step would
    leave that request reading KV nobody computes: such a writer is not a victim."""
    s = sim(num_blocks=64, block_size=4, max_num_seqs=2, max_num_batched_tokens=1000,
            long_prefill_token_threshold=16, interactive_batch_token_cap=None)  # fmt: skip
    prompt = list(range(300, 340))  # 40 tokens, prefilled in chunks of 16
    w = s.add("w", 0, prompt=prompt, arrival=0.0, max_tokens=2)  # batch: a victim for "u"
    s.step()
    sharer = s.add("s", 0, prompt=prompt, lane="interactive", arrival=1.0, max_tokens=2)
    u = s.add("u", 4, lane="interactive", priority=1, arrival=2.0, max_tokens=1)
    out = s.step()  # w computes [16, 32) and registers those blocks; "s" hits all 32 tokens
    assert split(out) == [("s", 8), ("w", 16)] and sharer.num_cached_tokens == 32
    assert out.preempted == [] and u.status is RequestStatus.WAITING
    s.run()  # EngineSim would catch "s" reading KV that no step wrote
    assert w.num_output_tokens == sharer.num_output_tokens == 2 and u.num_output_tokens == 1


# ------------------------------------------------------------------ batch decode round robin


def test_capped_batch_decodes_take_turns(sim):
    s = sim(max_num_batched_tokens=1000, interactive_batch_token_cap=3)
    batch = [s.add(f"b{k}", 6, arrival=float(k), max_tokens=200) for k in range(7)]
    s.step()
    s.add("i", 4, lane="interactive", max_tokens=60, arrival=10.0)
    served = collections.Counter()
    for _ in range(28):
        for rid, n in split(s.step()):
            if rid.startswith("b"):
                served[rid] += n
    # 3 batch tokens x 28 steps shared by 7 decodes: 12 each, none starved
    assert sorted(served.values()) == [12] * 7
    s.run()
    assert all(r.num_output_tokens == 200 for r in batch)
