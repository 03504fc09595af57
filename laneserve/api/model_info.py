"""The served model as the edge sees it: names, tokenizer, ``max_model_len``; prompt checks.

DESIGN.md "Edge validation": the gateway counts prompt tokens with the model's own tokenizer
(``gpu_worker.model_loader.load_tokenizer``) exactly as the engine will (``tokenizer(text)`` for
text, ``apply_chat_template(messages, add_generation_prompt=True)`` for chat), so an over-length
prompt is a 400 before any inference and a stream's status is known before its first byte.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from laneserve.api.config import DEFAULT_COMPLETIONS_MAX_TOKENS, ApiConfig
from laneserve.api.errors import ApiError, invalid
from laneserve.api.schemas import ParsedRequest, Prompt

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ModelInfo:
    """``served_name``: the name clients use. ``tokenizer``: a Hugging Face tokenizer or None.
    ``max_model_len`` / ``vocab_size``: tokens, None when unknown (no model given)."""

    served_name: str | None = None
    tokenizer: Any = None
    max_model_len: int | None = None
    vocab_size: int | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    _token_text: dict[int, str] = field(default_factory=dict)

    @classmethod
    def load(cls, config: ApiConfig) -> ModelInfo:
        """Load the tokenizer and config of ``config.model`` (blocking: seconds).

        Raises ModelLoadError when the model cannot be found or read."""
        if config.model is None:
            return cls(served_name=config.served_model_name, max_model_len=config.max_model_len)
        from gpu_worker.model_files import model_display_name, resolve_model_path
        from gpu_worker.model_loader import convert_gguf, load_tokenizer

        path = resolve_model_path(config.model)
        tokenizer = load_tokenizer(path)
        cfg_dir = convert_gguf(path) if path.is_file() else Path(path)
        hf = json.loads((cfg_dir / "config.json").read_text())
        max_len = int(hf.get("max_position_embeddings") or 0) or None
        if config.max_model_len is not None:
            max_len = min(max_len or config.max_model_len, config.max_model_len)
        info = cls(
            served_name=config.served_model_name or model_display_name(config.model),
            tokenizer=tokenizer,
            max_model_len=max_len,
            vocab_size=int(hf.get("vocab_size") or len(tokenizer)),
        )
        logger.info(
            "model %s: tokenizer loaded, max_model_len=%s", info.served_name, info.max_model_len
        )
        return info

    # ------------------------------------------------------------------ counting

    def count(self, prompt: Prompt) -> int | None:
        """Prompt tokens as the engine will see them; None without a tokenizer.

        Raises ApiError (400) when the chat template rejects the conversation."""
        if prompt.token_ids is not None:
            return len(prompt.token_ids)
        if self.tokenizer is None:
            return None
        if prompt.text is not None:
            return len(self.tokenizer(prompt.text)["input_ids"])
        try:
            out = self.tokenizer.apply_chat_template(
                prompt.messages, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        except Exception as exc:  # jinja raises on conversations the template refuses
            raise invalid(f"the chat template rejected the messages: {exc}", "messages") from exc
        if isinstance(out, dict):
            out = out["input_ids"]
        return len(out)

    def token_text(self, token_id: int) -> str:
        """The text of one token (for logprobs); ``token_id:N`` without a tokenizer (vLLM's
        ``return_tokens_as_token_ids`` form)."""
        text = self._token_text.get(token_id)
        if text is None:
            if self.tokenizer is None:
                text = f"token_id:{token_id}"
            else:
                text = self.tokenizer.decode([token_id])
            if len(self._token_text) < 65536:
                self._token_text[token_id] = text
        return text

    # ------------------------------------------------------------------ checks

    def check(self, req: ParsedRequest, config: ApiConfig) -> None:
        """Count every prompt and settle ``req.max_tokens`` (also into ``req.sampling``).

        Raises ApiError: ``prompt_too_long`` (400) when a prompt leaves no room for one output
        token, ``invalid_request`` (400) for an empty prompt, token ids outside the vocabulary,
        or prompt + max_tokens over ``max_model_len``.
        """
        longest = 0
        for prompt in req.prompts:
            if prompt.token_ids is not None and self.vocab_size is not None:
                bad = [t for t in prompt.token_ids if t >= self.vocab_size]
                if bad:
                    raise invalid(
                        f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})",
                        "prompt",
                    )
            prompt.num_tokens = self.count(prompt)
            if prompt.num_tokens is None:
                continue
            if prompt.num_tokens == 0:
                raise invalid("the prompt is empty (0 tokens)", _param(req))
            if self.max_model_len is not None and prompt.num_tokens >= self.max_model_len:
                raise ApiError(
                    "prompt_too_long",
                    f"the prompt has {prompt.num_tokens} tokens; this model's maximum context "
                    f"length is {self.max_model_len} tokens (prompt + at least 1 output token)",
                    param=_param(req),
                )
            longest = max(longest, prompt.num_tokens)
        room = None if self.max_model_len is None else self.max_model_len - longest
        if req.max_tokens is None:
            default = (
                DEFAULT_COMPLETIONS_MAX_TOKENS
                if req.kind == "completion"
                else config.max_tokens_limit
            )
            req.max_tokens = min(default, room) if room is not None else default
        elif room is not None and req.max_tokens > room:
            raise invalid(
                f"max_tokens={req.max_tokens} plus the prompt's {longest} tokens is more than "
                f"this model's maximum context length of {self.max_model_len} tokens",
                "max_tokens",
            )
        if req.sampling.get("min_tokens", 0) > req.max_tokens:
            raise invalid("'min_tokens' must be <= max_tokens", "min_tokens")
        req.sampling["max_tokens"] = req.max_tokens


def _param(req: ParsedRequest) -> str:
    return "messages" if req.kind == "chat" else "prompt"
