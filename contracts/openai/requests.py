"""Request parsing and validation: a JSON body -> :class:`ParsedRequest`, or an :class:`OpenAIError`.

One implementation for the HTTP gateway (``/v1/chat/completions``, ``/v1/completions``) and for
bulk-job lines (the ``body`` of an OpenAI Batch line), so both accept the same bodies and answer
the same mistakes with the same messages.

Written by hand rather than as pydantic models so that every error is a 400 in OpenAI's shape
naming the offending field (pydantic would give FastAPI's 422), and so that unknown and
unsupported fields are told apart:

- a field laneserve does not implement (``functions``, ``suffix``, ...) -> 400 naming it; a no-op
  (``skip_special_tokens: true``, ``response_format`` of type ``text``, ``tool_choice: "none"``
  without tools) is accepted, any other value of it is a 400; tools:
  :mod:`laneserve.contracts.openai.tools`;
- a field no OpenAI-compatible server knows -> 400 naming it;
- ``null``, ``[]``, ``{}`` and ``false`` count as "not given" for optional fields.

Field names and ranges follow the OpenAI API reference (chat/completions, completions) and
vLLM's extra sampling fields (``top_k``, ``repetition_penalty``, ``ignore_eos``, ``min_tokens``,
``stop_token_ids``, ``include_stop_str_in_output``). Laneserve extras: ``lane`` ("interactive" |
"batch") and ``priority`` (int, lower is served first within a lane; or a lane name). OpenAI's
own ``service_tier`` picks the lane too: ``"flex"`` -> batch; ``"auto"``, ``"default"``,
``"priority"``, ``"scale"`` -> interactive (`SERVICE_TIER_LANES`).

The wire ``sampling_params`` keys are :data:`SAMPLING_KEYS` (the broker's ``SAMPLING_FIELDS``).
Prompt token counting needs the tokenizer and happens next (:mod:`laneserve.contracts.openai.lengths`);
``max_tokens`` stays None here when the body leaves it out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from laneserve.contracts.engine_io import EngineRequest, TextRequest
from laneserve.contracts.openai.checks import (
    MAX_TOKEN_ID,
    WIRE_INT_MAX,
    bool_field,
    given,
    int_field,
    num_field,
    stop_strings,
    token_ids,
    tolerated_no_ops,
    type_name,
)
from laneserve.contracts.openai.errors import invalid
from laneserve.contracts.openai.messages import (  # noqa: F401 (MAX_*, CHAT_ROLES: re-exported)
    CHAT_ROLES,
    MAX_MESSAGES,
    MAX_TEXT_CHARS,
    parse_messages,
)
from laneserve.contracts.openai.structured import parse_structured
from laneserve.contracts.openai.tools import ToolRequest, parse_tools

LANES = ("interactive", "batch")  # the wire protocol uses these (broker.protocol.LANES)
MAX_PROMPTS = 64  # prompts in one /v1/completions request (list of strings or token lists)
DEFAULT_MAX_N = 16  # choices per request; each is a separate engine request (fan-out)
DEFAULT_MAX_TOKENS_LIMIT = 4096  # cap on max_tokens / max_completion_tokens per choice
DEFAULT_COMPLETIONS_MAX_TOKENS = 16  # OpenAI's legacy /v1/completions default
CHAT_ENDPOINT = "/v1/chat/completions"
COMPLETIONS_ENDPOINT = "/v1/completions"

# The wire ``sampling_params`` keys, the one list (broker.protocol.SAMPLING_FIELDS is this set;
# gpu_worker.sampling_params.SamplingParams has a field for each).
SAMPLING_KEYS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "include_stop_str_in_output",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "logprobs",
    "min_tokens",
    "prompt_logprobs",
    "min_p",
    "logit_bias",
    "structured_outputs",
)


@dataclass(frozen=True, slots=True)
class Limits:
    """Per-request caps of the OpenAI surface (the gateway's flags; bulk-job lines use the
    same). ``max_n``: choices; ``max_tokens_limit``: tokens per choice."""

    max_n: int = DEFAULT_MAX_N
    max_tokens_limit: int = DEFAULT_MAX_TOKENS_LIMIT


# Fields that exist in the OpenAI API (or in vLLM's extensions) and that laneserve does not serve.
UNSUPPORTED_FIELDS = frozenset(
    {
        "functions",
        "function_call",
        "logit_bias",
        "audio",
        "modalities",
        "prediction",
        "web_search_options",
        "reasoning_effort",
        "verbosity",
        "min_p",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
        "suffix",
        "echo",
        "best_of",
        "use_beam_search",
        "length_penalty",
        "prompt_logprobs",
        "spaces_between_special_tokens",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template",
        "chat_template_kwargs",
    }
)
IGNORED_FIELDS = frozenset({"user", "metadata", "store", "safety_identifier", "prompt_cache_key"})
_COMMON = frozenset(
    {
        "model",
        "stream",
        "stream_options",
        "n",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "stop",
        "seed",
        "logprobs",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "ignore_eos",
        "min_tokens",
        "stop_token_ids",
        "include_stop_str_in_output",
        "lane",
        "priority",
        "service_tier",
        "min_p",
        "logit_bias",
        "response_format",
        "structured_outputs",
        "tool_choice",
        "skip_special_tokens",
    }
)
CHAT_FIELDS = _COMMON | {
    "messages",
    "max_completion_tokens",
    "top_logprobs",
    "tools",
    "parallel_tool_calls",
}
COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "prompt_logprobs"}
MAX_CHAT_TOP_LOGPROBS = 20  # OpenAI chat: top_logprobs 0..20
MAX_LEGACY_LOGPROBS = 5  # OpenAI legacy completions: logprobs <= 5
MAX_PROMPT_LOGPROBS = 20  # vLLM's prompt_logprobs cap (its max_logprobs default)
MAX_LOGIT_BIAS = 300  # OpenAI: at most 300 logit_bias entries
LOGIT_BIAS_RANGE = 100.0  # OpenAI: each bias in [-100, 100]


@dataclass(slots=True)
class Prompt:
    """One prompt in one of the three wire forms (exactly one of them is set).

    ``num_tokens``: prompt tokens counted at the edge (None until counted / no tokenizer).
    ``encoded``: the ids the engine feeds the model, templated (with the request's tools, if
    any) and tokenized once at the edge when it counted them (None: the engine tokenizes the
    given form; :meth:`ServedModel.check`).
    """

    text: str | None = None
    messages: list[dict] | None = None
    token_ids: list[int] | None = None
    num_tokens: int | None = None
    encoded: list[int] | None = None

    def wire(self) -> dict[str, Any]:
        """The one prompt argument to send on: the edge's ids when it has them, else the form
        given (``prompt``, ``messages`` or ``prompt_token_ids``)."""
        if self.encoded is not None:
            return {"prompt_token_ids": self.encoded}
        if self.messages is not None:
            return {"messages": self.messages}
        if self.token_ids is not None:
            return {"prompt_token_ids": self.token_ids}
        return {"prompt": self.text}


@dataclass(slots=True)
class ParsedRequest:
    """A validated /v1/chat/completions or /v1/completions body.

    ``sampling``: the wire ``sampling_params`` map (keys of ``broker.protocol.SAMPLING_FIELDS``)
    without ``max_tokens`` until lengths are checked; ``max_tokens``: per choice, None = default.
    ``logprobs``: top-n count (None: no logprobs). Choice index of prompt ``i``, sample ``j`` is
    ``i * n + j`` (vLLM's order).

    ``echo`` (/v1/completions): the prompt text is prepended to each choice's text, and with
    ``logprobs`` the prompt tokens' logprobs precede the generated ones (the first token's is
    null, as OpenAI sends it). ``echo_only``: ``echo`` with ``max_tokens=0`` -- the engine runs
    one token (vLLM does the same) that the response leaves out. ``prompt_logprobs``: vLLM's
    extension field, each choice then carries ``prompt_logprobs`` in vLLM's form.
    """

    kind: str  # "chat" | "completion" | "embedding" (contracts/openai/embeddings.py)
    model: str
    prompts: list[Prompt]
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    lane: str = "interactive"
    priority: int = 0
    max_tokens: int | None = None
    logprobs: int | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    echo: bool = False
    echo_only: bool = False
    prompt_logprobs: int | None = None
    tools: ToolRequest | None = None

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n

    def sampling_for(self, index: int) -> dict[str, Any]:
        """The wire ``sampling_params`` of choice ``index``: with a ``seed`` and ``n > 1``,
        sample ``j`` uses ``seed + j`` (distinct but reproducible samples)."""
        sampling = dict(self.sampling)
        if self.n > 1 and "seed" in sampling:
            seed = sampling["seed"] + index % self.n
            sampling["seed"] = seed - 2**64 if seed > WIRE_INT_MAX else seed  # stays a seed
        return sampling

    def engine_requests(
        self, request_id: str, lane: str | None = None
    ) -> list[EngineRequest | TextRequest]:
        """One request per choice ``k = prompt * n + sample`` (vLLM's order), the front end the
        gateway and the jobs runner share: request id ``request_id`` for ``k == 0`` and
        ``{request_id}-{k}`` after, :meth:`sampling_for` ``k``, this request's lane unless
        ``lane``. An :class:`EngineRequest` of the prompt's ids (encoded at the edge, or given),
        else (an edge without a tokenizer) a :class:`TextRequest` the worker tokenizes."""
        out: list[EngineRequest | TextRequest] = []
        for k, prompt in enumerate(p for p in self.prompts for _ in range(self.n)):
            common = {
                "request_id": request_id if k == 0 else f"{request_id}-{k}",
                "sampling_params": self.sampling_for(k),
                "lane": lane or self.lane,
                "priority": self.priority,
                "task": "embed" if self.kind == "embedding" else "generate",
            }
            wire = prompt.wire()
            text = "prompt_token_ids" not in wire
            out.append(TextRequest(**common, **wire) if text else EngineRequest(**common, **wire))
        return out


# ------------------------------------------------------------------------------- entry points


def parse_chat(body: Any, limits: Limits) -> ParsedRequest:
    """Validate a /v1/chat/completions body. Raises OpenAIError (400)."""
    body = _check_fields(body, CHAT_FIELDS)
    messages = parse_messages(body.get("messages"))
    tools = parse_tools(body)
    req = ParsedRequest(kind="chat", model=_model(body), prompts=[Prompt(messages=messages)])
    req.tools = tools
    _common(body, req, limits)
    max_completion = int_field(body, "max_completion_tokens", lo=1, hi=limits.max_tokens_limit)
    if max_completion is not None:
        req.max_tokens = max_completion
    want = bool_field(body, "logprobs")
    top = int_field(body, "top_logprobs", lo=0, hi=MAX_CHAT_TOP_LOGPROBS)
    if top is not None and not want:
        raise invalid("'top_logprobs' requires 'logprobs': true", "top_logprobs")
    if want:
        req.logprobs = top or 0
    _finish(body, req, limits)
    return req


def parse_completion(body: Any, limits: Limits) -> ParsedRequest:
    """Validate a /v1/completions body. Raises OpenAIError (400)."""
    body = _check_fields(body, COMPLETION_FIELDS)
    echo = bool(bool_field(body, "echo"))
    echo_only = echo and body.get("max_tokens") == 0 and type(body["max_tokens"]) is int
    if echo_only:  # the engine runs one token the response leaves out (vLLM's way)
        body = {**body, "max_tokens": 1}
    req = ParsedRequest(kind="completion", model=_model(body), prompts=_prompts(body.get("prompt")))
    req.echo, req.echo_only = echo, echo_only
    _common(body, req, limits)
    if body.get("logprobs") is True:
        raise invalid("'logprobs' of /v1/completions is an integer (0..5)", "logprobs")
    if body.get("logprobs") is not False:
        req.logprobs = int_field(body, "logprobs", lo=0, hi=MAX_LEGACY_LOGPROBS)
    req.prompt_logprobs = int_field(body, "prompt_logprobs", lo=0, hi=MAX_PROMPT_LOGPROBS)
    if echo and req.stream:
        raise invalid("'echo' is not supported with 'stream': true", "echo")
    if req.prompt_logprobs is not None and req.stream:
        raise invalid("'prompt_logprobs' is not supported with 'stream': true", "prompt_logprobs")
    _finish(body, req, limits)
    prompt_n = req.prompt_logprobs
    if echo and req.logprobs is not None:
        prompt_n = max(prompt_n or 0, req.logprobs)
    if prompt_n is not None:
        req.sampling["prompt_logprobs"] = prompt_n
    return req


def parse(endpoint: str, body: Any, limits: Limits) -> ParsedRequest:
    """Validate a body for ``endpoint`` (:data:`CHAT_ENDPOINT` or :data:`COMPLETIONS_ENDPOINT`).

    Raises:
        OpenAIError: 400 ``invalid_request`` naming the field.
        ValueError: an endpoint that is neither (a caller's bug).
    """
    if endpoint == CHAT_ENDPOINT:
        return parse_chat(body, limits)
    if endpoint == COMPLETIONS_ENDPOINT:
        return parse_completion(body, limits)
    raise ValueError(f"not an OpenAI completion endpoint: {endpoint!r}")


# ------------------------------------------------------------------------------- pieces


def _check_fields(body: Any, allowed: frozenset[str]) -> dict:
    if type(body) is not dict:
        raise invalid(f"the request body must be a JSON object, got {type_name(body)}")
    unsupported = sorted(
        k for k in body if k in UNSUPPORTED_FIELDS and given(body[k]) and k not in allowed
    )
    best_of = body.get("best_of")
    if "best_of" in unsupported and best_of in (1, body.get("n", 1)):
        unsupported.remove("best_of")
    if unsupported:
        raise invalid(
            f"unsupported field(s): {', '.join(unsupported)} (laneserve does not implement them)",
            unsupported[0],
        )
    unknown = sorted(
        str(k)
        for k in body
        if k not in allowed and k not in UNSUPPORTED_FIELDS and k not in IGNORED_FIELDS
    )
    if unknown:
        raise invalid(f"unknown field(s): {', '.join(unknown[:10])}", unknown[0])
    return body


def _model(body: dict) -> str:
    model = body.get("model")
    if type(model) is not str or not model:
        raise invalid("'model' is required and must be a non-empty string", "model")
    return model


def _prompts(v: Any, max_prompts: int = MAX_PROMPTS) -> list[Prompt]:
    """/v1/completions ``prompt``: a string, a list of strings, a list of token ids, or a list of
    lists of token ids (at most ``max_prompts``)."""
    if v is None:
        raise invalid("'prompt' is required", "prompt")
    if type(v) is str:
        items: list[Any] = [v]
    elif type(v) is list and v and all(type(t) is int for t in v):
        items = [v]
    elif type(v) is list:
        items = v
    else:
        raise invalid(f"'prompt' must be a string or an array, got {type_name(v)}", "prompt")
    if not items:
        raise invalid("'prompt' must not be empty", "prompt")
    if len(items) > max_prompts:
        raise invalid(f"more than {max_prompts} prompts in one request", "prompt")
    out = []
    for item in items:
        if type(item) is str:
            if not item:
                raise invalid("'prompt' must not be empty", "prompt")
            if len(item) > MAX_TEXT_CHARS:
                raise invalid(f"a prompt is longer than {MAX_TEXT_CHARS} characters", "prompt")
            out.append(Prompt(text=item))
        elif type(item) is list:
            if not item:
                raise invalid("'prompt' must not be empty (an empty token list)", "prompt")
            if not all(type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in item):
                raise invalid("token-id prompts must hold non-negative integers", "prompt")
            out.append(Prompt(token_ids=list(item), num_tokens=len(item)))
        else:
            raise invalid(
                "'prompt' must be a string, an array of strings, an array of token ids or an "
                "array of arrays of token ids",
                "prompt",
            )
    return out


def _common(body: dict, req: ParsedRequest, limits: Limits) -> None:
    stream = bool_field(body, "stream")
    req.stream = bool(stream)
    opts = body.get("stream_options")
    if opts is not None:
        if not req.stream:
            raise invalid(
                "'stream_options' is only allowed when 'stream' is true", "stream_options"
            )
        if type(opts) is not dict:
            raise invalid("'stream_options' must be an object", "stream_options")
        unknown = sorted(set(opts) - {"include_usage", "continuous_usage_stats"})
        if unknown:
            raise invalid(
                f"unknown stream_options field(s): {', '.join(unknown)}", "stream_options"
            )
        usage = bool_field(opts, "include_usage")
        req.include_usage = bool(usage)
    n = int_field(body, "n", lo=1, hi=limits.max_n)
    req.n = n or 1
    if req.num_choices > max(MAX_PROMPTS, limits.max_n):
        raise invalid(
            f"{len(req.prompts)} prompts x n={req.n} is more than "
            f"{max(MAX_PROMPTS, limits.max_n)} choices",
            "n",
        )
    req.max_tokens = int_field(body, "max_tokens", lo=1, hi=limits.max_tokens_limit)
    _lane(body, req)


# OpenAI's `service_tier` values -> lane: "flex" (slower, cheaper) is the batch lane.
SERVICE_TIER_LANES = {
    "auto": "interactive",
    "default": "interactive",
    "priority": "interactive",
    "scale": "interactive",
    "flex": "batch",
}


def _lane(body: dict, req: ParsedRequest) -> None:
    lane = body.get("lane")
    if lane is not None:
        if lane not in LANES:
            raise invalid(f"'lane' must be one of {list(LANES)}, got {lane!r}", "lane")
        req.lane = lane
    tier = body.get("service_tier")
    if tier is not None:
        tier_lane = SERVICE_TIER_LANES.get(tier) if type(tier) is str else None
        if tier_lane is None:
            raise invalid(
                f"'service_tier' must be one of {list(SERVICE_TIER_LANES)}, got {tier!r}",
                "service_tier",
            )
        if lane is not None and lane != tier_lane:
            raise invalid(
                f"'service_tier' {tier!r} means the {tier_lane} lane but 'lane' is {lane!r}",
                "service_tier",
            )
        req.lane = tier_lane
    prio = body.get("priority")
    if type(prio) is str:
        if prio not in LANES:
            raise invalid(f"'priority' must be an integer or one of {list(LANES)}", "priority")
        req.lane = prio
    elif prio is not None:
        req.priority = int_field(body, "priority", lo=-(2**31), hi=2**31 - 1) or 0


def _finish(body: dict, req: ParsedRequest, limits: Limits) -> None:
    if req.max_tokens is not None and req.max_tokens > limits.max_tokens_limit:
        param = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        raise invalid(
            f"'{param}' must be <= {limits.max_tokens_limit}, got {req.max_tokens}", param
        )
    tolerated_no_ops(body if req.kind != "chat" else {**body, "tool_choice": None})
    sp: dict[str, Any] = {}
    for name, value in (
        ("temperature", num_field(body, "temperature", 0.0, 2.0)),
        ("top_p", num_field(body, "top_p", 0.0, 1.0, lo_open=True)),
        ("top_k", int_field(body, "top_k", lo=-1, hi=2**31 - 1)),
        ("seed", int_field(body, "seed", lo=-(2**63), hi=2**64 - 1)),
        ("presence_penalty", num_field(body, "presence_penalty", -2.0, 2.0)),
        ("frequency_penalty", num_field(body, "frequency_penalty", -2.0, 2.0)),
        ("repetition_penalty", num_field(body, "repetition_penalty", 0.0, 10.0, lo_open=True)),
        ("ignore_eos", bool_field(body, "ignore_eos")),
        ("include_stop_str_in_output", bool_field(body, "include_stop_str_in_output")),
        ("min_tokens", int_field(body, "min_tokens", lo=0, hi=limits.max_tokens_limit)),
        ("stop", stop_strings(body.get("stop"))),
        ("stop_token_ids", token_ids(body, "stop_token_ids")),
        ("logprobs", req.logprobs),
        ("min_p", num_field(body, "min_p", 0.0, 1.0)),
        ("logit_bias", logit_bias(body.get("logit_bias"))),
        ("structured_outputs", parse_structured(body)),
    ):
        if value is not None:
            sp[name] = value
    if req.tools is not None and req.tools.forced:
        sp["structured_outputs"] = req.tools.spec()
    if sp.get("top_k") == -1:
        sp["top_k"] = 0
    assert set(sp) <= set(SAMPLING_KEYS), sorted(set(sp) - set(SAMPLING_KEYS))
    if req.max_tokens is not None and sp.get("min_tokens", 0) > req.max_tokens:
        raise invalid("'min_tokens' must be <= max_tokens", "min_tokens")
    req.sampling = sp


def logit_bias(v: Any) -> list[list] | None:
    """OpenAI ``logit_bias`` (a map of token id strings to a bias in [-100, 100], at most 300)
    as the wire form: ``[[token_id, bias], ...]`` (msgpack maps keep string keys only). None
    when absent or empty."""
    if v is None:
        return None
    if type(v) is not dict:
        raise invalid(f"'logit_bias' must be an object, got {type_name(v)}", "logit_bias")
    if len(v) > MAX_LOGIT_BIAS:
        raise invalid(f"'logit_bias' has more than {MAX_LOGIT_BIAS} entries", "logit_bias")
    out = []
    for key, bias in v.items():
        if (
            type(key) is not str
            or not (key.isascii() and key.isdigit())  # "²".isdigit(), but no int
            or int(key) > MAX_TOKEN_ID
        ):
            raise invalid(f"'logit_bias' keys must be token ids, got {key!r}", "logit_bias")
        if type(bias) not in (int, float) or not -LOGIT_BIAS_RANGE <= bias <= LOGIT_BIAS_RANGE:
            raise invalid(
                f"'logit_bias' values must be numbers in [-100, 100], got {bias!r}", "logit_bias"
            )
        out.append([int(key), float(bias)])
    return out or None
