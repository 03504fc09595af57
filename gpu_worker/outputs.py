"""What an engine step hands to its driver (torch-free, shared by `LLMEngine` and the synthetic
engine)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class RequestDelta:
    """What one step produced for one request (docs/interfaces.md).

    `new_token_ids` may be non-empty while `new_text` is "" (text held back: an incomplete UTF-8
    character or a possible stop string). `metrics` (the engine metrics dict, ms) is set on the
    final delta; `finish_reason` is "stop" | "length" | "abort" | "error" when `finished`.

    `prompt_logprobs` (only when `SamplingParams.prompt_logprobs` is set, on the request's first
    token delta, once): one entry per prompt position,
    `{"token_id", "logprob", "rank", "top": [(token_id, logprob), ...]}` -- the prompt token's
    raw log-softmax value, its 1-based rank in the distribution, and the top-n, best first;
    position 0 has `logprob` and `rank` None and no top (nothing predicts it).

    `embedding` (embed requests, on the final delta): the pooled, L2-normalized final hidden
    state as little-endian float32 bytes (`hidden_size` x 4 bytes).
    """

    request_id: str
    new_text: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    logprobs: list | None = None
    metrics: dict | None = None
    error: str | None = None
    prompt_logprobs: list | None = None
    embedding: bytes | None = None


@dataclass(slots=True)
class Logprob:
    """One token's entry in `RequestOutput.prompt_logprobs` (vLLM's `Logprob`).

    `logprob`: natural-log probability (raw model log-softmax, fp32); `rank`: 1-based rank in
    the distribution (1 = most likely); `decoded_token`: the token's text alone.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def prompt_logprob_dicts(entries: list | None, decode) -> list[dict[int, Logprob] | None] | None:
    """The engine's `RequestDelta.prompt_logprobs` entries as vLLM's shape: per position None
    (position 0, whose entry has no logprob) or `{token_id: Logprob}` holding the prompt token and the top-n (ranks 1..n).

    `decode(token_id) -> str` gives `decoded_token`.
    """
    if entries is None:
        return None
    out: list[dict[int, Logprob] | None] = []
    for e in entries:
        if e is None or e.get("logprob") is None:
            out.append(None)
            continue
        d = {
            int(tid): Logprob(float(lp), rank, decode(int(tid)))
            for rank, (tid, lp) in enumerate(e["top"], start=1)
        }
        tid = int(e["token_id"])
        d[tid] = Logprob(float(e["logprob"]), int(e["rank"]), decode(tid))
        out.append(d)
    return out
