"""Prompt logprobs (`SamplingParams.prompt_logprobs`): which prompt positions a step computes that
a request still lacks logprobs for (`prompt_logprob_rows`: extra logits rows beside the sampled
ones, `flat_rows`), their entries from those logits (`record_prompt_logprobs`: the prompt token's
logprob and rank and the top-n), and the complete list put on the request's delta once
(`attach_prompt_logprobs`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from laneserve.contracts.engine_io import EngineOutput
from laneserve.gpu_worker.request_state import RequestState
from laneserve.gpu_worker.scheduler_output import ScheduledRequest


class PromptRows(NamedTuple):
    """Prompt positions [start, end) of one request computed this step, from flat row `row`."""

    state: RequestState
    row: int
    start: int
    end: int


def prompt_logprob_rows(
    entries: list[ScheduledRequest], states: dict[str, RequestState]
) -> list[PromptRows]:
    """The prompt positions still lacking logprobs that this step computes, per request of the
    step's `entries` (`states`: the engine's states by request id).

    Position p's logits give the logprob of prompt token p + 1, so a request needs positions
    [0, P - 1). Positions already recorded (before a preemption) are not asked for again.
    Requests without `prompt_logprobs` cost nothing.
    """
    out: list[PromptRows] = []
    offset = 0  # first flat row of each entry in the step's varlen batch
    for e in entries:
        if e.request.sampling_params.prompt_logprobs is None:  # the common case: no lookup
            offset += e.num_new_tokens
            continue
        state = states.get(e.request.request_id)
        if state is not None and state.prompt_logprobs is not None:
            start = max(e.num_computed_tokens, len(state.prompt_logprobs) - 1)
            end = min(e.num_computed_tokens + e.num_new_tokens, e.request.num_prompt_tokens - 1)
            if end > start:
                assert start == len(state.prompt_logprobs) - 1, (
                    f"{e.request.request_id}: prompt logprobs skip positions "
                    f"{len(state.prompt_logprobs) - 1}..{start}"
                )
                out.append(PromptRows(state, offset + start - e.num_computed_tokens, start, end))
        offset += e.num_new_tokens
    return out


def record_prompt_logprobs(rows: list[PromptRows], logits: torch.Tensor) -> None:
    """Append the entries of `rows` from their logits `[sum(end - start), V]` (fp32)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [R, V]
    targets = [t for r in rows for t in r.state.request.prompt_token_ids[r.start + 1 : r.end + 1]]
    target = torch.tensor(targets, dtype=torch.int64, device=logprobs.device)
    chosen = logprobs.gather(1, target[:, None])  # [R, 1]
    ranks = ((logprobs > chosen).sum(dim=1) + 1).tolist()
    chosen_list = chosen.squeeze(1).tolist()
    max_n = max(r.state.params.prompt_logprobs for r in rows)
    top_vals: list[list[float]] = [[] for _ in targets]
    top_ids: list[list[int]] = [[] for _ in targets]
    if max_n > 0:
        vals, ids = torch.topk(logprobs, max_n, dim=-1)
        top_vals, top_ids = vals.tolist(), ids.tolist()
    i = 0
    for r in rows:
        n = r.state.params.prompt_logprobs
        for _ in range(r.end - r.start):
            r.state.prompt_logprobs.append(
                {
                    "token_id": targets[i],
                    "logprob": chosen_list[i],
                    "rank": ranks[i],
                    "top": list(zip(top_ids[i][:n], top_vals[i][:n], strict=True)),
                }
            )
            i += 1


def flat_rows(rows: list[PromptRows], device: torch.device) -> torch.Tensor:
    """The varlen-batch row indices of `rows`, in order: `[sum(end - start)]` int64."""
    flat = [r.row + k for r in rows for k in range(r.end - r.start)]
    return torch.tensor(flat, dtype=torch.int64, device=device)


def attach_prompt_logprobs(state: RequestState, delta: EngineOutput) -> EngineOutput:
    """`delta` with a request's complete prompt logprobs, once (not again after a recompute)."""
    if state.prompt_logprobs is None or state.prompt_logprobs_sent:
        return delta
    assert len(state.prompt_logprobs) == state.request.num_prompt_tokens, (
        f"{state.request.request_id}: {len(state.prompt_logprobs)} prompt logprobs for "
        f"{state.request.num_prompt_tokens} prompt tokens"
    )
    state.prompt_logprobs_sent = True
    return delta._replace(prompt_logprobs=state.prompt_logprobs)
