"""Map-reduce summaries of documents longer than the context (the prompts and the split are
`jobs.prompts`').

`MapReducer` is an object `jobs.runner.JobsRunner` holds for its `map_reduce` lines. It is given
the served model (`counter`: tokenizer, `max_model_len`), `call` (one request through the batch
lane until a final answer: `(Final, None)` or `(None, error response)`) and `outcome` (the
runner's result line for a line's answers).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from laneserve.broker import protocol as p
from laneserve.contracts.openai import ServedModel
from laneserve.jobs import prompts, results, store

MAX_REDUCE_LEVELS = 6  # map-reduce levels before a document is given up

# call(request, model[, job_id, custom_id]) -> (Final, None) or (None, error response)
Call = Callable[..., Awaitable[tuple[p.Final | None, dict | None]]]
# outcome(info, line, final, error, extra) -> the line's result
MakeOutcome = Callable[
    [store.JobInfo, store.PendingLine, p.Final | None, dict | None, dict | None], store.Outcome
]


class MapReducer:
    """`summarize`: split by tokens, summarize the pieces, then the joined summaries."""

    def __init__(self, counter: ServedModel | None, call: Call, outcome: MakeOutcome) -> None:
        self.counter = counter
        self._call = call
        self._outcome = outcome

    async def summarize(self, info: store.JobInfo, line: store.PendingLine) -> store.Outcome:
        """Summarize a document longer than the context: split by tokens, summarize the pieces,
        then the joined summaries, until one piece remains (module docstring of jobs.prompts)."""
        assert self.counter is not None and self.counter.tokenizer is not None, "map-reduce lines"
        tokenizer = self.counter.tokenizer
        body = line.request["body"]
        max_tokens = body["max_tokens"]
        size = prompts.piece_tokens(self.counter.max_model_len, max_tokens)
        token_ids = await asyncio.to_thread(tokenizer.encode, line.request["map_reduce"]["text"])
        first_pieces, calls, document_tokens = 0, 0, len(token_ids)
        map_prompt, map_completion = 0, 0  # the map levels' tokens: the job's counts include them
        for level in range(MAX_REDUCE_LEVELS):
            pieces = prompts.split_tokens(token_ids, size)
            first_pieces = first_pieces or len(pieces)
            texts = [tokenizer.decode(piece) for piece in pieces]
            if len(pieces) == 1:
                model, (call,) = results.choice_requests(
                    line.rid,
                    {
                        "url": line.request["url"],
                        "body": {
                            **body,
                            "messages": prompts.summarize_messages(texts[0], reduce=level > 0),
                        },
                    },
                )
                final, error = await self._call(call, model, info.id, line.custom_id)
                extra = {
                    "map_reduce": {
                        "pieces": first_pieces,
                        "levels": level + 1,
                        "requests": calls + 1,
                        "document_tokens": document_tokens,
                        "map_prompt_tokens": map_prompt,
                        "map_completion_tokens": map_completion,
                    }
                }
                outcome = self._outcome(info, line, final, error, extra)
                if outcome.completion_tokens is not None:  # answered: count every call's tokens
                    outcome.prompt_tokens = (outcome.prompt_tokens or 0) + map_prompt or None
                    outcome.completion_tokens += map_completion
                return outcome
            coros = []
            for i, text in enumerate(texts):
                sub = {**body, "messages": prompts.summarize_messages(text, reduce=level > 0)}
                piece = {"url": line.request["url"], "body": sub}
                model, (call,) = results.choice_requests(f"mr_{line.rid}_{level}_{i}", piece)
                coros.append(self._call(call, model))
            answers = await asyncio.gather(*coros)
            calls += len(answers)
            for final, error in answers:
                if final is None:
                    return store.Outcome(info.id, line.rid, error)
                map_prompt += int(final.usage.get("prompt_tokens") or 0)
                map_completion += int(final.usage.get("completion_tokens") or 0)
            joined = "\n\n".join(final.text.strip() for final, _ in answers)
            token_ids = await asyncio.to_thread(tokenizer.encode, joined)
        return store.Outcome(
            info.id,
            line.rid,
            results.error_response(
                "prompt_too_long",
                f"document did not fit after {MAX_REDUCE_LEVELS} map-reduce levels",
            ),
        )
