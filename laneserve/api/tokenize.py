"""``POST /tokenize``, ``POST /detokenize`` and ``GET /v1/models/{id}`` (vLLM's shapes).

``/tokenize`` takes ``{"prompt": str, "add_special_tokens": true}`` or ``{"messages": [...],
"add_generation_prompt": true, "add_special_tokens": false}`` (optional ``model``,
``return_token_strs``, and ``tools``, rendered as a chat completion renders them) and answers ``{"count", "max_model_len", "tokens", "token_strs"}``;
``/detokenize`` takes ``{"tokens": [int], "model"?}`` and answers ``{"prompt": str}``. Both use the
served model's tokenizer in the gateway (no engine round trip) and the engine's rule for chat
messages (:func:`laneserve.contracts.tokens.prompt_ids`), so ``count`` is what ``usage.prompt_tokens`` will
say. Errors: 400 naming the field, 404 for an unknown ``model``, 503 when the gateway holds no
tokenizer.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from laneserve.api.auth import read_json
from laneserve.api.errors import ApiError
from laneserve.api.state import GatewayState, model_objects
from laneserve.contracts.openai.checks import bool_field, type_name
from laneserve.contracts.openai.errors import invalid, model_not_found
from laneserve.contracts.openai.requests import MAX_TEXT_CHARS, parse_messages
from laneserve.contracts.openai.tools import parse_tools, uses_tools
from laneserve.contracts.tokens import PromptError, PromptTokenizer

TOKENIZE_FIELDS = frozenset(
    {
        "model",
        "prompt",
        "messages",
        "add_special_tokens",
        "add_generation_prompt",
        "return_token_strs",
        "tools",
    }
)
DETOKENIZE_FIELDS = frozenset({"model", "tokens"})
MAX_DETOKENIZE_IDS = 1_048_576


async def tokenize(request: Request) -> Response:
    state, body = await _read(request, TOKENIZE_FIELDS)
    tok = _tokenizer(state)
    prompt, messages = body.get("prompt"), body.get("messages")
    if (prompt is None) == (messages is None):
        raise invalid("give exactly one of 'prompt' and 'messages'", "prompt")
    if messages is not None:
        if bool_field(body, "add_generation_prompt") is False:
            raise invalid(
                "'add_generation_prompt': false is not supported", "add_generation_prompt"
            )
        special = bool(bool_field(body, "add_special_tokens"))  # vLLM's chat default: false
        chat, tools = parse_messages(messages), parse_tools({"tools": body.get("tools")})
        try:
            if tools or uses_tools(chat):  # rendered as a chat completion renders it
                text = state.model_info.tool_chat_text(tools, chat)
            else:
                text = tok.render_chat(chat)
        except PromptError as exc:
            raise invalid(str(exc), "messages") from exc
    else:
        if type(prompt) is not str or len(prompt) > MAX_TEXT_CHARS:
            raise invalid(f"'prompt' must be a string, got {type_name(prompt)}", "prompt")
        special = bool_field(body, "add_special_tokens") is not False  # vLLM's default: true
        text = prompt
    ids = tok.encode(text, add_special_tokens=special)
    strs = [tok.token_text(t) for t in ids] if bool_field(body, "return_token_strs") else None
    return JSONResponse(
        {
            "count": len(ids),
            "max_model_len": state.model_info.max_model_len,
            "tokens": ids,
            "token_strs": strs,
        }
    )


async def detokenize(request: Request) -> Response:
    state, body = await _read(request, DETOKENIZE_FIELDS)
    tok = _tokenizer(state)
    ids = body.get("tokens")
    vocab = state.model_info.vocab_size
    if (
        type(ids) is not list
        or len(ids) > MAX_DETOKENIZE_IDS
        or not all(type(t) is int and t >= 0 for t in ids)
    ):
        raise invalid("'tokens' must be an array of non-negative integers", "tokens")
    if vocab is not None and any(t >= vocab for t in ids):
        raise invalid(f"'tokens' holds an id outside the vocabulary [0, {vocab})", "tokens")
    return JSONResponse({"prompt": tok.decode(ids, skip_special_tokens=False)})


async def retrieve_model(request: Request) -> Response:
    """``GET /v1/models/{model_id}``: the model object ``/v1/models`` lists, or 404."""
    model_id = request.path_params["model_id"]
    for entry in await model_objects(request.app.state.gateway):
        if entry["id"] == model_id:
            return JSONResponse(entry)
    raise model_not_found(model_id)


async def _read(request: Request, allowed: frozenset[str]) -> tuple[GatewayState, dict]:
    state: GatewayState = request.app.state.gateway
    body = await read_json(request, state.config.max_body_bytes)
    if type(body) is not dict:
        raise invalid(f"the request body must be a JSON object, got {type_name(body)}")
    unknown = sorted(str(k) for k in body if k not in allowed)
    if unknown:
        raise invalid(f"unknown field(s): {', '.join(unknown[:10])}", unknown[0])
    model = body.get("model")
    if model is not None:
        if type(model) is not str:
            raise invalid("'model' must be a string", "model")
        await state.check_model(model)
    return state, body


def _tokenizer(state: GatewayState) -> PromptTokenizer:
    tok = state.model_info.tokenizer
    if tok is None:
        raise ApiError("no_worker", "this gateway has no tokenizer (started without --model)")
    return tok
