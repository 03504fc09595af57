"""Tokenizer loading without torch, and the one rule that turns a prompt into token ids.

Every process that counts prompt tokens -- the HTTP gateway, the jobs runner and the engine --
builds prompt ids with :func:`prompt_ids`, so an over-length prompt is caught at the edge with
exactly the count the engine will see (DESIGN.md "Edge validation"). The rule (vLLM's, and
DESIGN.md "Offline engine"):

- text: ``tokenizer(text)``, i.e. the tokenizer's own special tokens added (a BOS where the
  post-processor of the model's ``tokenizer.json`` adds one, which is what ``transformers``'
  fast tokenizers follow);
- chat: the model's chat template rendered with ``add_generation_prompt=True``, then encoded
  with no special tokens added (the template writes its own BOS), as
  ``transformers``' ``apply_chat_template(..., tokenize=True)`` does;
- token ids: used as given.

:class:`PromptTokenizer` wraps a ``tokenizers.Tokenizer`` (Rust, no torch) and the chat
template. The API process and the jobs runner load it from files with :meth:`PromptTokenizer.load`
(``tokenizer.json`` + ``tokenizer_config.json`` of a Hugging Face directory, or of the converted
cache ``<stem>.hf/`` next to a ``.gguf``); importing ``transformers`` would import torch, and
reading a GGUF's tokenizer would mean converting it. The engine wraps the tokenizer it already
holds with :meth:`PromptTokenizer.from_hf`.

The chat template is rendered the way ``transformers.utils.chat_template_utils`` renders it:
a sandboxed Jinja environment with ``trim_blocks``, ``lstrip_blocks`` and ``loopcontrols``, the
``raise_exception``/``strftime_now`` globals and a non-escaping ``tojson``, the special tokens
(``bos_token``, ``eos_token``, ...) as variables, and message keys whose value is None dropped.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                      "mask_token")  # fmt: skip
MAX_TOKEN_TEXT_CACHE = 65536  # token id -> text entries kept for logprobs


class TokenizerError(ValueError):
    """The tokenizer files cannot be found or read (the message says what to run)."""


class PromptError(ValueError):
    """A prompt the rule cannot encode (the chat template refused the conversation)."""


def tokenizer_dir(path: str | Path) -> Path:
    """The directory holding the tokenizer files of a model path.

    A ``.gguf`` file's tokenizer lives in its converted cache ``<stem>.hf/`` (written by the
    worker's first load, ``laneserve model pull`` or ``laneserve up``); a directory is its own.
    """
    path = Path(path).expanduser()
    if path.is_file() or path.suffix == ".gguf":
        return path.with_name(path.stem + ".hf")
    return path


@dataclass(slots=True)
class PromptTokenizer:
    """A torch-free tokenizer with the model's chat template.

    ``tokenizer``: a ``tokenizers.Tokenizer``; ``chat_template``: Jinja source or None (chat
    prompts then fail with :class:`PromptError`); ``special_tokens``: template variables such as
    ``bos_token``; ``max_model_len``/``vocab_size``: tokens, from ``config.json`` when known.
    """

    tokenizer: Any
    chat_template: str | None = None
    special_tokens: dict[str, str] = field(default_factory=dict)
    max_model_len: int | None = None
    vocab_size: int | None = None
    _token_text: dict[int, str] = field(default_factory=dict)

    @classmethod
    def load(cls, path: str | Path) -> PromptTokenizer:
        """Load from a Hugging Face directory or a ``.gguf`` file's converted cache.

        Raises:
            TokenizerError: no ``tokenizer.json`` there (for a ``.gguf``: says how to create
                the cache), or unreadable files.
        """
        from tokenizers import Tokenizer

        source = Path(path).expanduser()
        directory = tokenizer_dir(source)
        file = directory / TOKENIZER_FILE
        if not file.is_file():
            if source.suffix == ".gguf":
                raise TokenizerError(
                    f"{source}: its converted tokenizer {file} does not exist; convert the GGUF "
                    "once with `laneserve model pull` (the bundled model) or by loading it in a "
                    f"worker (`laneserve worker --model {source}`), which writes {directory}/"
                )
            raise TokenizerError(f"{directory}: no {TOKENIZER_FILE} (a Hugging Face tokenizer)")
        try:
            tokenizer = Tokenizer.from_file(str(file))
            config = _read_json(directory / CONFIG_FILE)
            model_config = _read_json(directory / "config.json")
        except (OSError, ValueError, Exception) as exc:  # tokenizers raises bare Exception
            raise TokenizerError(f"{directory}: cannot read the tokenizer files: {exc}") from exc
        template = config.get("chat_template")
        if (directory / TEMPLATE_FILE).is_file():
            template = (directory / TEMPLATE_FILE).read_text()
        specials = {k: _token_str(config[k]) for k in SPECIAL_TOKEN_KEYS if config.get(k)}
        max_len = model_config.get("max_position_embeddings")
        vocab = model_config.get("vocab_size")
        return cls(
            tokenizer,
            chat_template=template if isinstance(template, str) else None,
            special_tokens=specials,
            max_model_len=max_len if isinstance(max_len, int) and max_len > 0 else None,
            vocab_size=vocab if isinstance(vocab, int) and vocab > 0 else None,
        )

    @classmethod
    def from_hf(cls, hf_tokenizer: Any) -> PromptTokenizer:
        """Wrap a loaded ``transformers`` fast tokenizer (its backend ``tokenizers.Tokenizer``,
        chat template and special tokens), for the engine that holds one already."""
        specials = {
            k: str(v)
            for k, v in (getattr(hf_tokenizer, "special_tokens_map", None) or {}).items()
            if k in SPECIAL_TOKEN_KEYS and v
        }
        return cls(
            hf_tokenizer.backend_tokenizer,
            chat_template=getattr(hf_tokenizer, "chat_template", None),
            special_tokens=specials,
            vocab_size=len(hf_tokenizer),
        )

    # ------------------------------------------------------------------ the rule

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; special tokens written in the text are parsed as such."""
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def render_chat(self, messages: Sequence[dict], tools: Sequence[dict] | None = None) -> str:
        """The chat template applied to ``messages`` with the generation prompt; ``tools``
        (OpenAI function tools) passed to the template as transformers passes them.

        Raises:
            PromptError: no chat template, or the template refused the conversation.
        """
        if not self.chat_template:
            raise PromptError("this model has no chat template; use /v1/completions")
        chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
        try:
            return _compile(self.chat_template).render(
                messages=chat,
                tools=list(tools) if tools else None,
                documents=None,
                add_generation_prompt=True,
                **self.special_tokens,
            )
        except Exception as exc:  # jinja raises on conversations the template refuses
            raise PromptError(f"the chat template rejected the messages: {exc}") from exc

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """The text of one token, special tokens included (for logprobs); cached."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self.decode([token_id], skip_special_tokens=False)
            if len(self._token_text) < MAX_TOKEN_TEXT_CACHE:
                self._token_text[token_id] = text
        return text


def prompt_ids(
    tokenizer: PromptTokenizer,
    *,
    prompt: str | None = None,
    messages: Sequence[dict] | None = None,
    token_ids: Sequence[int] | None = None,
) -> list[int]:
    """The ids the engine feeds the model for a prompt given in exactly one form (module
    docstring). Raises PromptError when the chat template refuses ``messages``."""
    assert sum(x is not None for x in (prompt, messages, token_ids)) == 1, "one prompt form"
    if token_ids is not None:
        return list(token_ids)
    if messages is not None:
        return tokenizer.encode(tokenizer.render_chat(messages), add_special_tokens=False)
    return tokenizer.encode(prompt, add_special_tokens=True)


# ---------------------------------------------------------------------------- internals


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    value = json.loads(path.read_text())
    return value if isinstance(value, dict) else {}


def _token_str(value: Any) -> str:
    """A special token from ``tokenizer_config.json``: a string or an AddedToken dict."""
    return value.get("content", "") if isinstance(value, dict) else str(value)


@lru_cache(maxsize=8)
def _compile(template: str) -> Any:
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:  # fmt: skip
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)
