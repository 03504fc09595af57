"""Prompt templates of the task shorthand (`--task summarize|translate`) and the map-reduce
split of documents longer than the context.

Each task line `{"id": ..., "text": ...}` becomes a chat request (system + user message); the
worker applies the model's chat template. Summaries use greedy decoding so reruns agree.

Map-reduce summarization (as in LangChain's "map_reduce" summarize chain): a document whose
prompt does not fit is split by tokens into pieces that do, each piece is summarized (map), and
the joined summaries are summarized again (reduce), repeating while the joined summaries still
do not fit.
"""

from __future__ import annotations

from jobs.limits import DEFAULT_TASK_MAX_TOKENS

SUMMARIZE_SYSTEM = "You are a helpful assistant that writes short, faithful summaries."
SUMMARIZE_USER = "Summarize the following text in a few sentences.\n\n{text}"
REDUCE_USER = (
    "The following are summaries of consecutive parts of one document. "
    "Combine them into one short summary of the whole document.\n\n{text}"
)
TRANSLATE_SYSTEM = "You are a professional translator."
TRANSLATE_USER = (
    "Translate the following text from {source} to {target}. "
    "Reply with the translation only.\n\n{text}"
)
# ISO 639-1 codes of common languages -> English names (unknown codes are used as given).
LANGUAGES = {
    "ar": "Arabic",
    "de": "German",
    "en": "English",
    "es": "Spanish",
    "fr": "French",
    "hi": "Hindi",
    "it": "Italian",
    "ja": "Japanese",
    "ko": "Korean",
    "nl": "Dutch",
    "pl": "Polish",
    "pt": "Portuguese",
    "ru": "Russian",
    "sv": "Swedish",
    "tr": "Turkish",
    "uk": "Ukrainian",
    "zh": "Chinese",
}
# Tokens kept free in every map-reduce prompt besides the output: template and instructions.
MAP_REDUCE_OVERHEAD_TOKENS = 96


def language_name(code: str) -> str:
    return LANGUAGES.get(code.lower(), code)


def summarize_messages(text: str, *, reduce: bool = False) -> list[dict]:
    user = (REDUCE_USER if reduce else SUMMARIZE_USER).format(text=text)
    return [{"role": "system", "content": SUMMARIZE_SYSTEM}, {"role": "user", "content": user}]


def translate_messages(text: str, target_lang: str, source_lang: str | None) -> list[dict]:
    source = language_name(source_lang) if source_lang else "its language"
    user = TRANSLATE_USER.format(source=source, target=language_name(target_lang), text=text)
    return [{"role": "system", "content": TRANSLATE_SYSTEM}, {"role": "user", "content": user}]


def task_body(task: str, text: str, model: str | None, options: dict[str, str]) -> dict:
    """The chat completion body for one task document (greedy, `max_tokens` from options)."""
    max_tokens = int(options.get("max_tokens") or DEFAULT_TASK_MAX_TOKENS)
    if task == "summarize":
        messages = summarize_messages(text)
    else:
        messages = translate_messages(text, options["target_lang"], options.get("source_lang"))
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0.0}
    if model:
        body["model"] = model
    return body


def piece_tokens(max_model_len: int, max_tokens: int) -> int:
    """Document tokens per map-reduce piece so that a piece's prompt + output fit the context."""
    return max(16, max_model_len - max_tokens - MAP_REDUCE_OVERHEAD_TOKENS)


def split_tokens(token_ids: list[int], size: int) -> list[list[int]]:
    """Consecutive pieces of at most `size` tokens (the last may be shorter)."""
    assert size > 0, size
    return [token_ids[i : i + size] for i in range(0, len(token_ids), size)]
