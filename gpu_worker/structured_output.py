"""Structured outputs in the engine: grammar compile cache, per-request matchers, token bitmasks.

A request whose `SamplingParams.structured_outputs` holds a wire spec (see
`contracts.openai.structured`) is constrained by an llguidance grammar
(https://github.com/guidance-ai/llguidance; the library vLLM's "guidance" backend uses):

1. **Compile, off the engine loop.** `GrammarCompiler` turns a spec into a template
   `llguidance.LLMatcher` on a worker thread (llguidance drops the GIL while it builds a grammar),
   caches the template in a bounded LRU keyed by the canonical spec, and hands each request its
   own `deep_copy()` (tens of microseconds). Until its matcher is ready a request waits outside
   the scheduler (`StructuredOutputs.add` / `take_ready`, vLLM's WAITING_FOR_FSM), so a slow
   compile never stalls the requests that are running.
2. **Mask, in the batched sampler.** Each step `batch_bitmask` fills one `[R, ceil(V / 32)]` int32
   bitmask for the R constrained rows (bit `t % 32` of word `t // 32` set = token t allowed;
   llguidance's layout, filled in parallel by `llguidance.LLExecutor`), and the sampler applies it
   with `apply_token_bitmask` before penalties, temperature, top-k and top-p. EOS is allowed only
   where the grammar accepts. Rows without a grammar are not touched and cost nothing. Greedy
   rows skip the mask: they are sampled without it; a pick the grammar allows is the masked
   argmax too, a step where the grammar forces a token takes that token, and only the other
   rows get their masks and are sampled again (`StructuredOutputs.redo_refused`).
3. **Advance.** The engine calls `GrammarMatcher.accept` with every token it appends to a
   constrained request. Preemption by recompute replays KV only -- tokens already produced are never
   sampled again -- so the matcher is not advanced twice; speculative decoding (a request with d
   draft tokens gets d + 1 logits rows) uses `fill_bitmasks_with_drafts` and, after verification,
   `accept` for the kept tokens (`rollback` undoes tokens a caller took back).
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any, NamedTuple

import llguidance
import torch

from laneserve.contracts.openai.structured import grammar_of
from laneserve.kernels import cpu_ext

__all__ = [
    "DEFAULT_GRAMMAR_CACHE_SIZE",
    "GrammarCompiler",
    "GrammarError",
    "GrammarMask",
    "GrammarMatcher",
    "expand_mask_rows",
    "StructuredOutputs",
    "apply_token_bitmask",
    "batch_bitmask",
]

logger = logging.getLogger(__name__)

# Distinct compiled grammars kept per worker. A JSON-schema template holds the schema's grammar
# (kilobytes to a few megabytes for large schemas); the lexer state llguidance builds lazily
# lives in each request's copy, which goes when the request ends.
DEFAULT_GRAMMAR_CACHE_SIZE = 256
# A greedy row whose picks the grammar refuses this many times in a row computes its mask
# beside the forward pass for the next MASKED_STEPS steps (`GrammarMatcher.mask_first`).
MAX_REFUSALS = 3
MASKED_STEPS = 8
# [32] int32: the value of each bit of a bitmask word (bit 31 is the sign bit)
_BIT_VALUES = torch.tensor([1 << i for i in range(31)] + [-(1 << 31)], dtype=torch.int32)


class GrammarError(ValueError):
    """A spec llguidance cannot compile for this tokenizer (its message names the problem)."""


class GrammarMask(NamedTuple):
    """The allowed tokens of the constrained rows of one sampling batch.

    `rows`: indices into the batch (ascending); `bitmask`: `[len(rows), ceil(V / 32)]` int32 on
    the CPU, bit `t % 32` of word `t // 32` set when token t is allowed."""

    rows: list[int]
    bitmask: torch.Tensor

    def row(self, i: int) -> GrammarMask | None:
        """The mask of batch row `i` alone (a one-row batch), None when it is unconstrained."""
        if i not in self.rows:
            return None
        j = self.rows.index(i)
        return GrammarMask([0], self.bitmask[j : j + 1])


class GrammarMatcher:
    """One request's position in its grammar (wraps an `llguidance.LLMatcher`).

    Methods for the engine's normal step (`fill_bitmask`, `accept`) and for speculative decoding
    (`fill_bitmasks_with_drafts`, `accept` of the verified prefix, `rollback`)."""

    __slots__ = ("_matcher", "_eos", "_vocab", "num_accepted", "refusals", "masked_steps")

    def __init__(
        self,
        matcher: llguidance.LLMatcher,
        eos_token_ids: Sequence[int] = (),
        vocab_size: int | None = None,
    ) -> None:
        self._matcher = matcher
        self._eos = frozenset(eos_token_ids)
        self._vocab = vocab_size  # ids at or above it break an llguidance matcher for good
        self.num_accepted = 0  # tokens consumed so far (after rollbacks)
        self.refusals = 0  # greedy picks refused in a row (`StructuredOutputs.redo_refused`)
        self.masked_steps = 0  # steps left that compute the mask first (after refusals)

    def mask_first(self) -> bool:
        """True when this greedy step should compute its mask beside the forward pass, as a
        sampled row does: for `MASKED_STEPS` steps after `MAX_REFUSALS` refused picks in a row
        (a grammar the model keeps disagreeing with pays a mask and a second sampling
        otherwise)."""
        if self.masked_steps > 0:
            self.masked_steps -= 1
            return True
        return False

    def greedy_pick(self, token_id: int) -> int | None:
        """The masked argmax of a step whose unmasked argmax is `token_id`, where it is known
        without the mask (~15 us against ~100 us for a mask; the matcher does not move):
        `token_id` where the mask allows it, the forced token where the mask holds one only;
        None where the mask is needed. llguidance's mask follows these rules (tests check them
        on every token id): where the grammar forces bytes that tokenize to forced tokens, it
        holds the first of them only (not the other tokenizations of those bytes); EOS where
        the grammar accepts; else every token the grammar can take."""
        if self._vocab is not None and not 0 <= token_id < self._vocab:
            return None
        forced = self._matcher.compute_ff_tokens()
        if forced:
            return forced[0]
        if token_id in self._eos:
            return token_id if self.is_accepting else None
        return token_id if self._matcher.validate_tokens([token_id]) == 1 else None

    def accept(self, token_ids: Sequence[int]) -> int:
        """Advance over `token_ids` in order; returns how many were valid and consumed (the
        consumed prefix; the matcher stays at the last valid one, never in an error state)."""
        n = self._matcher.try_consume_tokens(list(token_ids))
        self.num_accepted += n
        return n

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (speculative drafts rejected later).

        Raises:
            ValueError: more tokens than were accepted, or llguidance refuses.
        """
        if not 0 <= num_tokens <= self.num_accepted:
            raise ValueError(f"rollback({num_tokens}) with {self.num_accepted} accepted tokens")
        if num_tokens and not self._matcher.rollback(num_tokens):
            raise ValueError(f"grammar rollback failed: {self._matcher.get_error()}")
        self.num_accepted -= num_tokens

    @property
    def is_terminated(self) -> bool:
        """True when the grammar is complete: nothing but EOS may follow."""
        return self._matcher.is_stopped()

    @property
    def is_accepting(self) -> bool:
        """True when the output so far is a complete sentence of the grammar (EOS allowed)."""
        return self._matcher.is_accepting()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` (`[*, W]` int32, CPU, contiguous)."""
        target = bitmask[row]
        self._matcher.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * 4)

    def fill_bitmasks_with_drafts(
        self, bitmask: torch.Tensor, row: int, draft_ids: Sequence[int]
    ) -> int:
        """Masks for the d + 1 logits rows of a request with d draft tokens, leaving the matcher
        where it was.

        Row `row + i` gets the tokens allowed after the first i drafts. The matcher advances over
        the drafts while they are valid, filling each row, then rolls back over them. Rows after
        an invalid draft are left all-allowed: the verifier rejects that draft, so their tokens
        are never used. Returns how many drafts the grammar allows (a prefix of `draft_ids`).
        """
        self.fill_bitmask(bitmask, row)
        valid = 0
        for i, token in enumerate(draft_ids, start=1):
            if self.accept([token]) != 1:
                bitmask[row + i :].fill_(-1)  # not reached by any kept token
                break
            valid += 1
            self.fill_bitmask(bitmask, row + i)
        self.rollback(valid)
        return valid

    def error(self) -> str:
        return self._matcher.get_error()


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def batch_bitmask(
    matchers: Sequence[GrammarMatcher | None],
    vocab_size: int,
    executor: llguidance.LLExecutor | None = None,
) -> GrammarMask | None:
    """The `GrammarMask` of one sampling batch (`matchers[i]` None = row i unconstrained), or
    None when no row has a grammar (the common case pays one list scan)."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return None
    bitmask = torch.empty(len(rows), bitmask_words(vocab_size), dtype=torch.int32)
    if executor is not None and len(rows) > 1:
        pairs = [(matchers[i]._matcher, j) for j, i in enumerate(rows)]
        executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), bitmask.shape[1] * 4, len(rows))
    else:
        for j, i in enumerate(rows):
            matchers[i].fill_bitmask(bitmask, j)
    return GrammarMask(rows, bitmask)


def apply_token_bitmask(logits: torch.Tensor, mask: GrammarMask) -> torch.Tensor:
    """`[B, V]` logits -> a float32 copy where the tokens `mask` forbids are -inf (only its rows).

    Tokens beyond the bitmask's `32 * W` ids are forbidden too. The input is not modified. On
    the CPU with the C++ kernels built, one in-place pass (`apply_token_bitmask_`, ~1 ms at batch
    64 where unpacking the bits in torch took ~8); elsewhere torch ops."""
    out = logits.to(torch.float32, copy=True)  # [B, V]
    if out.device.type == "cpu" and out.is_contiguous() and cpu_ext.load():
        rows = torch.tensor(mask.rows, dtype=torch.int64)
        torch.ops.laneserve.apply_token_bitmask_(out, mask.bitmask.contiguous(), rows)
        return out
    return apply_token_bitmask_torch(out, mask)


def apply_token_bitmask_torch(out: torch.Tensor, mask: GrammarMask) -> torch.Tensor:
    """`apply_token_bitmask` in torch ops (any device), on the float32 copy `out`, in place."""
    rows, vocab = len(mask.rows), out.shape[1]
    bitmask = mask.bitmask.to(out.device, non_blocking=True)  # [R, W]
    words = min(bitmask.shape[1], (vocab + 31) // 32)
    forbidden = (bitmask[:, :words, None] & _BIT_VALUES.to(out.device)) == 0  # [R, words, 32]
    forbidden = forbidden.view(rows, words * 32)[:, :vocab]  # [R, <=V]
    all_rows = rows == out.shape[0]
    sub = out if all_rows else out[torch.tensor(mask.rows, device=out.device)]  # [R, V]
    sub[:, : forbidden.shape[1]].masked_fill_(forbidden, float("-inf"))
    sub[:, forbidden.shape[1] :] = float("-inf")
    if not all_rows:
        out[torch.tensor(mask.rows, device=out.device)] = sub
    return out


class GrammarCompiler:
    """Specs -> compiled template matchers, with a bounded LRU cache (thread-safe).

    Args:
        tokenizer: the model's Hugging Face fast tokenizer (its `backend_tokenizer` JSON is what
            llguidance reads; the `LLTokenizer` is built once, ~1 s, at the first compile).
        vocab_size: the logits width (the model's embedding rows; may exceed the tokenizer).
        eos_token_ids: the model's EOS ids (allowed only where the grammar accepts).
        cache_size: distinct specs kept (least recently used evicted first).
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        cache_size: int = DEFAULT_GRAMMAR_CACHE_SIZE,
    ) -> None:
        assert cache_size >= 1, cache_size
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self._hf_tokenizer = tokenizer
        self._eos = sorted(int(t) for t in eos_token_ids)
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0
        self.last_compile_ms = 0.0

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance.hf

                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self._eos
                )
            return self._ll_tokenizer

    def matcher(self, spec: dict[str, Any]) -> GrammarMatcher:
        """A fresh matcher for `spec` (compiled, or copied from the cache).

        Raises:
            GrammarError: llguidance cannot build the grammar for this tokenizer.
        """
        key = json.dumps(spec, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        with self._lock:
            template = self._cache.get(key)
            if template is not None:
                self._cache.move_to_end(key)
                self.hits += 1
        if template is None:
            template = self._compile(spec)
            with self._lock:
                self.misses += 1
                self._cache[key] = template
                self._cache.move_to_end(key)
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        return GrammarMatcher(template.deep_copy(), self._eos, self.vocab_size)

    def _compile(self, spec: dict[str, Any]) -> llguidance.LLMatcher:
        tokenizer = self.ll_tokenizer
        start = time.perf_counter()
        try:
            grammar = grammar_of(spec)
        except ValueError as exc:
            raise GrammarError(str(exc)) from None
        template = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        self.last_compile_ms = (time.perf_counter() - start) * 1e3
        if template.is_error():
            raise GrammarError(template.get_error())
        if not self._admits_output(template):
            raise GrammarError(
                "the grammar admits no output (for example a required property whose schema "
                "refers back to itself without end)"
            )
        return template

    def _admits_output(self, template: llguidance.LLMatcher) -> bool:
        """False when the first step allows no token but EOS while the grammar does not accept
        the empty output (llguidance stops such grammars at once)."""
        probe = GrammarMatcher(template.deep_copy())
        bitmask = torch.zeros(1, bitmask_words(self.vocab_size), dtype=torch.int32)
        probe.fill_bitmask(bitmask, 0)
        for eos in self._eos:
            bitmask[0, eos // 32] &= ~(1 << (eos % 32))
        return bool(bitmask.any()) or probe.is_accepting

    def __len__(self) -> int:
        return len(self._cache)


class _Ready(NamedTuple):
    request_id: str
    matcher: GrammarMatcher | None
    error: str | None


class StructuredOutputs:
    """The engine's side of structured outputs: compiles off the loop, hands out ready matchers.

    `add(request_id, spec)` starts a compile on the worker thread; `take_ready()` returns the
    requests whose matcher (or compile error) is ready, in the order they were added; the engine
    admits them to the scheduler then. `discard` forgets an aborted request.
    """

    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        self._mask_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")
        self._pending: dict[str, Future[GrammarMatcher]] = {}
        self._executor: llguidance.LLExecutor | None = None
        self._executor_lock = threading.Lock()
        self.num_greedy_rows = 0  # greedy constrained rows sampled (`redo_refused`)
        self.num_forced_rows = 0  # of which given the token the grammar forces
        self.num_refused_rows = 0  # of which sampled again with their masks

    def add(self, request_id: str, spec: dict[str, Any]) -> None:
        self._pending[request_id] = self._pool.submit(self.compiler.matcher, spec)

    def discard(self, request_id: str) -> bool:
        """Forget a pending request; True when it was pending."""
        future = self._pending.pop(request_id, None)
        if future is not None:
            future.cancel()
        return future is not None

    def is_pending(self, request_id: str) -> bool:
        return request_id in self._pending

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def take_ready(self, wait_s: float = 0.0) -> list[_Ready]:
        """The pending requests whose compile finished; waits up to `wait_s` for a first one."""
        if not self._pending:
            return []
        if wait_s > 0:
            wait_futures(
                list(self._pending.values()), timeout=wait_s, return_when="FIRST_COMPLETED"
            )
        ready = []
        for rid, future in list(self._pending.items()):
            if not future.done():
                continue
            del self._pending[rid]
            try:
                ready.append(_Ready(rid, future.result(), None))
            except GrammarError as exc:
                ready.append(_Ready(rid, None, f"structured_outputs cannot be enforced: {exc}"))
            except Exception as exc:  # a library failure fails this request only
                logger.exception("grammar compile failed for %s", rid)
                ready.append(_Ready(rid, None, f"grammar compile failed: {exc}"))
        return ready

    def start_bitmask(
        self, matchers: Sequence[GrammarMatcher | None]
    ) -> Future[GrammarMask | None] | None:
        """`bitmask(matchers)` on the mask thread (llguidance drops the GIL), so it overlaps the
        forward pass; None when no row has a grammar. The caller takes `.result()` before it
        samples and advances any matcher (one mask thread: fills never overlap each other)."""
        if all(m is None for m in matchers):
            return None
        return self._mask_pool.submit(self.bitmask, list(matchers))

    def bitmask(self, matchers: Sequence[GrammarMatcher | None]) -> GrammarMask | None:
        """`batch_bitmask` with a shared parallel executor (built at the first batch of two;
        the mask thread and the engine's thread may both ask, an interleaved step's refused
        rows during the outer step's mask)."""
        if sum(m is not None for m in matchers) > 1:
            with self._executor_lock:
                if self._executor is None:
                    self._executor = llguidance.LLExecutor()
        return batch_bitmask(matchers, self.compiler.vocab_size, self._executor)

    def redo_refused(
        self,
        rows: list[Any],
        greedy: Sequence[GrammarMatcher | None],
        drafts: Sequence[Sequence[int]],
        resample: Callable[[list[int], list[int], GrammarMask | None], list[Any]],
    ) -> list[Any]:
        """Greedy constrained rows are sampled without their masks (`greedy[i]`: row i's
        matcher, `rows[i].token_ids[0]` its pick, none after an error). Where the grammar
        allows the pick it is the masked argmax too (a mask only sets -inf, and the sampler's
        other edits of the logits are per token, alike with or without it); where the grammar
        forces one token it is that token (a row that asked for logprobs is sampled again, for
        that token's). Only the other rows get their masks and are sampled again:
        `resample(logits rows, row indices, mask)` (a constrained request has no drafts: its
        one logits row follows the rows of the requests before it). A forced token is not
        swapped in where `min_tokens` may have set it to -inf (the masked row is then all -inf,
        and its argmax is what the mask's path gives)."""
        redo = []
        for i, (m, row) in enumerate(zip(greedy, rows, strict=True)):
            if m is None or not row.token_ids:
                continue
            assert not drafts[i], "a constrained request was given drafts"
            self.num_greedy_rows += 1
            pick = m.greedy_pick(row.token_ids[0])
            if pick == row.token_ids[0]:
                m.refusals = 0
                continue
            req, params = row.state.request, row.state.params
            swap = row.logprobs[0] is None and req.num_output_tokens >= params.min_tokens
            if pick is not None and swap:
                row.token_ids[0] = pick
                self.num_forced_rows += 1
                m.refusals = 0
                continue
            redo.append(i)
            m.refusals += 1
            if m.refusals >= MAX_REFUSALS:
                m.refusals, m.masked_steps = 0, MASKED_STEPS
        self.num_refused_rows += len(redo)
        if not redo:
            return rows
        starts = list(itertools.accumulate((1 + len(d) for d in drafts), initial=0))
        mask = self.bitmask([greedy[i] for i in redo])
        for i, row in zip(redo, resample([starts[i] for i in redo], redo, mask), strict=True):
            rows[i] = row
        return rows

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._mask_pool.shutdown(wait=False, cancel_futures=True)


def expand_mask_rows(
    masks: GrammarMask | None, drafts: list[tuple[int, ...]]
) -> GrammarMask | None:
    """Grammar masks indexed by request -> indexed by the sampling batch's rows (request i owns
    `1 + len(drafts[i])` rows). Constrained requests are never given drafts (`add_request`), so
    each of them owns exactly one row."""
    if masks is None:
        return None
    offsets = [0]
    for d in drafts:
        offsets.append(offsets[-1] + 1 + len(d))
    assert all(not drafts[i] for i in masks.rows), "a constrained request was given drafts"
    return GrammarMask([offsets[i] for i in masks.rows], masks.bitmask)
