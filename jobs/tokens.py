"""Prompt token counting at the edge, with the served model's own tokenizer.

DESIGN.md "Edge validation": the jobs runner counts prompt tokens with the model's tokenizer so
an over-length prompt becomes an error line before any inference. Chat prompts are counted on
the model's chat template with the generation prompt (what the engine feeds the model:
`apply_chat_template(messages, add_generation_prompt=True)`), text prompts as the tokenizer
encodes them.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jobs.limits import DEFAULT_MAX_MODEL_LEN

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class PromptCounter:
    """Counts prompt tokens with a Hugging Face tokenizer (`transformers` tokenizer object).

    `max_model_len` is the model's context length in tokens (prompt + output).
    """

    tokenizer: Any
    max_model_len: int = DEFAULT_MAX_MODEL_LEN

    @classmethod
    def load(cls, model: str, max_model_len: int | None = None) -> PromptCounter:
        """The tokenizer of `model` (a bundled alias, a `.gguf` file or a HF directory) through
        `gpu_worker.model_loader.load_tokenizer`; `max_model_len` defaults to the model's
        `max_position_embeddings` (8192 for SmolLM2), and may only lower it.

        Raises:
            gpu_worker.errors.ModelLoadError: the model or its tokenizer cannot be found/loaded.
        """
        from gpu_worker.model_files import resolve_model_path
        from gpu_worker.model_loader import gguf_cache_dir, load_tokenizer

        path = resolve_model_path(model)
        tokenizer = load_tokenizer(path)
        config_dir = gguf_cache_dir(path) if path.is_file() else path
        model_len = _config_max_len(config_dir) or DEFAULT_MAX_MODEL_LEN
        if max_model_len is not None:
            model_len = min(model_len, max_model_len)
        return cls(tokenizer, model_len)

    def render_chat(self, messages: list[dict]) -> str:
        """The chat template applied to `messages`, with the generation prompt (a string)."""
        return self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )

    def count_chat(self, messages: list[dict]) -> int:
        """Prompt tokens of a chat request (template + generation prompt)."""
        return len(self.encode(self.render_chat(messages)))

    def count_text(self, prompt: str) -> int:
        """Prompt tokens of a completion prompt."""
        return len(self.encode(prompt))

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` with no special tokens added (those in the text are parsed)."""
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)


def _config_max_len(directory: Path) -> int | None:
    try:
        cfg = json.loads((directory / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    value = cfg.get("max_position_embeddings")
    return value if isinstance(value, int) and value > 0 else None
