"""Embeddings: prefill-only requests (task "embed") pooled from the model's final hidden states.

An embed request is scheduled like any prompt (chunked prefill, lanes, preemption) but samples
nothing: the step that computes its last prompt token ends it, its KV blocks are freed at once,
and its final delta carries the vector. What the model hands back for it are the rows of the
final RMSNorm's output (Hugging Face's `last_hidden_state`), in fp32:

    LAST  the last prompt token's row (the only position that has read the whole prompt in a
          causal model); only the final chunk contributes one row
    MEAN  every prompt row, summed chunk by chunk into `RequestState.pooled`, divided by the
          prompt length at the end (a MEAN request never takes prefix-cache hits: each position
          must be computed once)

The pooled vector is L2-normalized (vLLM's `PoolerConfig(normalize=True)`, sentence-transformers'
`normalize_embeddings=True`) and sent as little-endian float32 bytes, which is also what the
OpenAI API's `encoding_format: "base64"` encodes.

Step layout (flattened varlen rows, `cu_seqlens_q`): request b owns rows `[cu[b], cu[b+1])`;
`hidden_indices` lists the rows whose hidden states come back, and `pooled[k] = (b, offset, n)`
says request b's rows are `hidden[offset : offset + n]`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["embedding_bytes", "gather_pooled", "hidden_rows", "pool_rows"]


def hidden_rows(
    cu: np.ndarray, samples: Sequence[bool], pooling: Sequence[str | None]
) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
    """The rows whose final hidden states a step returns, and each embed request's share.

    Args:
        cu: int `[B+1]`, the step's `cu_seqlens_q`.
        samples: per request, whether this step reaches its last prompt token.
        pooling: per request, "LAST" | "MEAN" for an embed request, None otherwise.

    Returns:
        (int64 `[M]` row indices, `[(b, offset, n)]` per embed request in this step).
    """
    rows: list[int] = []
    shares: list[tuple[int, int, int]] = []
    for b, mode in enumerate(pooling):
        if mode is None:
            continue
        lo, hi = int(cu[b]), int(cu[b + 1])
        mine = range(lo, hi) if mode == "MEAN" else range(hi - 1, hi) if samples[b] else ()
        shares.append((b, len(rows), len(mine)))
        rows.extend(mine)
    return np.asarray(rows, dtype=np.int64), shares


def pool_rows(
    pooled: torch.Tensor | None, hidden: torch.Tensor, mode: str, first_chunk: bool
) -> torch.Tensor | None:
    """One step's contribution to a request's pooled state.

    Args:
        pooled: the state so far (fp32 `[H]`), None before the first contribution.
        hidden: this step's rows of the request, fp32 `[n, H]` (n may be 0).
        mode: "LAST" or "MEAN".
        first_chunk: the step computes from position 0 (a new start after a preemption
            drops what was summed before).
    """
    if hidden.shape[0] == 0:
        return None if first_chunk else pooled
    if mode == "LAST":
        return hidden[-1].clone()
    total = hidden.sum(dim=0)
    return total if first_chunk or pooled is None else pooled + total


def embedding_bytes(pooled: torch.Tensor, mode: str, num_tokens: int) -> bytes:
    """The final vector of a request: mean (MEAN) then L2-normalized, as little-endian float32
    bytes (`hidden_size` x 4)."""
    vec = pooled / num_tokens if mode == "MEAN" else pooled
    vec = torch.nn.functional.normalize(vec.float(), dim=0)
    return vec.cpu().numpy().astype("<f4").tobytes()


def gather_pooled(entries: Sequence, shares: list[tuple[int, int, int]], hidden, states) -> list:
    """Fold one step's hidden rows (`hidden`, fp32 `[M, H]`) into each embed request's
    `RequestState.pooled`; returns the states whose prompt this step completed (in order).

    `entries`: the step's `ScheduledRequest` list; `shares`: `StepInputs.pooled`; `states`:
    the engine's request states by id."""
    done = []
    for b, offset, n in shares:
        entry = entries[b]
        state = states[entry.request.request_id]
        state.pooled = pool_rows(
            state.pooled,
            hidden[offset : offset + n],
            entry.request.pooling_type,
            entry.num_computed_tokens == 0,
        )
        if entry.samples:
            done.append(state)
    return done
