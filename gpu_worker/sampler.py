"""Batched token sampler: penalties, temperature, top-k, top-p, seeded sampling, logprobs.

One call turns the logits of every request that emits a token this step into one token id each.
Order of operations per row (the order vLLM and HF `generate` use):

0. structured outputs: tokens a row's grammar forbids get logit -inf (gpu_worker/structured_output.py).
1. `min_tokens`: while a row has fewer output tokens than `min_tokens`, its EOS ids (unless
   `ignore_eos`) and `stop_token_ids` get logit -inf.
2. penalties: repetition (over prompt + output tokens), then frequency and presence (over output
   tokens only, OpenAI formula `logit - count * frequency_penalty - (count > 0) * presence_penalty`).
   `logit_bias` is added right after the min_tokens mask; `min_p` filters after temperature.
3. greedy rows (temperature < 1e-5): exact `torch.argmax` of the penalised logits (ties -> lowest id).
4. other rows: divide by temperature, keep top-k, keep top-p (nucleus), softmax, draw one token by
   inverse-CDF sampling over the kept tokens in vocabulary order (never in rank order, which
   near-tied logits reshuffle under float rounding) with one uniform number per row (float64
   cumsum + `searchsorted`), taken from the row's own `torch.Generator` when the request has a
   seed.

Batch independence (DESIGN "Sampling contract"): a row's token is a function of its own logits,
its own parameters and its own generator only. Each sampled row takes the path its parameters
choose -- plain (softmax in vocabulary order), top-k with its own k, or top-p only (the best
`TOP_P_CANDIDATES`, or the whole sorted row when its nucleus is wider) -- and never a path or a
candidate count chosen by another row of the batch; rows on the same path with the same shape are
vectorised together (every operation is row-wise). So a seeded request gives the same tokens
alone or beside any other requests.

Speed (CPU matters here): no full-vocabulary sort in the common cases. Truncated rows work on
`torch.topk` candidates: exactly `top_k` of them, or for top-p-only rows the best
`TOP_P_CANDIDATES` tokens, which is exact whenever their probability mass reaches `top_p`; rows
where it does not (very flat distributions) fall back to the whole sorted vocabulary. One uniform
per row instead of V exponentials/multinomial work keeps sampling O(V) with a small constant, and an
all-greedy batch without penalties is a single `argmax` on the input dtype (bf16 -> fp32 is exact,
so the argmax is the same).

Logprobs are the *raw* model distribution: `log_softmax` of the logits as passed in (before
penalties, temperature, top-k/top-p and the min_tokens mask) -- vLLM's default `logprobs_mode`
("raw_logprobs"). So the sampled token's logprob is what the model assigned to it, even when a
penalty or truncation steered the choice.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from laneserve.gpu_worker.sampling_params import SamplingParams
from laneserve.gpu_worker.structured_output import GrammarMask, apply_token_bitmask

__all__ = ["Sampler", "SamplerOutput", "make_generator"]


def make_generator(seed: int | None, device: str | torch.device = "cpu") -> torch.Generator | None:
    """The per-request generator for `SamplingParams.seed` (None when unseeded).

    Create it once when the request is added and pass it to every `Sampler` call for that request
    (also after a preemption: recompute does not redraw tokens already produced). A CPU generator
    works with logits on any device and keeps seeded outputs identical across CPU and GPU runs of
    the same logits.
    """
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed(seed)


@dataclass(slots=True)
class SamplerOutput:
    """Result of one sampling step, row-aligned with the input batch.

    Attributes:
        token_ids: the chosen token id per row.
        logprobs: per row None (logprobs not requested) or
            `{"token_id": int, "logprob": float, "top": [(token_id, logprob), ...]}` with the top-n
            entries sorted by logprob, highest first (n = `SamplingParams.logprobs`, may be 0).
    """

    token_ids: list[int]
    logprobs: list[dict | None]


class Sampler:
    """Turns logits into tokens for a batch of requests with mixed sampling parameters.

    Args:
        eos_token_ids: the model's end-of-sequence ids (e.g. `tokenizer.eos_token_id` and the
            generation config's extra EOS ids). Only used to mask EOS while a request has fewer
            than `min_tokens` output tokens; stopping on EOS is the engine's job.
    """

    def __init__(self, eos_token_ids: Sequence[int] = ()) -> None:
        self.eos_token_ids = [int(t) for t in eos_token_ids]

    def __call__(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        grammar_mask: GrammarMask | None = None,
    ) -> SamplerOutput:
        """Sample one token per row.

        Args:
            logits: `[B, V]`, any float dtype, any device; not modified (the sampler works on an
                fp32 copy).
            params: B sampling parameter sets.
            generators: B entries; a `torch.Generator` for seeded requests (the caller creates it
                once per request with `manual_seed(seed)` and keeps it across steps; one float64
                uniform is drawn from it per sampled token), else None (the global RNG). Any
                device (a CPU generator is fine for CUDA logits).
            prompt_token_ids: B prompt token lists (repetition penalty).
            output_token_ids: B lists of tokens generated so far (penalties, min_tokens).
            grammar_mask: the tokens structured-output rows may take
                (`gpu_worker.structured_output`); forbidden ones get -inf before everything
                else (raw logprobs excepted). None: no row is constrained.

        Returns:
            `SamplerOutput` with B token ids and B logprob entries.

        Raises:
            ValueError: the per-row lists do not have B entries, or logits are not 2-D.
        """
        if logits.dim() != 2:
            raise ValueError(f"logits must be [B, V], got shape {tuple(logits.shape)}")
        batch = logits.shape[0]
        for name, seq in (
            ("params", params),
            ("generators", generators),
            ("prompt_token_ids", prompt_token_ids),
            ("output_token_ids", output_token_ids),
        ):
            if len(seq) != batch:
                raise ValueError(f"{name} has {len(seq)} entries, logits have {batch} rows")
        if batch == 0:
            return SamplerOutput([], [])

        raw_logprobs = None
        if any(p.logprobs is not None for p in params):
            raw_logprobs = torch.log_softmax(logits.float(), dim=-1)  # [B, V]
        if grammar_mask is not None:
            logits = apply_token_bitmask(logits, grammar_mask)  # fp32 copy, masked rows
        if self._plain_greedy(params, output_token_ids):
            token_ids = torch.argmax(logits, dim=-1)  # [B], no copy of the logits
            logprobs = [None] * batch
            if raw_logprobs is not None:
                logprobs = _gather_logprobs(raw_logprobs, token_ids, params)
            return SamplerOutput(token_ids.tolist(), logprobs)
        logits = self.process_logits(logits, params, prompt_token_ids, output_token_ids)

        token_ids = torch.argmax(logits, dim=-1)  # [B]; final for greedy rows
        sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
        for group, weights, cand_ids in _candidate_groups(logits, params, sampled_rows):
            pos = _inverse_cdf(weights, [generators[i] for i in group])  # [G]
            chosen = pos if cand_ids is None else cand_ids.gather(1, pos[:, None]).squeeze(1)
            token_ids[torch.tensor(group, device=logits.device)] = chosen

        token_list = token_ids.tolist()
        logprobs: list[dict | None] = [None] * batch
        if raw_logprobs is not None:
            logprobs = _gather_logprobs(raw_logprobs, token_ids, params)
        return SamplerOutput(token_list, logprobs)

    def process_logits(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
    ) -> torch.Tensor:
        """The min_tokens mask and the penalties: `[B, V]` logits -> new `[B, V]` fp32 logits.

        Greedy rows take the argmax of this; sampled rows then apply temperature, top-k, top-p.
        The input is not modified.
        """
        # [B, V], row-major whatever the input's strides (the penalties index it flat)
        out = logits.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
        self._mask_min_tokens(out, params, output_token_ids)
        _apply_logit_bias(out, params)
        _apply_penalties(out, params, prompt_token_ids, output_token_ids)
        return out

    def sampling_probs(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
    ) -> torch.Tensor:
        """The distribution each row is drawn from: `[B, V]` fp32, rows sum to 1.

        Greedy rows are one-hot at the argmax. Same code path as `__call__` (for tests/debugging).
        """
        logits = self.process_logits(logits, params, prompt_token_ids, output_token_ids)
        probs = torch.zeros_like(logits)
        for i, p in enumerate(params):
            if p.greedy:
                probs[i, torch.argmax(logits[i])] = 1.0
        sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
        for group, weights, cand_ids in _candidate_groups(logits, params, sampled_rows):
            weights = weights / weights.sum(dim=-1, keepdim=True)
            rows = torch.tensor(group, device=logits.device)
            if cand_ids is None:
                probs[rows] = weights
            else:
                probs[rows] = probs[rows].scatter_(1, cand_ids, weights)
        return probs

    def _plain_greedy(
        self, params: Sequence[SamplingParams], output_token_ids: Sequence[Sequence[int]]
    ) -> bool:
        """All rows greedy, no penalties, no min_tokens mask active: the argmax needs no copy."""
        return all(
            p.greedy and not p.has_penalties and not p.has_logit_bias and len(out) >= p.min_tokens
            for p, out in zip(params, output_token_ids, strict=True)
        )

    def _mask_min_tokens(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        output_token_ids: Sequence[Sequence[int]],
    ) -> None:
        vocab = logits.shape[1]
        for i, p in enumerate(params):
            if len(output_token_ids[i]) >= p.min_tokens:
                continue
            stop_ids = list(p.stop_token_ids)
            if not p.ignore_eos:
                stop_ids += self.eos_token_ids
            stop_ids = [t for t in stop_ids if t < vocab]
            if stop_ids:
                logits[i, stop_ids] = float("-inf")


def _apply_penalties(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
) -> None:
    """In place on the rows whose params have a penalty, at the tokens each row has seen (its
    prompt and output ids) only: a gather and a scatter of those entries, not passes over
    `[P, V]` count tensors (a batch of 64 rows with 300-token prompts: ~1 ms instead of ~70).
    `logits` is contiguous (the sampler's float32 copy). The same float32 arithmetic per entry
    as dense tensors would do: repetition over prompt + output, then frequency and presence
    over the output's counts."""
    rows = [i for i, p in enumerate(params) if p.has_penalties]
    if not rows:
        return
    vocab = logits.shape[1]
    outputs = [list(output_token_ids[i]) for i in rows]
    seen = [[*prompt_token_ids[i], *out] for i, out in zip(rows, outputs, strict=True)]
    keys = torch.unique(_row_keys(seen, rows, vocab))  # sorted `row * vocab + id`
    out_keys, out_counts = torch.unique(_row_keys(outputs, rows, vocab), return_counts=True)
    counts = torch.zeros(len(keys), dtype=torch.float32)
    counts[torch.searchsorted(keys, out_keys)] = out_counts.to(torch.float32)
    which = keys // vocab  # each entry's row
    rep = torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32)[which]
    freq = torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32)[which]
    pres = torch.tensor([p.presence_penalty for p in params], dtype=torch.float32)[which]
    device = logits.device
    keys, counts = keys.to(device), counts.to(device)
    rep, freq, pres = rep.to(device), freq.to(device), pres.to(device)
    flat = logits.view(-1)
    values = flat[keys]
    values = torch.where(values > 0, values / rep, values * rep)
    flat[keys] = values - freq * counts - pres * (counts > 0).to(torch.float32)


def _row_keys(token_lists: list[list[int]], rows: list[int], vocab: int) -> torch.Tensor:
    """`row * vocab + id` (int64, CPU) of every id in `token_lists[j]` (row `rows[j]`); ids
    outside `[0, vocab)` are left out."""
    ids = torch.tensor(list(itertools.chain.from_iterable(token_lists)), dtype=torch.int64)
    lengths = torch.tensor([len(t) for t in token_lists], dtype=torch.int64)
    row_of = torch.repeat_interleave(torch.tensor(rows, dtype=torch.int64), lengths)
    valid = (ids >= 0) & (ids < vocab)
    return (row_of * vocab + ids)[valid]


def _apply_logit_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    """In place: add each row's OpenAI `logit_bias` ({token_id: bias}; ids >= vocab ignored)."""
    vocab = logits.shape[1]
    for i, p in enumerate(params):
        if not p.logit_bias:
            continue
        ids = [t for t in p.logit_bias if t < vocab]
        if ids:
            bias = torch.tensor([p.logit_bias[t] for t in ids], device=logits.device)
            logits[i, ids] += bias


def _apply_min_p(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """`[S, V]` temperature-scaled logits with tokens below `min_p * max prob` set to -inf (rows
    whose `min_p` is 0 untouched; vLLM applies min_p after temperature, as here)."""
    rows = [i for i, p in enumerate(params) if p.min_p > 0.0]
    if not rows:
        return logits
    index = torch.tensor(rows, device=logits.device)
    min_p = torch.tensor([params[i].min_p for i in rows], device=logits.device)[:, None]
    sub = logits[index]  # [R, V]
    probs = torch.softmax(sub, dim=-1)
    keep = probs >= min_p * probs.max(dim=-1, keepdim=True).values
    logits = logits.clone()
    logits[index] = sub.masked_fill(~keep, float("-inf"))
    return logits


# Top-p-only rows look for their nucleus among this many best tokens first (exact when the nucleus
# fits; SmolLM2/Llama distributions at top_p <= 0.95 almost always do), else sort the whole row.
TOP_P_CANDIDATES = 1024


def _path(p: SamplingParams, vocab: int) -> tuple[str, int]:
    """The sampling path of one row, from its own parameters only: ("all", 0) for a softmax over
    the whole vocabulary in vocabulary order, ("top_k", k) for its own k (top-p applies inside),
    ("top_p", 0) for top-p alone."""
    if 0 < p.top_k < vocab:
        return ("top_k", p.top_k)
    if p.top_p < 1.0:
        return ("top_p", 0)
    return ("all", 0)


def _candidate_groups(
    logits: torch.Tensor, params: Sequence[SamplingParams], rows: list[int]
) -> list[tuple[list[int], torch.Tensor, torch.Tensor | None]]:
    """Temperature, top-k, top-p for the sampled `rows` of `[B, V]` fp32 logits, by path.

    Rows are grouped by `_path` (each row's own parameters) and every group is computed with
    row-wise operations only, so a row's result does not depend on the other rows.

    Returns (row indices into `logits`, weights `[G, K]` >= 0, not normalised, at least one > 0
    per row, candidate token ids `[G, K]` in ascending order, or None when K = V) per group.
    Top-k keeps exactly k tokens (ties at the k-th value broken by `torch.topk` order); top-p
    keeps the smallest prefix of the descending distribution (after top-k) whose mass reaches
    p, always including the top token (HF `TopPLogitsWarper` semantics).
    """
    device, vocab = logits.device, logits.shape[1]
    paths: dict[tuple[str, int], list[int]] = {}
    for i in rows:
        paths.setdefault(_path(params[i], vocab), []).append(i)
    groups: list[tuple[list[int], torch.Tensor, torch.Tensor | None]] = []
    for (kind, k), group in paths.items():
        temps = torch.tensor([params[i].temperature for i in group], device=device)[:, None]
        scaled = logits[torch.tensor(group, device=device)] / temps  # [G, V]
        scaled = _apply_min_p(scaled, [params[i] for i in group])
        if kind == "all":
            groups.append((group, torch.softmax(scaled, dim=-1), None))
            continue
        top_p = [params[i].top_p for i in group]
        num = k if kind == "top_k" else min(vocab, TOP_P_CANDIDATES)
        weights, ids, complete = _truncate(scaled, [k] * len(group), top_p, num)
        done = complete.tolist()
        kept = [j for j, ok in enumerate(done) if ok]
        redo = [j for j, ok in enumerate(done) if not ok]
        if not redo:
            groups.append((group, *_vocab_order(weights, ids)))
            continue
        if kept:
            sel = torch.tensor(kept, device=device)
            groups.append(([group[j] for j in kept], *_vocab_order(weights[sel], ids[sel])))
        # a nucleus wider than the candidates: those rows sort their whole vocabulary
        sel = torch.tensor(redo, device=device)
        full_w, full_ids, _ = _truncate(
            scaled[sel], [0] * len(redo), [top_p[j] for j in redo], vocab
        )
        vocab_w = torch.zeros_like(full_w).scatter_(1, full_ids, full_w)
        groups.append(([group[j] for j in redo], vocab_w, None))
    return groups


def _vocab_order(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidates `[G, K]` re-ordered by ascending token id.

    The kept set is chosen by rank, but the draw walks it in vocabulary order: near-tied logits
    (a flat distribution over a large vocabulary has many) swap ranks under rounding noise of the
    forward pass (float32 matmuls of other shapes, another chunking), and a draw by rank would
    then pick the neighbour; in vocabulary order it picks the same token unless the noise moves
    a cdf boundary across the uniform or a token across the top-k/top-p cutoff.
    """
    ids, order = torch.sort(ids, dim=-1)
    return weights.gather(1, order), ids


def _truncate(
    logits: torch.Tensor, top_k: list[int], top_p: list[float], num: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k / top-p over the best `num` candidates of each row of `[S, V]` scaled logits.

    Returns (weights `[S, num]`, ids `[S, num]`, complete `[S]` bool: False where a top-p-only row
    did not reach its mass p inside the candidates, so its result is not exact).
    """
    device = logits.device
    vals, ids = torch.topk(logits, num, dim=-1)  # [S, num], descending
    ranks = torch.arange(num, device=device)[None, :]  # [1, num]
    k = torch.tensor([kk if kk > 0 else num for kk in top_k], device=device)[:, None]  # [S, 1]
    vals = vals.masked_fill(ranks >= k, float("-inf"))
    # probabilities: renormalised over the top-k set, or the true ones (full-row logsumexp)
    has_k = torch.tensor([kk > 0 for kk in top_k], device=device)[:, None]  # [S, 1]
    lse = torch.where(
        has_k,
        torch.logsumexp(vals, dim=-1, keepdim=True),
        torch.logsumexp(logits, dim=-1, keepdim=True),
    )
    probs = torch.exp(vals - lse)  # [S, num]
    cum = torch.cumsum(probs, dim=-1)
    # p = 1 means off: use inf so fp32 rounding of the cumsum near 1.0 never drops a tail token.
    p = torch.tensor([q if q < 1.0 else float("inf") for q in top_p], device=device)[:, None]
    probs = probs.masked_fill(cum - probs >= p, 0.0)  # mass of strictly better tokens >= p
    complete = has_k.squeeze(1) | (cum[:, -1] >= p.squeeze(1)) | (num == logits.shape[1])
    return probs, ids, complete


def _inverse_cdf(weights: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """Draw one index per row of `[S, K]` non-negative weights: `[S]` int64 positions.

    Inverse-CDF sampling with a float64 cumsum and one uniform in [0, 1) per row, from the row's
    generator when it has one (drawn on the generator's device, then moved). Zero-weight entries
    are never chosen.
    """
    rows, device = weights.shape[0], weights.device
    cdf = torch.cumsum(weights.double(), dim=-1)  # [S, K]
    u = torch.empty(rows, dtype=torch.float64, device=device)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        u[torch.tensor(unseeded, device=device)] = torch.rand(
            len(unseeded), dtype=torch.float64, device=device
        )
    seeded = [i for i, g in enumerate(generators) if g is not None]
    if seeded:  # one draw per generator (the engine's are CPU ones), then one copy for all rows
        draws = [
            torch.rand(1, dtype=torch.float64, device=generators[i].device, generator=generators[i])
            for i in seeded
        ]
        u[torch.tensor(seeded, device=device)] = torch.cat([d.cpu() for d in draws]).to(device)
    target = (u * cdf[:, -1])[:, None]  # [S, 1]
    pos = torch.searchsorted(cdf, target, right=True).clamp_(max=weights.shape[1] - 1)
    # step back over zero-weight entries (flat cdf): the first index reaching this cdf value
    pos = torch.searchsorted(cdf, cdf.gather(1, pos), right=False)
    return pos.squeeze(1)


def _gather_logprobs(
    raw_logprobs: torch.Tensor, token_ids: torch.Tensor, params: Sequence[SamplingParams]
) -> list[dict | None]:
    """Chosen-token logprob and top-n per row from the raw `[B, V]` log-softmax."""
    max_n = max(p.logprobs or 0 for p in params)
    chosen = raw_logprobs.gather(1, token_ids[:, None]).squeeze(1).tolist()  # [B]
    top_vals: list[list[float]] = [[] for _ in params]
    top_ids: list[list[int]] = [[] for _ in params]
    if max_n > 0:
        vals, ids = torch.topk(raw_logprobs, max_n, dim=-1)  # [B, max_n], sorted descending
        top_vals, top_ids = vals.tolist(), ids.tolist()
    ids_list = token_ids.tolist()
    out: list[dict | None] = []
    for i, p in enumerate(params):
        if p.logprobs is None:
            out.append(None)
            continue
        n = p.logprobs
        top = list(zip(top_ids[i][:n], top_vals[i][:n], strict=True))
        out.append({"token_id": ids_list[i], "logprob": chosen[i], "top": top})
    return out
