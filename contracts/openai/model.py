"""The served model as an edge sees it: its names, tokenizer and context length; prompt checks.

DESIGN.md "Edge validation": the gateway and the jobs runner count prompt tokens with the
model's tokenizer and the engine's rule (:func:`laneserve.contracts.tokens.prompt_ids`), so an over-length
prompt is a 400 (an error line in a batch) before any inference, and a stream's status is known
before its first byte. :meth:`ServedModel.check` settles ``max_tokens`` the same way for both.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from laneserve.contracts.openai.errors import OpenAIError, invalid, model_not_found
from laneserve.contracts.openai.requests import (
    DEFAULT_COMPLETIONS_MAX_TOKENS,
    Limits,
    ParsedRequest,
    Prompt,
)
from laneserve.contracts.openai.tool_parsers import parser_for_template
from laneserve.contracts.openai.tools import (
    ToolRequest,
    supports_tools,
    template_messages,
    uses_tools,
    with_fallback_prompt,
)
from laneserve.contracts.tokens import PromptError, PromptTokenizer, prompt_ids

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ServedModel:
    """``served_name``: the name clients send as ``model``; ``aliases``: further names served
    (the models the broker's workers report). ``tokenizer``: None when prompts are not counted
    at the edge. ``max_model_len`` / ``vocab_size``: tokens, None when unknown. ``created``:
    unix seconds, for ``/v1/models``. ``kv_pool``: the largest KV pool a live worker announced
    (``num_blocks``, ``block_size``, ``max_model_len``; :meth:`with_workers`), None when unknown: a
    sequence longer than it fits no worker even alone, so it is refused like one over
    ``max_model_len``."""

    served_name: str | None = None
    tokenizer: PromptTokenizer | None = None
    max_model_len: int | None = None
    vocab_size: int | None = None
    aliases: tuple[str, ...] = ()
    created: int = field(default_factory=lambda: int(time.time()))
    tool_call_parser: str | None = None
    kv_pool: dict | None = None

    @property
    def tool_parser(self) -> str:
        """The tool-call parser replies are read with: ``tool_call_parser`` (the
        ``--tool-call-parser`` flag) or the one the chat template implies."""
        template = self.tokenizer.chat_template if self.tokenizer is not None else None
        return self.tool_call_parser or parser_for_template(template)

    @classmethod
    def load(
        cls, path: str | Path, served_name: str | None, max_model_len: int | None = None
    ) -> ServedModel:
        """Load the tokenizer and context length of a resolved model path (a ``.gguf`` file
        with its converted cache, or a Hugging Face directory); ``max_model_len`` may only
        lower the model's own. Raises :class:`laneserve.contracts.tokens.TokenizerError`."""
        tokenizer = PromptTokenizer.load(path)
        max_len = tokenizer.max_model_len
        if max_model_len is not None:
            max_len = min(max_len or max_model_len, max_model_len)
        vocab = tokenizer.vocab_size or tokenizer.tokenizer.get_vocab_size(with_added_tokens=True)
        model = cls(served_name, tokenizer, max_len, vocab)
        logger.info("model %s: tokenizer loaded, max_model_len=%s", served_name, max_len)
        return model

    # ------------------------------------------------------------------ names

    def with_workers(self, workers: Iterable[dict]) -> ServedModel:
        """This model with the names the broker's workers report as ``aliases`` and the largest
        KV pool they announce (``info.kv_pool``) as ``kv_pool``."""
        names = {w.get("model") for w in workers} - {None, self.served_name}
        pool = largest_kv_pool(workers)
        return dataclasses.replace(self, aliases=tuple(sorted(names)), kv_pool=pool)

    def context_limit(self) -> tuple[int | None, str]:
        """The most tokens (prompt + output) one sequence may hold here, and what sets it:
        ``max_model_len``, or the largest worker's KV pool where that holds fewer."""
        limit = self.max_model_len
        what = f"this model's maximum context length is {limit} tokens"
        pool = _pool_tokens(self.kv_pool)
        if pool is not None and (limit is None or pool < limit):
            kv = self.kv_pool
            limit = pool
            what = (
                f"the largest worker takes at most {pool} tokens for one sequence (its KV "
                f"cache: {kv['num_blocks']} blocks x {kv['block_size']} tokens)"
            )
        return limit, what

    def check_name(self, model: str, also: Iterable[str] = ()) -> None:
        """Raises OpenAIError ``not_found`` (404) unless ``model`` is the served name, one of
        ``aliases`` or one of ``also``."""
        if model != self.served_name and model not in self.aliases and model not in set(also):
            raise model_not_found(model, (self.served_name or "",))

    # ------------------------------------------------------------------ counting

    def encode(self, prompt: Prompt) -> list[int] | None:
        """The prompt's ids as the engine will see them (chat template applied); None without
        a tokenizer unless the prompt is ids.

        Raises OpenAIError (400) when the chat template rejects the conversation."""
        if prompt.encoded is not None:  # encoded already
            return prompt.encoded
        if prompt.token_ids is not None:
            return prompt.token_ids
        if self.tokenizer is None:
            return None
        try:
            return prompt_ids(self.tokenizer, prompt=prompt.text, messages=prompt.messages)
        except PromptError as exc:
            raise invalid(str(exc), "messages") from exc

    def count(self, prompt: Prompt) -> int | None:
        """Prompt tokens as the engine will see them; None without a tokenizer.

        Raises OpenAIError (400) when the chat template rejects the conversation."""
        ids = self.encode(prompt)
        return None if ids is None else len(ids)

    def token_text(self, token_id: int) -> str:
        """The text of one token (for logprobs); ``token_id:N`` without a tokenizer (vLLM's
        ``return_tokens_as_token_ids`` form)."""
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.token_text(token_id)

    def prompt_text(self, prompt: Prompt) -> str:
        """The text ``echo`` prepends: the prompt as given, or its token ids decoded (special
        tokens kept); "" for token ids without a tokenizer or for chat messages."""
        if prompt.text is not None:
            return prompt.text
        if prompt.token_ids is not None and self.tokenizer is not None:
            return self.tokenizer.decode(prompt.token_ids, skip_special_tokens=False)
        return ""

    # ------------------------------------------------------------------ checks

    def check(self, req: ParsedRequest, limits: Limits) -> None:
        """Count every prompt and settle ``req.max_tokens`` (also into ``req.sampling``).

        Raises OpenAIError: ``prompt_too_long`` (400) when a prompt leaves no room for one
        output token, ``invalid_request`` (400) for an empty prompt, token ids outside the
        vocabulary, or prompt + max_tokens over ``max_model_len``.
        """
        longest = 0
        limit, what = self.context_limit()
        for prompt in req.prompts:
            self._check_ids(prompt)
            if prompt.messages is not None and (req.tools or uses_tools(prompt.messages)):
                text = self.tool_chat_text(req.tools, prompt.messages)
                prompt.encoded = self.tokenizer.encode(text)  # as prompt_ids encodes a chat
            else:  # tokenized once: the engine takes these ids
                prompt.encoded = self.encode(prompt)
            if prompt.encoded is None:
                continue
            prompt.num_tokens = len(prompt.encoded)
            if prompt.num_tokens == 0:
                raise invalid("the prompt is empty (0 tokens)", _param(req))
            if limit is not None and prompt.num_tokens >= limit:
                raise OpenAIError(
                    "prompt_too_long",
                    f"the prompt has {prompt.num_tokens} tokens; {what} "
                    "(prompt + at least 1 output token)",
                    param=_param(req),
                )
            longest = max(longest, prompt.num_tokens)
        room = None if limit is None else limit - longest
        if req.max_tokens is None:
            default = (
                DEFAULT_COMPLETIONS_MAX_TOKENS
                if req.kind == "completion"
                else limits.max_tokens_limit
            )
            req.max_tokens = min(default, room) if room is not None else default
        elif room is not None and req.max_tokens > room:
            raise invalid(
                f"max_tokens={req.max_tokens} plus the prompt's {longest} tokens is more than "
                f"{limit} tokens: {what}",
                "max_tokens",
            )
        bias = req.sampling.get("logit_bias") or ()
        bad = [t for t, _ in bias if self.vocab_size is not None and t >= self.vocab_size]
        if bad:
            raise invalid(
                f"logit_bias token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})",
                "logit_bias",
            )
        if req.sampling.get("min_tokens", 0) > req.max_tokens:
            raise invalid("'min_tokens' must be <= max_tokens", "min_tokens")
        req.sampling["max_tokens"] = req.max_tokens

    def tool_chat_text(self, tools: ToolRequest | None, messages: list[dict]) -> str:
        """A chat with tools (or tool messages) rendered by the chat template, here because the
        wire carries no tools: the template's own tool support, or the generic fallback
        (:mod:`laneserve.contracts.openai.tools`). ``tool_choice: "none"`` leaves tools out.

        Raises OpenAIError (400): no tokenizer at this edge, or the template refused."""
        if self.tokenizer is None:
            raise invalid(
                "tools and tool messages need the model's tokenizer at the gateway (start it "
                "with --model)",
                "tools" if tools else "messages",
            )
        shown = tools.tools if tools and tools.choice != "none" else ()
        native = supports_tools(self.tokenizer.chat_template)
        chat = template_messages(messages, native)
        if shown and not native:
            chat = with_fallback_prompt(chat, shown)
        try:
            return self.tokenizer.render_chat(chat, shown if native else None)
        except PromptError as exc:
            raise invalid(str(exc), "messages") from exc

    def _check_ids(self, prompt: Prompt) -> None:
        if prompt.token_ids is None or self.vocab_size is None:
            return
        bad = [t for t in prompt.token_ids if t >= self.vocab_size]
        if bad:
            raise invalid(
                f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})", "prompt"
            )


def largest_kv_pool(workers: Iterable[dict]) -> dict | None:
    """The announced KV pool (a worker's ``info.kv_pool``) that takes the longest sequence, None
    when no worker announces one."""
    pools = [p for w in workers if _pool_tokens(p := (w.get("info") or {}).get("kv_pool"))]
    return max(pools, key=_pool_tokens, default=None)


def _pool_tokens(pool: object) -> int | None:
    """The tokens one sequence may hold in an announced KV pool (its ``max_model_len``, at most
    ``num_blocks`` x ``block_size``), None when `pool` does not say."""
    if not isinstance(pool, dict):
        return None
    blocks, size, cap = pool.get("num_blocks"), pool.get("block_size"), pool.get("max_model_len")
    if not (isinstance(blocks, int) and isinstance(size, int) and blocks > 0 and size > 0):
        return None
    return min(blocks * size, cap) if isinstance(cap, int) and cap > 0 else blocks * size


def _param(req: ParsedRequest) -> str:
    return {"chat": "messages", "embedding": "input"}.get(req.kind, "prompt")
