"""Speculative decoding by n-gram prompt lookup: proposer, verification rows, adaptive control.

DESIGN.md "Speculative decoding". Per step, for every running request that decodes:

1. **Propose** (`NgramProposer`): find the longest suffix n-gram of the request's prompt + output
   (`prompt_lookup_min <= n <= prompt_lookup_max`) that occurred earlier in the same sequence and
   draft the (up to k) tokens that followed its most recent earlier occurrence. numpy over the
   request's own token history (`TokenHistory`, grown in place), no model.
2. **Decide** (`SpecController`): how many of those drafts each request actually sends, from the
   measured cost of a step (an online least-squares fit `step_ms ~ a + b * tokens`) and each
   request's running acceptance rate. A draft is worth sending when its expected yield (the
   probability that it and every draft before it are accepted) per millisecond it adds to the
   step beats the step's current tokens per millisecond. Bandwidth-bound steps (small batches,
   where a token more costs almost nothing) speculate; compute-bound ones (large batches) stop.
   Adaptive speculation drafts only in pure decode steps (drafts take the token budget before
   prompts being prefilled, whose start they would delay), and a measured check (`YieldGuard`)
   vetoes drafts at a batch size where steps with drafts emitted fewer tokens per millisecond,
   end to end, than steps without them.
3. **Verify** inside the ordinary varlen step: a request with d drafts computes d + 1 query
   tokens `[last token, x_1 .. x_d]` and gets d + 1 logits rows; row j is sampled by the ordinary
   `Sampler` as if `x_1 .. x_j` were already output (`verify_rows` builds those per-row inputs,
   so penalties, min_tokens, logit_bias, temperature, top-k/top-p/min_p apply per row exactly as
   without speculation). `verify` keeps the drafts while the row's token equals the draft,
   then the first differing row's token (or the bonus row's, when all d match) ends the run.

Why this is lossless. Greedy rows are argmaxes, so the accepted run is the argmax chain. For a
sampled row, drawing y ~ p and accepting the one-hot draft x iff y == x is exactly rejection
sampling with a one-hot draft distribution (Leviathan et al. 2023; Chen et al. 2023): x is accepted
with probability p(x), and on rejection the emitted y is distributed as p with x removed and
renormalised, which is the residual `max(p - onehot(x), 0)` normalised. Each emitted token takes
one uniform from the request's own generator, the same one it would take without speculation
(`verify` rewinds the generator past the rows after the first rejection),
so a seeded request gives the same tokens with speculation on or off, alone or in any batch.

Rollback (engine + scheduler): `num_computed_tokens` advances by the accepted drafts plus the
input token only; the K/V written at rejected positions sits past `num_computed_tokens` and is
overwritten by later steps; lookahead blocks past the next position are freed
(`BlockManager.trim`); a block is registered in the prefix cache only once every slot of it is
below `num_computed_tokens` with its final tokens, so rejected K/V never enters the cache.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from laneserve.gpu_worker.config import SpeculativeConfig
from laneserve.gpu_worker.request import Request
from laneserve.gpu_worker.sampler import Sampler
from laneserve.gpu_worker.sampling_params import SamplingParams
from laneserve.gpu_worker.structured_output import GrammarMask

__all__ = [
    "NgramProposer",
    "RequestSpecStats",
    "SpecController",
    "YieldGuard",
    "SpecRequest",
    "TokenHistory",
    "VerifiedRun",
    "num_accepted",
    "spec_totals",
    "suffix_matches",
    "verify",
    "verify_rows",
]

logger = logging.getLogger(__name__)


class TokenHistory:
    """A request's prompt + output token ids as a growing int64 numpy array (amortised O(1)
    append), so the proposer never rebuilds an array from Python lists each step."""

    __slots__ = ("_buf", "_len")

    def __init__(self, token_ids: Sequence[int]) -> None:
        n = len(token_ids)
        self._buf = np.empty(max(16, 2 * n), dtype=np.int64)
        self._buf[:n] = token_ids
        self._len = n

    def __len__(self) -> int:
        return self._len

    def extend(self, token_ids: Sequence[int]) -> None:
        n = len(token_ids)
        if self._len + n > self._buf.shape[0]:
            grown = np.empty(2 * (self._len + n), dtype=np.int64)
            grown[: self._len] = self._buf[: self._len]
            self._buf = grown
        self._buf[self._len : self._len + n] = token_ids
        self._len += n

    def view(self) -> np.ndarray:
        """`[len]` int64, a view (do not keep it across `extend`)."""
        return self._buf[: self._len]


def suffix_matches(tokens: np.ndarray, max_n: int) -> tuple[np.ndarray, np.ndarray]:
    """Earlier occurrences of the suffix of `tokens` ([L] int64): the end positions i < L - 1
    where `tokens[i] == tokens[L - 1]`, and per position the length n <= `max_n` of the longest
    suffix n-gram `tokens[L-n:]` that also ends there. One vectorised compare over the sequence
    for the last token, then one per n-gram position over the candidates only."""
    L = tokens.shape[0]
    cand = np.flatnonzero(tokens[: L - 1] == tokens[L - 1])
    length = np.ones(cand.shape[0], dtype=np.int64)
    alive = np.ones(cand.shape[0], dtype=bool)
    for j in range(1, max_n):
        pos = cand - j
        ok = alive & (pos >= 0)
        ok[ok] = tokens[pos[ok]] == tokens[L - 1 - j]
        if not ok.any():
            break
        length += ok
        alive = ok
    return cand, length


class NgramProposer:
    """Prompt-lookup drafts (vLLM's `ngram` method; Saxena's prompt lookup decoding).

    Args:
        min_n / max_n: shortest / longest suffix n-gram to match (`prompt_lookup_min/max`).
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, tokens: np.ndarray, k: int) -> np.ndarray:
        """Up to `k` draft tokens for the sequence `tokens` ([L] int64), maybe none.

        The longest n in [min_n, max_n] whose suffix n-gram `tokens[L-n:]` also ends at an
        earlier position i < L - 1 wins; among equally long matches the most recent one (copying
        continues where the text was last copied from). Drafts are `tokens[i+1 : i+1+k]`
        (`suffix_matches` finds the matches).
        """
        L = tokens.shape[0]
        if k < 1 or L < self.min_n + 1:
            return tokens[:0]
        cand, length = suffix_matches(tokens, self.max_n)
        if cand.size == 0:
            return tokens[:0]
        best = int(length.max())
        if best < self.min_n:
            return tokens[:0]
        i = int(cand[np.flatnonzero(length == best)[-1]])  # most recent of the longest
        return tokens[i + 1 : i + 1 + k]


@dataclass(slots=True)
class RequestSpecStats:
    """One request's acceptance evidence (its totals are `Request.num_spec_*_tokens`).

    Attributes:
        acc / rej: exponentially forgotten counts of accepted drafts and of rejections (a run
            that stopped before its last draft), the per-draft acceptance estimate's evidence.
    """

    acc: float = 0.0
    rej: float = 0.0

    @property
    def acceptance(self) -> float:
        """Per-draft acceptance probability estimate: the geometric-run MLE with one pseudo
        acceptance and one pseudo rejection (Laplace), in (0, 1)."""
        return (self.acc + 1.0) / (self.acc + self.rej + 2.0)

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        self.acc = 0.9 * self.acc + num_accepted
        self.rej = 0.9 * self.rej + (num_accepted < num_drafts)


@dataclass(slots=True)
class SpecRequest:
    """The engine's speculative state of one request: its token history and acceptance."""

    history: TokenHistory
    stats: RequestSpecStats = field(default_factory=RequestSpecStats)


class YieldGuard:
    """Measured check on the cost model (module docstring, step 2): per batch-size bucket (the
    decoding rows' bit length: 1, 2-3, 4-7, ..., 64-127) it keeps an exponentially weighted
    mean of the tokens emitted per millisecond of whole step (proposing, forward, verification,
    bookkeeping) in steps that verified drafts and in steps that did not, and vetoes drafts in a
    bucket where they measured slower (adaptive speculation drafts in no other steps). The fit
    `a + b * tokens` misses per-row costs that grow with the batch (sampling and verification per
    row, a kernel switch at some row count), so at a large batch it can still find drafts worth
    it when, end to end, they are not.

    Every `PROBE_EVERY`-th decode step of a bucket runs the other way (without drafts while they
    are allowed, with them while vetoed), so both means stay current; until a bucket has
    `MIN_SAMPLES` measured steps of each mode its steps alternate between the two (a step that
    also prefills is not measured and drafts nothing, so neither mode waits on one).
    """

    PROBE_EVERY = 16
    MIN_SAMPLES = 3
    _WEIGHT = 0.2  # of the newest step in a mean: about the last 5-10 steps of a mode count

    def __init__(self) -> None:
        # bucket -> [rate without drafts, steps, rate with drafts, steps]
        self._means: dict[int, list[float]] = {}
        self._steps: dict[int, int] = {}

    @staticmethod
    def bucket(num_rows: int) -> int:
        """Octave index: 1 -> 1, 2-3 -> 2, 4-7 -> 3, ... (each bucket pays its own first
        measured steps, so finer buckets pay more of them on a short run)."""
        return max(num_rows, 1).bit_length()

    def allow(self, num_rows: int) -> bool:
        """Whether the coming decode step of `num_rows` decoding requests may verify drafts."""
        b = self.bucket(num_rows)
        step = self._steps[b] = self._steps.get(b, 0) + 1
        off, n_off, on, n_on = self._means.get(b, (0.0, 0, 0.0, 0))
        if min(n_on, n_off) < self.MIN_SAMPLES:
            return bool(step % 2) if max(n_on, n_off) < self.MIN_SAMPLES else n_on < n_off
        preferred = on >= off
        return preferred != (step % self.PROBE_EVERY == 0)

    def observe(self, num_rows: int, drafted: bool, emitted: int, step_ms: float) -> None:
        """One decode step of `num_rows` requests: `emitted` tokens in `step_ms` (whole step)."""
        if step_ms <= 0.0 or num_rows < 1:
            return
        m = self._means.setdefault(self.bucket(num_rows), [0.0, 0, 0.0, 0])
        i = 2 if drafted else 0
        rate = emitted / step_ms
        m[i] = rate if m[i + 1] == 0 else (1 - self._WEIGHT) * m[i] + self._WEIGHT * rate
        m[i + 1] += 1

    def vetoed(self) -> list[int]:
        """Buckets (the least row count of each) where drafts measured slower (logs, tests)."""
        return sorted(
            1 << (b - 1) for b, (off, n_off, on, n_on) in self._means.items()
            if min(n_on, n_off) >= self.MIN_SAMPLES and on < off
        )  # fmt: skip


class SpecController:
    """Chooses each step's draft lengths (see the module docstring, step 2).

    The step-cost model `ms = a + b * tokens` is fitted by least squares with exponential
    forgetting over the measured steps (`observe_step`). Until the scheduled token counts have
    varied enough to fit a slope, `b` is taken as `a / 16` (a 17-token step costs twice a
    1-token one: conservative on a CPU, pessimistic on a GPU), which speculates at small batch
    and not at large.

    A line misses the steps of a step's real cost: torch's int4 CPU kernel unpacks the weights
    once per 4 rows, so on a 2-core CPU a batch-1 step of 4 tokens measured 1.54x a 1-token one
    and a step of 5 tokens 2.36x (SmolLM2, bf16). So the steps of up to `TABLE_TOKENS` tokens
    also keep their own measured cost (an exponentially weighted mean per token count), which
    replaces the line for a count measured `TABLE_MIN_SAMPLES` times; the draft count is then
    chosen by trying every total, not by adding drafts while one more pays (at a cliff, one more
    draft never pays though four more would).

    Args:
        config: the engine's speculative config (`adaptive=False`: every proposal is sent whole).
    """

    _DECAY = 0.98  # per observed step: about the last 50 steps count
    # Every this many choices one request sends its whole proposal whatever the model says, so
    # the fit keeps seeing steps of several sizes and a request's acceptance keeps being
    # measured after the controller turned speculation off (one request: a few rows at most).
    EXPLORE_EVERY = 8
    TABLE_TOKENS = 32  # steps of up to this many tokens keep their own measured cost
    TABLE_MIN_SAMPLES = 3
    _TABLE_WEIGHT = 0.2  # of the newest step in a count's mean

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self._sw = self._sx = self._sy = self._sxx = self._sxy = 0.0
        # per token count n <= TABLE_TOKENS: mean step ms and the steps measured
        self._table_ms = np.zeros(self.TABLE_TOKENS + 1)
        self._table_n = np.zeros(self.TABLE_TOKENS + 1, dtype=np.int64)
        self.reset_totals()
        self._choices = 0
        self.guard = YieldGuard()
        self._step_rows = 0  # decoding requests of the coming step when it is pure decode, else 0

    def reset_totals(self) -> None:
        """Zero the totals since start (`spec_totals`; the /metrics counters are vLLM's names
        for them): at construction, and after the start-up profile, whose steps are no
        traffic. What the controller learnt of step costs stays."""
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_drafts = 0  # verifications that carried at least one draft
        self.propose_s = 0.0  # time spent proposing and choosing (s)

    def propose(
        self,
        running: Sequence[Request],
        spec_of: Callable[[Request], tuple[SpecRequest | None, SamplingParams]],
        max_model_len: int,
    ) -> None:
        """Set `spec_token_ids` of every running request for the coming step: n-gram drafts for
        those that decode, as many as `choose` finds worth verifying. A run emits up to
        drafts + 1 tokens, so drafts stay within `max_tokens` and `max_model_len`.

        Adaptive speculation drafts only in pure decode steps, none while a running request
        prefills: drafts count against the step's token budget before prompts' chunks do, so
        there a draft worth 0.7 tokens displaced a prompt token and delayed a whole request's
        start, in steps the `YieldGuard` never measured. (A prompt still waiting for admission
        does not stop drafting: the scheduler may not admit it for long, for want of seats, KV
        blocks or the batch cap, and drafts would stop for as long.)"""
        started = time.perf_counter()
        k = self.config.num_speculative_tokens
        chosen: list[tuple[Request, np.ndarray, RequestSpecStats]] = []
        decoding = [r for r in running if _decoding(r)]  # prefilling: nothing to draft from yet
        for req in running:
            req.spec_token_ids = []
        pure = len(decoding) == len(running)
        self._step_rows = len(decoding) if pure else 0
        if self.config.adaptive and decoding and not (pure and self.guard.allow(len(decoding))):
            self.propose_s += time.perf_counter() - started
            return  # prompts to prefill, or drafts measured slower here (`YieldGuard`)
        for req in decoding:
            spec, params = spec_of(req)
            if spec is None:
                continue  # not speculated (structured outputs)
            n_out = req.num_output_tokens
            limit = min(k, params.max_tokens - n_out - 1, max_model_len - req.num_tokens)
            if limit >= 1:
                drafts = self.proposer.propose(spec.history.view(), limit)
                if len(drafts):
                    chosen.append((req, drafts, spec.stats))
        if chosen:
            lengths = self.choose(
                [d for _, d, _ in chosen], [s for _, _, s in chosen], len(running)
            )
            for (req, drafts, _), n in zip(chosen, lengths, strict=True):
                req.spec_token_ids = drafts[:n].tolist()
        self.propose_s += time.perf_counter() - started

    def record(self, runs: Sequence[tuple[Request, SpecRequest, int, int]]) -> dict[str, int]:
        """Account verified runs `(request, its spec state, drafts, accepted)`; returns the
        rejected drafts per request id (`Scheduler.update_after_step`)."""
        rejected: dict[str, int] = {}
        for req, spec, drafted, accepted in runs:
            rejected[req.request_id] = drafted - accepted
            req.num_spec_draft_tokens += drafted
            req.num_spec_accepted_tokens += accepted
            req.num_spec_drafts += 1
            self.num_draft_tokens += drafted
            self.num_accepted_tokens += accepted
            self.num_drafts += 1
            spec.stats.observe(drafted, accepted)
        return rejected

    def observe_wall(
        self, num_scheduled: int, num_tokens: int, num_drafts: int, num_emitted: int,
        step_ms: float,
    ) -> None:  # fmt: skip
        """One whole step after `propose` (proposing to its outputs, ms): requests scheduled,
        tokens computed, drafts verified, tokens emitted (accepted drafts plus one per row that
        did not fail). Only a pure decode step of the requests `propose` saw decoding counts for
        the `YieldGuard`."""
        rows = self._step_rows
        if rows and num_scheduled == rows and num_tokens == rows + num_drafts:
            self.guard.observe(rows, num_drafts > 0, num_emitted, step_ms)

    def observe_step(self, num_tokens: int, step_ms: float) -> None:
        """Record one executed step: tokens it computed and its forward + sampling time (ms)."""
        d = self._DECAY
        x, y = float(num_tokens), float(step_ms)
        self._sw = d * self._sw + 1.0
        self._sx = d * self._sx + x
        self._sy = d * self._sy + y
        self._sxx = d * self._sxx + x * x
        self._sxy = d * self._sxy + x * y
        if 0 < num_tokens <= self.TABLE_TOKENS:
            n, w = num_tokens, self._TABLE_WEIGHT
            seen = self._table_n[n] > 0
            self._table_ms[n] = (1 - w) * self._table_ms[n] + w * y if seen else y
            self._table_n[n] += 1

    def step_ms(self, num_tokens: np.ndarray) -> np.ndarray:
        """Predicted ms of steps of `num_tokens` tokens: the measured mean of that count where it
        has `TABLE_MIN_SAMPLES` steps, else the fitted line (`step_cost`; a step was measured)."""
        cost = self.step_cost()
        assert cost is not None, "no step measured yet"
        a, b = cost
        line = a + b * num_tokens.astype(np.float64)
        small = np.minimum(num_tokens, self.TABLE_TOKENS)
        measured = (num_tokens <= self.TABLE_TOKENS) & (
            self._table_n[small] >= self.TABLE_MIN_SAMPLES
        )
        return np.where(measured, self._table_ms[small], line)

    def step_cost(self) -> tuple[float, float] | None:
        """(a ms, b ms per token) of the fitted model, or None before any step was measured."""
        if self._sw <= 0.0:
            return None
        mx, my = self._sx / self._sw, self._sy / self._sw
        var = self._sxx / self._sw - mx * mx
        if var > 1.0:  # token counts varied by more than about one token
            b = (self._sxy / self._sw - mx * my) / var
            a = my - b * mx
            if b > 0.0 and a > 0.0:
                return a, b
        a = my / (1.0 + mx / 16.0)
        return a, a / 16.0

    def choose(
        self, proposals: Sequence[np.ndarray], stats: Sequence[RequestSpecStats], num_rows: int
    ) -> list[int]:
        """Draft tokens to send per proposal (a prefix length of each).

        Args:
            proposals: per decoding request, its proposed drafts (may be empty).
            stats: the same requests' figures (acceptance).
            num_rows: tokens the step computes without drafts (its decodes, at least).
        """
        lengths = [len(p) for p in proposals]
        if not self.config.adaptive:
            return lengths
        if self.step_cost() is None:
            return lengths  # the first step explores: it also measures
        gains: list[tuple[float, int]] = []  # (P(draft accepted with all before it), request)
        for i, n in enumerate(lengths):
            alpha = stats[i].acceptance
            g = 1.0
            for _ in range(n):
                g *= alpha
                gains.append((g, i))
        gains.sort(key=lambda t: -t[0])
        chosen = [0] * len(lengths)
        self._choices += 1
        if self._choices % self.EXPLORE_EVERY == 0:
            i = (self._choices // self.EXPLORE_EVERY) % len(lengths)
            chosen[i] = lengths[i]
            gains = [(g, j) for g, j in gains if j != i]
        # tokens per ms with the best D drafts added, for every D (D = 0: none more)
        yields = float(len(proposals)) + np.concatenate(([0.0], np.cumsum([g for g, _ in gains])))
        totals = max(num_rows, 1) + sum(chosen) + np.arange(len(gains) + 1)
        best = int(np.argmax(yields / self.step_ms(totals)))  # the first of equals: fewest
        for _, i in gains[:best]:
            chosen[i] += 1
        return chosen


def _decoding(req: Request) -> bool:
    """The request decodes this step (it has output and only its last token to compute)."""
    return req.num_output_tokens > 0 and req.num_computed_tokens == req.num_tokens - 1


def spec_totals(controller: SpecController | None) -> dict[str, float | int]:
    """Engine-wide figures (0 without speculation): `spec_draft_tokens`, `spec_accepted_tokens`,
    `spec_num_drafts` (verifications with drafts; vLLM's mean acceptance length is
    1 + accepted / num_drafts) and `spec_propose_ms` (proposer + controller time, ms)."""
    c = controller
    return {
        "spec_draft_tokens": c.num_draft_tokens if c else 0,
        "spec_accepted_tokens": c.num_accepted_tokens if c else 0,
        "spec_num_drafts": c.num_drafts if c else 0,
        "spec_propose_ms": round(c.propose_s * 1000.0, 3) if c else 0.0,
    }


def verify_rows(drafts: Sequence[int], output_token_ids: Sequence[int]) -> list[Sequence[int]]:
    """The output history of each of the d + 1 verification rows of one request: row j sees
    `output_token_ids + drafts[:j]` (what the request would have output before sampling it)."""
    if not drafts:
        return [output_token_ids]
    out = list(output_token_ids)
    return [out] + [out + list(drafts[:j]) for j in range(1, len(drafts) + 1)]


def num_accepted(row_tokens: Sequence[int], drafts: Sequence[int]) -> int:
    """Drafts accepted: the longest prefix where row j's sampled token equals draft j.
    The request then emits `row_tokens[: num_accepted + 1]`."""
    n = 0
    for tok, draft in zip(row_tokens, drafts, strict=False):  # row_tokens has one more
        if tok != draft:
            break
        n += 1
    return n


class VerifiedRun(NamedTuple):
    """What one request emits after verification: its accepted drafts then one sampled token
    (`num_accepted + 1` ids), with their logprob entries (None where not requested)."""

    token_ids: list[int]
    logprobs: list[dict | None]
    num_accepted: int


def verify(
    sampler: Sampler,
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
    drafts: Sequence[Sequence[int]],
    grammar_mask: GrammarMask | None = None,
) -> list[VerifiedRun]:
    """Verify the drafts of R requests in one `sampler` call (see the module docstring).

    Args:
        logits: `[sum(1 + len(drafts[i])), V]`; request i owns `1 + len(drafts[i])` consecutive
            rows, row j being the logits after its last token and drafts 1..j.
        params, generators, prompt_token_ids, output_token_ids: per request, as `Sampler` takes
            them (output ids before this step).
        drafts: per request, its draft token ids (may be empty: then it samples one token).
        grammar_mask: structured outputs' allowed tokens, its rows indexing the logits rows
            (only requests without drafts are constrained).

    Returns:
        One `VerifiedRun` per request. A seeded sampled request's generator ends advanced by one
        uniform per emitted token, exactly as `num_accepted + 1` steps without drafts leave it.
    """
    row_params, row_gens, row_prompts, row_outputs = [], [], [], []
    for i, d in enumerate(drafts):
        rows = verify_rows(d, output_token_ids[i])
        row_params += [params[i]] * len(rows)
        row_gens += [generators[i]] * len(rows)
        row_prompts += [prompt_token_ids[i]] * len(rows)
        row_outputs += rows
    rewind = [
        None if g is None or p.greedy or not d else g.get_state()
        for p, g, d in zip(params, generators, drafts, strict=True)
    ]
    result = sampler(logits, row_params, row_gens, row_prompts, row_outputs, grammar_mask)
    runs: list[VerifiedRun] = []
    start = 0
    for i, d in enumerate(drafts):
        tokens = result.token_ids[start : start + 1 + len(d)]
        n = num_accepted(tokens, d)
        if rewind[i] is not None:  # one uniform per emitted token, as without drafts
            generators[i].set_state(rewind[i])
            for _ in range(n + 1):
                torch.rand(1, dtype=torch.float64, generator=generators[i])
        runs.append(VerifiedRun(tokens[: n + 1], result.logprobs[start : start + n + 1], n))
        start += 1 + len(d)
    return runs
