"""The offline `LLM`'s view of prompt logprobs (vLLM's `Logprob`). What an engine step hands to
its driver is `contracts.engine_io.EngineOutput`."""

from __future__ import annotations

from dataclasses import dataclass


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
    """The engine's `EngineOutput.prompt_logprobs` entries as vLLM's shape: per position None
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
