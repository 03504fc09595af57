"""Block manager: hash chain, LRU eviction, ref counts, collision guard, integrity checks."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import laneserve.gpu_worker.block_manager as block_manager_mod
from laneserve.gpu_worker.block_manager import hash_block_tokens
from laneserve.gpu_worker.request import Request


def compute(bm, req, hit=None, num_hit=0):
    """Admit `req` with its hit, 'compute' all its tokens and register its full blocks."""
    assert bm.allocate_slots(req, req.num_tokens - num_hit, hit)
    req.num_computed_tokens = req.num_tokens
    bm.cache_full_blocks(req, req.num_computed_tokens)


def admit(bm, req):
    hit, num_hit = bm.get_computed_blocks(req)
    compute(bm, req, hit, num_hit)
    return hit, num_hit


def test_hash_chain_is_deterministic_across_processes():
    chain = [None]
    for block in ([1, 2, 3, 4], [5, 6, 7, 8], [2**40, 0, 151_000, 3]):
        chain.append(hash_block_tokens(chain[-1], block))
    code = (
        "from laneserve.gpu_worker.block_manager import hash_block_tokens as h\n"
        "a = h(None, [1, 2, 3, 4]); b = h(a, [5, 6, 7, 8]); c = h(b, [2**40, 0, 151_000, 3])\n"
        "print(c.hex())"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert out.stdout.strip() == chain[-1].hex()
    assert len(chain[-1]) == 32


def test_hash_chain_depends_on_parent_and_extra_keys():
    first = hash_block_tokens(None, [1, 2])
    assert hash_block_tokens(first, [3, 4]) != hash_block_tokens(
        hash_block_tokens(None, [9, 9]), [3, 4]
    )
    assert hash_block_tokens(None, [1, 2], ["salt"]) != first
    assert hash_block_tokens(None, [1, 2]) == first


def test_request_block_hashes_are_chained(make_bm):
    bm = make_bm(block_size=4)
    r = Request("r", list(range(10)))
    admit(bm, r)
    assert r.block_hashes == [
        hash_block_tokens(None, [0, 1, 2, 3]),
        hash_block_tokens(r.block_hashes[0], [4, 5, 6, 7]),
    ]
    bm.free(r)


def test_last_prompt_token_never_cached(make_bm):
    bm = make_bm(block_size=4)
    a = Request("a", list(range(8)))  # exactly two full blocks
    admit(bm, a)
    assert bm.num_cached_blocks == 2
    b = Request("b", list(range(8)))
    hit, num_hit = bm.get_computed_blocks(b)
    assert num_hit == 4 and hit == a.block_table[:1]  # not 8: the last token is computed
    assert bm.get_computed_blocks(Request("c", [0])) == ([], 0)
    bm.free(a)


def test_shared_prefix_ref_counts(make_bm):
    bm = make_bm(num_blocks=8, block_size=4)
    a = Request("a", list(range(12)) + [100])
    admit(bm, a)
    b = Request("b", list(range(12)) + [200, 201])
    hit, num_hit = admit(bm, b)
    assert hit == a.block_table[:3] and num_hit == 12
    assert [bm.blocks[i].ref_count for i in a.block_table] == [2, 2, 2, 1]
    assert b.block_table[:3] == a.block_table[:3] and b.block_table[3] != a.block_table[3]
    assert bm.prefix_cache_queries == 13 + 14 and bm.prefix_cache_hits == 12
    bm.check_integrity()
    bm.free(a)
    assert [bm.blocks[i].ref_count for i in b.block_table] == [1, 1, 1, 1]
    assert bm.num_free_blocks == 4
    bm.free(b)
    assert bm.num_free_blocks == bm.num_total_blocks
    # the freed blocks stay cached: a third request hits all three again
    assert bm.get_computed_blocks(Request("c", list(range(12)) + [5]))[1] == 12


def test_eviction_is_lru_and_hits_refresh(make_bm):
    bm = make_bm(num_blocks=4, block_size=2)
    a = Request("a", [1, 2, 3, 4])
    b = Request("b", [5, 6, 7, 8])
    admit(bm, a)
    admit(bm, b)
    bm.free(a)  # a's blocks are the least recently used
    bm.free(b)
    assert bm.num_cached_blocks == 4 and bm.num_free_blocks == 4
    # c needs 2 blocks: a's two are evicted, b's stay
    c = Request("c", [9, 10, 11, 12])
    compute(bm, c)
    assert bm.num_evictions == 2
    assert bm.get_computed_blocks(Request("qa", [1, 2, 3, 4, 0]))[1] == 0
    assert bm.get_computed_blocks(Request("qb", [5, 6, 7, 8, 0]))[1] == 4
    bm.free(c)
    # touch b (hit + free) so c's blocks become the oldest; the next allocation evicts c's
    b2 = Request("b2", [5, 6, 7, 8, 0])
    admit(bm, b2)  # 2 hit blocks + 1 new block evicts c's first-freed block
    bm.free(b2)
    d = Request("d", [20, 21, 22, 23])
    compute(bm, d)
    assert bm.get_computed_blocks(Request("qb", [5, 6, 7, 8, 0]))[1] == 4
    assert bm.get_computed_blocks(Request("qc", [9, 10, 11, 12, 0]))[1] == 0
    bm.free(d)


def test_uncached_free_blocks_are_reused_before_evicting(make_bm):
    bm = make_bm(num_blocks=4, block_size=2)
    a = Request("a", [1, 2, 3])  # one full cached block + one partial block
    admit(bm, a)
    bm.free(a)
    b = Request("b", [7])  # takes a free block: must not be the cached one
    compute(bm, b)
    assert bm.num_evictions == 0
    assert bm.get_computed_blocks(Request("q", [1, 2, 3]))[1] == 2
    bm.free(b)


def test_collision_guard_refuses_hash_match_with_other_tokens(make_bm, monkeypatch):
    monkeypatch.setattr(
        block_manager_mod, "hash_block_tokens", lambda parent, tokens, extra=None: b"\0" * 32
    )
    bm = make_bm(block_size=4)
    a = Request("a", [1, 2, 3, 4, 5])
    admit(bm, a)
    b = Request("b", [9, 9, 9, 9, 5])  # same (forced) hash, different tokens
    assert b.block_hashes == [] and bm.get_computed_blocks(b) == ([], 0)
    assert b.block_hashes == [a.block_hashes[0]]
    assert bm.num_hash_collisions == 1
    same = Request("same", [1, 2, 3, 4, 6])
    assert bm.get_computed_blocks(same)[1] == 4  # genuine match still hits
    compute(bm, b)  # b's block keeps the forced hash unregistered: no overwrite of a's entry
    assert bm.get_computed_blocks(Request("x", [1, 2, 3, 4, 0]))[0] == a.block_table[:1]
    bm.free(a)
    bm.free(b)


def test_allocate_failure_changes_nothing(make_bm):
    bm = make_bm(num_blocks=4, block_size=4)
    a = Request("a", list(range(12)))
    assert bm.allocate_slots(a, 12)
    b = Request("b", list(range(8)))
    assert not bm.allocate_slots(b, 8)
    assert b.block_table == [] and bm.num_free_blocks == 1 and bm.prefix_cache_queries == 12
    assert not bm.allocate_slots(b, 4, reserve_blocks=1)
    assert bm.allocate_slots(b, 4)
    bm.free(a)
    bm.free(b)


def test_no_leak_after_abort_and_preemption_like_free(make_bm):
    bm = make_bm(num_blocks=16, block_size=4)
    reqs = [Request(f"r{i}", [i % 3] * (5 + 7 * i)) for i in range(4)]
    for r in reqs:
        admit(bm, r)
    for r in reqs:
        r.append_output_token_ids(1)
        assert bm.allocate_slots(r, 1)
        bm.free(r)
        bm.free(r)  # idempotent
    assert bm.num_free_blocks == bm.num_total_blocks and bm.usage == 0.0


def test_prefix_caching_disabled(make_bm):
    bm = make_bm(block_size=4, prefix=False)
    a = Request("a", list(range(9)))
    admit(bm, a)
    assert bm.num_cached_blocks == 0
    assert bm.get_computed_blocks(Request("b", list(range(9)))) == ([], 0)
    assert bm.prefix_cache_queries == bm.prefix_cache_hits == 0
    bm.free(a)


def test_cache_salt_separates_and_reset_prefix_cache(make_bm):
    bm = make_bm(block_size=4)
    a = Request("a", list(range(9)), cache_salt="tenant-1")
    admit(bm, a)
    assert bm.get_computed_blocks(Request("b", list(range(9))))[1] == 0
    assert bm.get_computed_blocks(Request("c", list(range(9)), cache_salt="tenant-1"))[1] == 8
    assert bm.reset_prefix_cache() == 2
    assert bm.get_computed_blocks(Request("d", list(range(9)), cache_salt="tenant-1"))[1] == 0
    bm.free(a)


def test_check_integrity_detects_corruption(make_bm):
    bm = make_bm(block_size=4)
    a = Request("a", list(range(9)))
    admit(bm, a)
    bm.blocks[a.block_table[0]].ref_count += 1
    with pytest.raises(AssertionError, match="ref_count"):
        bm.check_integrity()
    bm.blocks[a.block_table[0]].ref_count -= 1
    a.block_table.append(a.block_table[0])
    with pytest.raises(AssertionError, match="repeats"):
        bm.check_integrity()
    a.block_table.pop()
    bm.free(a)


def test_bad_sizes():
    with pytest.raises(ValueError, match="num_blocks"):
        block_manager_mod.BlockManager(0, 16)
    with pytest.raises(ValueError, match="block_size"):
        block_manager_mod.BlockManager(4, 0)


def test_collision_guard_confirms_the_parent_chain(make_bm, monkeypatch):
    """A hash that ignores the parent (a forced chain collision): a block with the right tokens
    but another prefix in front must not serve as a later block of the chain."""
    import hashlib

    def tokens_only(parent, tokens, extra=None):
        return hashlib.sha256(repr(list(tokens)).encode()).digest()

    monkeypatch.setattr(block_manager_mod, "hash_block_tokens", tokens_only)
    bm = make_bm(num_blocks=16, block_size=4)
    c = Request("c", [5, 6, 7, 8, 5, 6, 7, 8, 0])  # block 0 registers hash([5, 6, 7, 8])
    admit(bm, c)
    assert bm.num_hash_collisions == 1  # its block 1 has that hash with another parent
    a = Request("a", [1, 2, 3, 4, 5, 6, 7, 8, 0])
    admit(bm, a)  # block 1 collides with c's block 0: not registered
    assert bm.num_hash_collisions == 2
    q = Request("q", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    hit, num_hit = bm.get_computed_blocks(q)
    assert hit == a.block_table[:1] and num_hit == 4  # c's block 0 is not position 4..7
    assert bm.num_hash_collisions == 3
    for r in (a, c):
        bm.free(r)


def test_hit_rate_ignores_readmission_after_preemption(make_bm):
    bm = make_bm(num_blocks=16, block_size=4)
    a = Request("a", list(range(1, 11)))
    admit(bm, a)
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (10, 0)
    bm.free(a)  # what a preemption does, then the scheduler re-admits the request
    a.num_computed_tokens = 0
    a.num_preemptions = 1
    hit, num_hit = bm.get_computed_blocks(a)
    assert num_hit == 8  # its own blocks are still cached and reused
    compute(bm, a, hit, num_hit)
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (10, 0)
    b = Request("b", list(range(1, 11)))  # another request's hit counts
    admit(bm, b)
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (20, 8)
    bm.free(a)
    bm.free(b)
