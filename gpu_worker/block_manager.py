"""Paged KV-cache block bookkeeping: allocation, ref counts and the prefix cache.

The KV cache is `num_blocks` physical blocks of `block_size` token slots. A request's
`block_table[i]` holds tokens `[i * block_size, (i + 1) * block_size)` of `all_token_ids`.

Prefix caching (the scheme of vLLM v1's KVCacheManager and nano-vllm's BlockManager):

- A *full* block whose KV has been computed is identified by a chained hash
  ``h_i = sha256(h_{i-1} || token ids of block i || extra keys)`` (`hash_block_tokens`), so a
  hash names the whole prefix up to and including that block. Hashing uses `hashlib` over a
  fixed byte encoding, never Python's `hash()`, so it is identical across processes.
- `_cached` maps hash -> block id. A cached block stays hashed after its last user frees it; it
  then sits in the free list and can be reused by a later request (a hit) until it is evicted.
- The free list is an ordered dict that doubles as the eviction order: allocation pops from
  the head. Freed blocks that hold cached KV go to the tail (least recently used are evicted
  first; a request's blocks are freed tail-first so its deepest blocks are evicted before
  its shared preamble). Freed blocks without a hash go to the head: they carry nothing
  worth keeping, so they are reused before any cached block is evicted.
- A hit is confirmed link by link against everything the hash claims (collision guard): a
  cached block stores the whole input of its hash -- parent hash, token ids, extra keys -- and
  a hit on block i needs all three to equal the request's (its parent hash being that of the
  hit block i - 1, already confirmed), so a hit confirms the chain, not just one block's tokens.
  A block is only registered when its parent link is confirmed too: when a request's block
  hashes to an entry that holds other content, none of its later blocks are registered.
  A hit covers whole blocks only and never includes the request's last token (at least one
  token is computed so the step produces logits).
- Blocks shared by several requests (ref count > 1) are always full, hashed blocks; new tokens
  are only ever written into the request's own trailing block, so a shared block is never written.

Prompt blocks are registered when they are allocated (`allocate_slots`), as vLLM v1 does: a
block that this step fills with prompt tokens is hashed and cached before its KV exists, so an
identical prompt admitted later in the same step (siblings, `n > 1`) hits it and computes only
its own tail. That is sound because a step writes every new token's K/V of a layer before that
layer's attention reads the cache. Until the step that computes it has run, such a block is
*uncomputed*: if its writer is freed first (an engine step failed, a preemption), a block no one
else holds forgets its hash, and the scheduler never preempts a writer whose uncomputed blocks
another request already shares (`shares_uncomputed`). Output blocks are registered after the
step that computed them (`cache_full_blocks`), so speculative or rolled-back tokens never enter
the cache.

Sliding window (`sliding_window`, given when every layer of the model attends within a window,
e.g. Mistral): a query at position i reads keys i - W < j <= i only, so once a request has
computed `num_computed_tokens` tokens its blocks wholly before position `num_computed_tokens - W`
are never read again (the next query sits at `num_computed_tokens`). `free_outside_window`
returns them to the pool (the scheduler calls it after each step, `allocate_slots` before each
allocation) and puts `NULL_BLOCK` in their place in the block table, so a table keeps one entry per logical block (``table[i]`` still holds tokens
``[i * block_size, (i + 1) * block_size)``) and the attention paths, which start reading at the
window's first block, never touch a null entry. Between steps a request then holds at most
``ceil(W / block_size) + 1`` blocks (during a step, also those of the tokens it computes). A freed block keeps its cached hash: its KV is that of its
whole token chain, which a sliding window does not change, so a later request whose prompt
starts with the same chain may hit it as long as every earlier block of the chain is still
cached (a hit is a run of consecutive blocks from block 0, each confirmed).

Counters `prefix_cache_queries` and `prefix_cache_hits` are in **tokens**: the first admission
of a request adds its `num_tokens` to the queries and its hit tokens to the hits. Re-admission
after a preemption is not counted (it mostly finds the request's own freed blocks, which would
make preemption thrash look like cache success). They stay 0 with prefix caching disabled.
"""

from __future__ import annotations

import hashlib
import json
import logging
import struct
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from laneserve.gpu_worker.request import Request

__all__ = ["NULL_BLOCK", "BlockManager", "KVBlock", "hash_block_tokens"]

logger = logging.getLogger(__name__)

# `_num_registered` value of a request whose chain hit a collision: no block of it registers again.
_STOP_REGISTERING = 1 << 62

# Block table entry of a block freed because it left the sliding window (never read again).
NULL_BLOCK = -1


def hash_block_tokens(
    parent_hash: bytes | None,
    token_ids: Sequence[int],
    extra_keys: Sequence[str | int] | None = None,
) -> bytes:
    """Chained hash of one full block (32 bytes, SHA-256).

    Encoding: parent hash (32 bytes, or nothing for the first block), the block's token ids as
    little-endian int64, then the extra keys as compact JSON when given. Deterministic across
    processes and Python versions (no `hash()`, no pickle).

    Args:
        parent_hash: hash of the previous block of the same sequence, None for block 0.
        token_ids: the block's `block_size` token ids.
        extra_keys: anything else that changes the KV (e.g. a cache salt), or None.
    """
    h = hashlib.sha256()
    if parent_hash is not None:
        h.update(parent_hash)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    if extra_keys:
        h.update(json.dumps(list(extra_keys), separators=(",", ":")).encode())
    return h.digest()


@dataclass(slots=True)
class KVBlock:
    """One physical KV block: `ref_count` users; while cached, `block_hash` and the inputs it
    was computed from (`parent_hash`, `token_ids`, `extra_keys`), which the collision guard
    compares."""

    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None
    token_ids: tuple[int, ...] = field(default_factory=tuple)
    parent_hash: bytes | None = None
    extra_keys: tuple[str | int, ...] = ()

    def holds(
        self, parent_hash: bytes | None, token_ids: Sequence[int], extra_keys: Sequence | None
    ) -> bool:
        """True when this cached block's hash input equals the given one (no collision)."""
        return (
            self.parent_hash == parent_hash
            and self.token_ids == tuple(token_ids)
            and self.extra_keys == tuple(extra_keys or ())
        )

    def forget(self) -> None:
        """Drop the cached identity (eviction or cache reset)."""
        self.block_hash = None
        self.parent_hash = None
        self.token_ids = ()
        self.extra_keys = ()


class BlockManager:
    """Allocates KV blocks to requests and keeps the prefix cache.

    Args:
        num_blocks: number of physical blocks in the KV cache (>= 1).
        block_size: tokens per block (>= 1).
        enable_prefix_caching: look up and register full blocks by chained hash.
        sliding_window: tokens every layer attends within (None: some layer attends everything);
            blocks that left it are freed (`free_outside_window`).

    Raises:
        ValueError: when `num_blocks` or `block_size` is below 1, or `sliding_window` below 1.

    Typical use by the scheduler, per request::

        blocks, num_hit = bm.get_computed_blocks(req)        # admission only
        ok = bm.allocate_slots(req, num_new, blocks)         # False -> nothing changed
        ... the step computes the tokens ...
        bm.cache_full_blocks(req, req.num_computed_tokens)   # register newly full blocks
        bm.free(req)                                         # finish, abort or preemption
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        sliding_window: int | None = None,
    ):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Free list in eviction order: head = next to allocate. Values unused.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[bytes, int] = {}  # block hash -> block id
        self._live: dict[str, Request] = {}  # requests holding blocks, by request id
        self._num_registered: dict[str, int] = {}  # leading blocks already hashed, per request
        self._uncomputed: set[int] = set()  # registered at allocation, KV not yet computed
        self._num_window_freed: dict[str, int] = {}  # leading NULL_BLOCK entries, per request
        self.num_window_freed_blocks = 0  # blocks returned because they left the window
        self.prefix_cache_queries = 0  # tokens looked up at admission
        self.prefix_cache_hits = 0  # of which found in the cache
        self.num_hash_collisions = 0  # hash matched but token ids differed (refused)
        self.num_evictions = 0  # cached blocks dropped to be reused

    # --- sizes ---
    @property
    def num_total_blocks(self) -> int:
        return self.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref count 0, cached ones (evictable) included."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks currently registered in the prefix cache (in use or free)."""
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use by live requests, 0..1."""
        return 1.0 - len(self._free) / self.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens (ceil division)."""
        return -(-num_tokens // self.block_size)

    # --- hashing ---
    def _extra_keys(self, request: Request, block_index: int) -> list[str] | None:
        # The salt goes into block 0 only; the chain carries it to every later block.
        if block_index == 0 and request.cache_salt is not None:
            return [request.cache_salt]
        return None

    def _update_block_hashes(self, request: Request, num_tokens: int) -> None:
        """Extend `request.block_hashes` to cover the full blocks of the first `num_tokens`."""
        bs = self.block_size
        hashes = request.block_hashes
        for i in range(len(hashes), num_tokens // bs):
            parent = hashes[i - 1] if i else None
            tokens = request.token_ids_slice(i * bs, (i + 1) * bs)
            hashes.append(hash_block_tokens(parent, tokens, self._extra_keys(request, i)))

    # --- prefix cache lookup ---
    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest cached prefix of a request that holds no blocks yet.

        Looks up the request's full blocks in order and stops at the first miss or at the
        first hash whose block holds another parent hash, other token ids or other extra keys
        (a collision, counted in `num_hash_collisions`). At most `(num_tokens - 1) // block_size` blocks, so the last
        token is always computed. Changes no state besides `request.block_hashes`.

        Returns:
            (block ids of the hit, in order; number of hit tokens = len(ids) * block_size).
        """
        assert not request.block_table, f"{request.request_id} already holds blocks"
        params = request.sampling_params
        if (
            not self.enable_prefix_caching
            or getattr(params, "prompt_logprobs", None) is not None
            or request.pooling_type == "MEAN"
        ):  # prompt_logprobs and mean pooling need every prompt position computed (as vLLM)
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        self._update_block_hashes(request, max_blocks * self.block_size)
        bs = self.block_size
        hit: list[int] = []
        for i in range(max_blocks):
            block_id = self._cached.get(request.block_hashes[i])
            if block_id is None:
                break
            parent = request.block_hashes[i - 1] if i else None
            tokens = request.token_ids_slice(i * bs, (i + 1) * bs)
            if not self.blocks[block_id].holds(parent, tokens, self._extra_keys(request, i)):
                self.num_hash_collisions += 1
                logger.warning("prefix-cache hash collision on block %d refused", block_id)
                break
            hit.append(block_id)
        return hit, len(hit) * bs

    # --- allocation ---
    def num_free_after(
        self, request: Request, num_new_tokens: int, new_computed_blocks: Sequence[int] | None
    ) -> int:
        """Free blocks left if `allocate_slots(request, num_new_tokens, new_computed_blocks)`
        ran now (negative when it cannot)."""
        computed = new_computed_blocks or ()
        total = request.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        num_new = self.num_blocks_for(total) - len(request.block_table) - len(computed)
        # Hit blocks sitting in the free list (ref count 0) leave it when touched.
        num_touched_free = sum(1 for b in computed if self.blocks[b].ref_count == 0)
        return len(self._free) - max(num_new, 0) - num_touched_free

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[int] | None = None,
        reserve_blocks: int = 0,
    ) -> bool:
        """Give `request` the blocks to hold `num_new_tokens` more tokens.

        The slots needed run to `request.num_computed_tokens + len(new_computed_blocks) *
        block_size + num_new_tokens`. `new_computed_blocks` (from `get_computed_blocks`, only for
        a request holding no blocks) become the head of its block table with their ref counts
        raised; new blocks come from the head of the free list, evicting their cached hash.
        The caller advances `num_computed_tokens` (the hit tokens and, after the step, the new ones).

        First returns the request's blocks that left the sliding window (`free_outside_window`);
        that is the one change made even when it then returns False.

        Args:
            request: the request to grow.
            num_new_tokens: tokens to compute this step (>= 0).
            new_computed_blocks: prefix-cache hit blocks, or None.
            reserve_blocks: fail unless at least this many blocks stay free afterwards
                (the scheduler's admission watermark).

        Returns:
            True on success; False when too few free blocks, in which case nothing changed.
        """
        assert num_new_tokens >= 0, f"num_new_tokens={num_new_tokens}"
        self.free_outside_window(request)
        table = request.block_table
        if not new_computed_blocks and table and reserve_blocks <= len(self._free):
            # Fast path (decodes): the new tokens fit in the blocks the request already holds.
            total = request.num_computed_tokens + num_new_tokens
            if total <= len(table) * self.block_size:
                last = self.blocks[table[(total - 1) // self.block_size]]
                assert last.ref_count == 1 or num_new_tokens == 0, (
                    f"{request.request_id} would write shared block {last.block_id}"
                )
                if request.num_computed_tokens < request.num_prompt_tokens:
                    self._register_prompt_blocks(request, total)
                return True
        computed = list(new_computed_blocks or ())
        assert not computed or not request.block_table, "hits only for a request without blocks"
        if self.num_free_after(request, num_new_tokens, computed) < reserve_blocks:
            return False
        if request.request_id not in self._live:
            self._live[request.request_id] = request
            self._num_registered[request.request_id] = len(computed)
            if self.enable_prefix_caching and request.num_preemptions == 0:
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += len(computed) * self.block_size
        for block_id in computed:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1
        request.block_table.extend(computed)
        total = request.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        for _ in range(self.num_blocks_for(total) - len(request.block_table)):
            request.block_table.append(self._pop_free_block())
        # The step writes positions [total - num_new_tokens, total): never into a shared block.
        first = (total - num_new_tokens) // self.block_size
        for block_id in request.block_table[first : self.num_blocks_for(total)]:
            assert self.blocks[block_id].ref_count == 1 or num_new_tokens == 0, (
                f"{request.request_id} would write shared block {block_id}"
            )
        self._register_prompt_blocks(request, total)
        return True

    def _register_prompt_blocks(self, request: Request, total: int) -> None:
        """Register the prompt blocks that are full once the step computing up to `total`
        tokens has run; the ones not computed yet are marked uncomputed until then."""
        if not self.enable_prefix_caching:
            return
        num_full = min(total, request.num_prompt_tokens) // self.block_size
        start = self._num_registered[request.request_id]  # blocks before it: computed or hits
        if num_full <= start:
            return
        self._register(request, num_full)
        for block_id in request.block_table[start:num_full]:
            if self.blocks[block_id].block_hash is not None:
                self._uncomputed.add(block_id)

    def is_uncomputed(self, block_id: int) -> bool:
        """True for a block registered at allocation whose KV the current step computes."""
        return block_id in self._uncomputed

    def shares_uncomputed(self, request: Request) -> bool:
        """True when another request holds a block that `request` registered this step but has
        not computed yet (freeing `request` now would leave that request reading no KV)."""
        if not self._uncomputed:
            return False
        first = request.num_computed_tokens // self.block_size
        return any(
            b in self._uncomputed and self.blocks[b].ref_count > 1
            for b in request.block_table[first:]
        )

    def _pop_free_block(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        assert block.ref_count == 0, f"block {block_id} in the free list with ref {block.ref_count}"
        if block.block_hash is not None:  # evict: its KV is about to be overwritten
            del self._cached[block.block_hash]
            block.forget()
            self.num_evictions += 1
        block.ref_count = 1
        return block_id

    def cache_full_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's blocks that are full of computed KV in the prefix cache.

        Call after a step with the request's new `num_computed_tokens`. A block whose hash is
        already cached under another block (two identical prefixes computed at once) stays
        unregistered; the first copy serves later hits. When that other block holds different
        content (a hash collision), the request registers nothing from there on: its later
        blocks would claim a chain through content that is not theirs.
        """
        if not self.enable_prefix_caching or request.request_id not in self._live:
            return
        num_full = min(num_computed_tokens // self.block_size, len(request.block_table))
        if self._uncomputed:
            self._uncomputed.difference_update(request.block_table[:num_full])
        if num_full > self._num_registered[request.request_id]:
            self._register(request, num_full)

    def _register(self, request: Request, num_full: int) -> None:
        """Register the request's blocks `[_num_registered, num_full)` under their hashes."""
        start = self._num_registered[request.request_id]
        self._update_block_hashes(request, num_full * self.block_size)
        bs = self.block_size
        for i in range(start, num_full):
            if request.block_table[i] == NULL_BLOCK:
                continue  # left the window before it was registered: its KV is gone from here
            block = self.blocks[request.block_table[i]]
            block_hash = request.block_hashes[i]
            parent = request.block_hashes[i - 1] if i else None
            tokens = request.token_ids_slice(i * bs, (i + 1) * bs)
            extra = self._extra_keys(request, i)
            other = self._cached.get(block_hash)
            if other is not None and other != block.block_id:
                if not self.blocks[other].holds(parent, tokens, extra):
                    self.num_hash_collisions += 1
                    logger.warning("prefix-cache hash collision on block %d: not registered", other)
                    num_full = _STOP_REGISTERING
                    break
                continue
            if block.block_hash is not None:
                continue
            block.block_hash = block_hash
            block.parent_hash = parent
            block.token_ids = tuple(tokens)
            block.extra_keys = tuple(extra or ())
            self._cached[block_hash] = block.block_id
        self._num_registered[request.request_id] = num_full

    def trim(self, request: Request, num_tokens: int) -> int:
        """Return the trailing blocks of `request` beyond what `num_tokens` tokens need
        (speculative decoding's lookahead after rejected drafts). Those blocks hold only
        positions past the request's computed tokens, so they are its own and unregistered.
        Returns the number of blocks freed.
        """
        keep = self.num_blocks_for(num_tokens)
        table = request.block_table
        freed = 0
        while len(table) > keep:
            block = self.blocks[table.pop()]
            assert block.ref_count == 1 and block.block_hash is None, (
                f"{request.request_id}: lookahead block {block.block_id} is shared or cached"
            )
            block.ref_count = 0
            self._free[block.block_id] = None
            self._free.move_to_end(block.block_id, last=False)
            freed += 1
        return freed

    def free_outside_window(self, request: Request) -> int:
        """Return the request's blocks wholly before position `num_computed_tokens -
        sliding_window` to the pool (no query of it reads them again) and mark them
        `NULL_BLOCK` in its block table. Nothing without a sliding window.

        Returns the number of blocks freed.

        ::

            positions  [0 ........ n - W) [n - W ...... n)  n = num_computed_tokens
            blocks      freed (NULL_BLOCK)  kept: the block holding n - W and after
        """
        if self.sliding_window is None:
            return 0
        table = request.block_table
        start = self._num_window_freed.get(request.request_id, 0)
        end = min(
            (request.num_computed_tokens - self.sliding_window) // self.block_size, len(table)
        )
        for i in range(start, end):
            self._release(table[i])
            table[i] = NULL_BLOCK
        if end <= start:
            return 0
        self._num_window_freed[request.request_id] = end
        self.num_window_freed_blocks += end - start
        return end - start

    def _release(self, block_id: int) -> None:
        """Drop one reference; a block reaching ref count 0 goes to the tail of the free list
        when it is cached (LRU eviction order) or to the head when it is not."""
        block = self.blocks[block_id]
        assert block.ref_count > 0, f"double free of block {block_id}"
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free[block_id] = None
            if block_id in self._uncomputed:  # its KV was never written: not a hit
                self._uncomputed.discard(block_id)
                del self._cached[block.block_hash]
                block.forget()
            if block.block_hash is None:
                self._free.move_to_end(block_id, last=False)

    def free(self, request: Request) -> None:
        """Release all blocks of `request` (finish, abort or preemption); idempotent.

        Blocks are released tail-first (`_release`); `NULL_BLOCK` entries were freed already.
        """
        for block_id in reversed(request.block_table):
            if block_id != NULL_BLOCK:
                self._release(block_id)
        request.block_table.clear()
        self._live.pop(request.request_id, None)
        self._num_registered.pop(request.request_id, None)
        self._num_window_freed.pop(request.request_id, None)

    def reset_prefix_cache(self) -> int:
        """Forget every cached hash (e.g. after weights change). Returns the blocks dropped.

        Live requests keep their blocks; those blocks simply stop being shareable.
        """
        n = len(self._cached)
        for block_id in self._cached.values():
            self.blocks[block_id].forget()
        self._cached.clear()
        self._uncomputed.clear()
        return n

    # --- invariants ---
    def check_integrity(self) -> None:
        """Verify the bookkeeping; raise AssertionError naming the first broken invariant.

        Checks: each block's ref count equals its occurrences in live requests' block tables;
        no block table repeats a block; the free list holds exactly the blocks with ref count 0,
        once each; every cached hash maps to a block carrying that hash and its token ids.
        """
        counts = [0] * self.num_blocks
        for rid, req in self._live.items():
            assert req.request_id == rid, f"live request key {rid} != {req.request_id}"
            held = [b for b in req.block_table if b != NULL_BLOCK]
            assert len(set(held)) == len(held), (
                f"{rid} block table repeats a block: {req.block_table}"
            )
            assert req.num_computed_tokens <= len(req.block_table) * self.block_size, (
                f"{rid}: {req.num_computed_tokens} computed tokens in {len(req.block_table)} blocks"
            )
            nulls = self._num_window_freed.get(rid, 0)
            assert all(b == NULL_BLOCK for b in req.block_table[:nulls]), f"{rid}: freed head"
            for block_id in req.block_table[nulls:]:
                assert block_id != NULL_BLOCK, f"{rid}: NULL_BLOCK past its window-freed head"
                counts[block_id] += 1
        for block in self.blocks:
            assert block.ref_count == counts[block.block_id], (
                f"block {block.block_id}: ref_count {block.ref_count} != {counts[block.block_id]} "
                "uses in live block tables"
            )
            in_free = block.block_id in self._free
            assert in_free == (block.ref_count == 0), (
                f"block {block.block_id}: ref_count {block.ref_count} but in_free_list={in_free}"
            )
            if block.block_hash is not None:
                assert self._cached.get(block.block_hash) == block.block_id, (
                    f"block {block.block_id} has a hash not mapped to it"
                )
                assert len(block.token_ids) == self.block_size, (
                    f"cached block {block.block_id} has {len(block.token_ids)} token ids"
                )
        for block_hash, block_id in self._cached.items():
            assert self.blocks[block_id].block_hash == block_hash, (
                f"cache entry for block {block_id} disagrees with the block's hash"
            )
        for block_id in self._uncomputed:
            assert counts[block_id] and self.blocks[block_id].block_hash is not None, (
                f"uncomputed block {block_id} is free or not cached"
            )
        assert len(self._free) + sum(1 for c in counts if c) == self.num_blocks, "block count"
