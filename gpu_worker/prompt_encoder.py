"""`PromptEncoder`: the front end for prompts, before an `EngineRequest` is built. A prompt given
as text, chat messages or token ids becomes checked token ids, by the rule the gateway and the
jobs runner count with (`contracts.tokens.prompt_ids`). The worker runs it for a wire request that
carries text (a sender without a tokenizer), the offline `LLM` for its text prompts and chats; the
engine's `add` takes ids only and checks them (`check_ids`). Behind the edge a prompt arrives as
the ids the edge counted, so `num_prompts_tokenized` (prompts templated or tokenized here) stays
0 there.
"""

from __future__ import annotations

from typing import Any

from laneserve.contracts.tokens import PromptError, PromptTokenizer, prompt_ids
from laneserve.gpu_worker.errors import InvalidRequestError


class PromptEncoder:
    """Prompts to ids for a model with `vocab_size` embedding rows and its Hugging Face
    `tokenizer`. `token_id_limit`: ids a request may carry, the model's rows that the tokenizer
    can also decode."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.prompt_tokenizer = PromptTokenizer.from_hf(tokenizer)  # the edge's rule
        self.token_id_limit = min(vocab_size, len(tokenizer))
        self.num_prompts_tokenized = 0  # prompts given as text or messages (not ids)

    def encode(
        self,
        prompt: str | None = None,
        prompt_token_ids: list[int] | None = None,
        messages: list[dict] | None = None,
    ) -> list[int]:
        """Token ids of a prompt given as text, ids, or chat messages (chat template applied).

        Raises:
            InvalidRequestError: none or several given, empty prompt, ids outside
                `[0, token_id_limit)` (the model's vocabulary and the tokenizer's length, the
                smaller), or messages the chat template rejects.
        """
        given = [x is not None for x in (prompt, prompt_token_ids, messages)]
        if sum(given) != 1:
            raise InvalidRequestError("give exactly one of prompt, prompt_token_ids, messages")
        if prompt_token_ids is not None:
            return self.check_ids(prompt_token_ids)
        if messages is not None:
            ids = self.apply_chat_template(messages)
        elif not isinstance(prompt, str):
            raise InvalidRequestError("prompt must be a string")
        else:
            ids = prompt_ids(self.prompt_tokenizer, prompt=prompt)
        self.num_prompts_tokenized += 1
        return self.check_ids(ids)

    def check_ids(self, prompt_token_ids: list[int], name: str = "prompt_token_ids") -> list[int]:
        """The prompt's ids (or a resumed request's output ids, `name`) as a new list, checked
        (what the engine's `add` does with them).

        Raises:
            InvalidRequestError: no ids, or ids outside `[0, token_id_limit)`.
        """
        if not isinstance(prompt_token_ids, (list, tuple)):
            raise InvalidRequestError(f"{name} must be a list of ints")
        ids = list(prompt_token_ids)
        limit = self.token_id_limit
        bad = [t for t in ids if type(t) is not int or not 0 <= t < limit]
        if bad:
            raise InvalidRequestError(
                f"{name} must be ints in [0, {limit}) (the model has "
                f"{self.vocab_size} embedding rows, the tokenizer "
                f"{len(self.tokenizer)} tokens); got {bad[0]!r}"
            )
        if not ids:
            raise InvalidRequestError("prompt is empty (0 tokens)")
        return ids

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        """`tokenizer.apply_chat_template(messages, add_generation_prompt=True)` ids, no extra BOS
        (`contracts.tokens.prompt_ids`, the rule the gateway and jobs runner count with)."""
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise InvalidRequestError("messages must be a list of objects")
        try:
            return prompt_ids(self.prompt_tokenizer, messages=messages)
        except PromptError as exc:  # jinja errors on malformed conversations
            raise InvalidRequestError(f"chat template failed: {exc}") from exc
