"""Batched token sampler: penalties, temperature, top-k, top-p, seeded sampling, logprobs.

One call turns the logits of every request that emits a token this step into one token id each.
Order of operations per row (the order vLLM and HF `generate` use):

1. `min_tokens`: while a row has fewer output tokens than `min_tokens`, its EOS ids (unless
   `ignore_eos`) and `stop_token_ids` get logit -inf.
2. penalties: repetition (over prompt + output tokens), then frequency and presence (over output
   tokens only, OpenAI formula `logit - count * frequency_penalty - (count > 0) * presence_penalty`).
3. greedy rows (temperature < 1e-5): exact `torch.argmax` of the penalised logits (ties -> lowest id).
4. other rows: divide by temperature, keep top-k, keep top-p (nucleus), softmax, draw one token with
   `torch.multinomial`, from the row's own `torch.Generator` when the request has a seed, so the
   draw depends only on (seed, number of tokens drawn before, logits) and not on the batch.

Logprobs are the *raw* model distribution: `log_softmax` of the logits as passed in (before
penalties, temperature, top-k/top-p and the min_tokens mask) -- vLLM's default `logprobs_mode`
("raw_logprobs"). So the sampled token's logprob is what the model assigned to it, even when a
penalty or truncation steered the choice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gpu_worker.sampling_params import SamplingParams

__all__ = ["Sampler", "SamplerOutput"]


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
    ) -> SamplerOutput:
        """Sample one token per row.

        Args:
            logits: `[B, V]`, any float dtype, any device; not modified (the sampler works on an
                fp32 copy).
            params: B sampling parameter sets.
            generators: B entries; a `torch.Generator` for seeded requests (the caller creates it
                once per request with `manual_seed(seed)` and keeps it across steps), else None
                (the global RNG). A generator on another device than `logits` gets that row
                moved to its device for the draw.
            prompt_token_ids: B prompt token lists (repetition penalty).
            output_token_ids: B lists of tokens generated so far (penalties, min_tokens).

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
        logits = self.process_logits(logits, params, prompt_token_ids, output_token_ids)

        token_ids = torch.argmax(logits, dim=-1)  # [B]; final for greedy rows
        sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
        if sampled_rows:
            rows = torch.tensor(sampled_rows, device=logits.device)
            probs = _probs(logits[rows], [params[i] for i in sampled_rows])  # [S, V]
            chosen = _draw(probs, [generators[i] for i in sampled_rows])  # [S]
            token_ids[rows] = chosen.to(token_ids.device)

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
        out = logits.float().clone()  # [B, V]
        self._mask_min_tokens(out, params, output_token_ids)
        _apply_penalties(out, params, prompt_token_ids, output_token_ids)
        return out

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
    """In place on the rows whose params have a penalty; builds `[P, V]` count tensors for them."""
    rows = [i for i, p in enumerate(params) if p.has_penalties]
    if not rows:
        return
    device, vocab = logits.device, logits.shape[1]
    output_counts = _token_counts([output_token_ids[i] for i in rows], vocab, device)  # [P, V]
    prompt_counts = _token_counts([prompt_token_ids[i] for i in rows], vocab, device)  # [P, V]
    rep = torch.tensor([params[i].repetition_penalty for i in rows], device=device)[:, None]
    freq = torch.tensor([params[i].frequency_penalty for i in rows], device=device)[:, None]
    pres = torch.tensor([params[i].presence_penalty for i in rows], device=device)[:, None]
    index = torch.tensor(rows, device=device)

    sub = logits[index]  # [P, V]
    seen = (output_counts > 0) | (prompt_counts > 0)
    penalised = torch.where(sub > 0, sub / rep, sub * rep)
    sub = torch.where(seen, penalised, sub)
    sub = sub - freq * output_counts - pres * (output_counts > 0).float()
    logits[index] = sub


def _token_counts(token_lists: list[Sequence[int]], vocab: int, device) -> torch.Tensor:
    """`[len(token_lists), vocab]` float32 occurrence counts (ids >= vocab are ignored)."""
    counts = torch.zeros(len(token_lists), vocab, dtype=torch.float32, device=device)
    for row, tokens in enumerate(token_lists):
        if len(tokens) == 0:
            continue
        ids = torch.tensor(list(tokens), dtype=torch.long, device=device)
        ids = ids[(ids >= 0) & (ids < vocab)]
        counts[row].index_add_(0, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts


def _probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k, top-p, softmax. `logits` `[S, V]` fp32 -> probs `[S, V]` fp32."""
    device, vocab = logits.device, logits.shape[1]
    temps = torch.tensor([p.temperature for p in params], device=device)[:, None]
    logits = logits / temps
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_p = [p.top_p for p in params]
    if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
        logits = _top_k_top_p(logits, top_k, top_p)
    return torch.softmax(logits, dim=-1)


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Set logits outside each row's top-k and nucleus (top-p) to -inf.

    Exactly k tokens survive top-k (ties at the k-th value broken by sort order). Top-p keeps the
    smallest prefix of the descending-sorted distribution (after top-k) whose probability mass
    reaches p; the most likely token always survives (HF `TopPLogitsWarper` semantics).
    """
    device = logits.device
    sorted_logits, sorted_idx = torch.sort(logits, dim=-1, descending=True)  # [S, V]
    ranks = torch.arange(logits.shape[1], device=device)[None, :]  # [1, V]
    k = torch.tensor(top_k, device=device)[:, None]  # [S, 1]
    sorted_logits = sorted_logits.masked_fill(ranks >= k, float("-inf"))
    # p = 1 means off: use inf so fp32 rounding of the cumsum near 1.0 never drops a tail token.
    p = torch.tensor([q if q < 1.0 else float("inf") for q in top_p], device=device)[:, None]
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = (
        torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    )  # mass of strictly better tokens
    sorted_logits = sorted_logits.masked_fill(mass_before >= p, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(1, sorted_idx, sorted_logits)


def _draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One `torch.multinomial` draw per row; seeded rows draw alone from their own generator."""
    out = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        idx = torch.tensor(unseeded, device=probs.device)
        out[idx] = torch.multinomial(probs[idx], 1).squeeze(1)
    for i, gen in enumerate(generators):
        if gen is None:
            continue
        row = probs[i].to(gen.device)
        out[i] = torch.multinomial(row, 1, generator=gen).to(probs.device)[0]
    return out


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
