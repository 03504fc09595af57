"""Prompt templates of the task shorthand (`--task summarize|translate|extract`) and the
map-reduce split of documents longer than the context.

`extract` asks for the fields of a JSON schema (the task option `schema`, its JSON text) and
constrains the answer to that schema (`response_format` json_schema), so every completed line's
`message.parsed` is an object that validates.

Each task line `{"id": ..., "text": ...}` becomes a chat request (system + user message); the
worker applies the model's chat template. Summaries use greedy decoding so reruns agree.

Map-reduce summarization (as in LangChain's "map_reduce" summarize chain): a document whose
prompt does not fit is split by tokens into pieces that do, each piece is summarized (map), and
the joined summaries are summarized again (reduce), repeating while the joined summaries still
do not fit.
"""

from __future__ import annotations

import json

from laneserve.contracts.openai.errors import OpenAIError
from laneserve.contracts.openai.structured import parse_structured
from laneserve.jobs.errors import InvalidRequestError
from laneserve.jobs.limits import DEFAULT_TASK_MAX_TOKENS

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
EXTRACT_SYSTEM = "You extract information from documents and answer with JSON only."
EXTRACT_USER = (
    "Read the document and return the fields of this JSON schema, taken from the document.\n"
    "Schema: {schema}\n\nDocument:\n{text}"
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
# The repetition guard of summarize and translate lines (vLLM's / HF's `repetition_penalty`,
# CTRL's form: logits of tokens already in the prompt or output are divided by it). Greedy
# decoding of a small model falls into loops ("Aufgabe:\n\nAufgabe:..."); measured on the demo's
# jobs (docs/benchmarks.md, "Repetition guard"). The task option `repetition_penalty` overrides it
# (1 turns it off); extract lines, held to their schema by a grammar, get none.
TASK_REPETITION_PENALTY = 1.1
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


def extract_format(schema_text: str) -> dict:
    """The `response_format` of an extract task: its schema, strict."""
    schema = json.loads(schema_text)
    return {
        "type": "json_schema",
        "json_schema": {"name": "fields", "schema": schema, "strict": True},
    }


def check_task_options(task: str | None, options: dict) -> None:
    """The options `task` cannot run without: an extract job's schema (`check_extract_schema`),
    a translate job's target language. Checked when a job is created and again when it is
    validated (a job stored before a check existed).

    Raises:
        InvalidRequestError: a missing or unusable option, its `param` naming it.
    """
    if task == "extract":
        check_extract_schema(options.get("schema"))
    if task == "translate" and not options.get("target_lang"):
        raise InvalidRequestError(
            "task 'translate' needs the task option 'target_lang'",
            param="task_options.target_lang",
        )
    penalty = options.get("repetition_penalty")
    if penalty is not None and not _positive_number(penalty):
        raise InvalidRequestError(
            f"task option repetition_penalty must be a number > 0, got {penalty!r}",
            param="task_options.repetition_penalty",
        )


def _positive_number(value: object) -> bool:
    try:
        number = float(value)  # type: ignore[arg-type]  # kept as a string in the job's metadata
    except (TypeError, ValueError):
        return False
    return 0.0 < number < float("inf")


def check_extract_schema(schema_text: str | None) -> None:
    """An extract job's schema option must be JSON text of a schema the grammar library enforces.

    Raises:
        InvalidRequestError: missing, not JSON, or refused (the message says why).
    """
    if schema_text is not None and not isinstance(schema_text, str):
        raise InvalidRequestError(
            "task option schema must be JSON schema text (a string), got "
            f"{type(schema_text).__name__}",
            param="task_options.schema",
        )
    if not schema_text:
        raise InvalidRequestError(
            "task 'extract' needs the task option 'schema' (JSON schema text)",
            param="task_options.schema",
        )
    try:
        parse_structured({"response_format": extract_format(schema_text)})
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(
            f"extract schema is not valid JSON: {exc}", param="task_options.schema"
        ) from None
    except OpenAIError as exc:
        raise InvalidRequestError(
            f"extract schema: {exc.message}", param="task_options.schema"
        ) from None


def task_body(task: str, text: str, model: str | None, options: dict[str, str]) -> dict:
    """The chat completion body for one task document (greedy, `max_tokens` from options; the
    repetition guard `TASK_REPETITION_PENALTY` on summarize and translate lines); for `embed`
    the /v1/embeddings body of the document."""
    if task == "embed":
        return {"input": text, "model": model} if model else {"input": text}
    max_tokens = int(options.get("max_tokens") or DEFAULT_TASK_MAX_TOKENS)
    extra: dict = {}
    if task == "summarize":
        messages = summarize_messages(text)
    elif task == "extract":
        schema = options["schema"]
        user = EXTRACT_USER.format(schema=schema, text=text)
        messages = [
            {"role": "system", "content": EXTRACT_SYSTEM},
            {"role": "user", "content": user},
        ]
        extra["response_format"] = extract_format(schema)
    else:
        messages = translate_messages(text, options["target_lang"], options.get("source_lang"))
    if task != "extract":
        extra["repetition_penalty"] = float(
            options.get("repetition_penalty") or TASK_REPETITION_PENALTY
        )
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0.0, **extra}
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
