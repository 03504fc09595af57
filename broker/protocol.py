"""The laneserve wire protocol: typed messages, msgpack frames, strict validation.

Every message on a laneserve socket is one of the dataclasses below. On the wire a
message is exactly three ZMQ frames (after any ROUTER identity frames)::

    [VERSION_TAG, kind (ASCII), msgpack(payload map)]

``to_frames()`` encodes a message; ``decode(frames, allowed)`` decodes and validates one,
raising :class:`ProtocolError` on anything unexpected: a wrong frame count, an unknown
version or kind, a kind not allowed in that direction, bytes that are not msgpack, a payload
that is not a map, missing or unknown fields, a wrong type, or a size over the limits below.
Never pickle: msgpack only, with ext types refused.

Directions (DESIGN.md "Wire protocol"):

- client -> broker: ``submit``, ``abort``, ``status``, ``hello`` (a liveness probe the broker
  answers with ``heartbeat``)
- broker -> client: ``delta``, ``final``, ``error``, ``heartbeat`` (broker epoch), ``status_reply``
- worker -> broker: ``ready``, ``worker_heartbeat``, ``step_outputs``, ``worker_error``
- broker -> worker: ``request``, ``abort``, ``heartbeat``, ``disconnect``
- broker -> recorder: ``record_batch``; recorder -> broker: ``record_ack``

Times: ``*_time`` / ``*_at`` fields are unix seconds (wall clock, display only); ``*_ms`` fields
are durations in milliseconds measured with monotonic clocks on one host.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar, NamedTuple

import msgpack

VERSION_TAG = b"LS1"
"""First frame of every message; bump on an incompatible change."""

# Size limits. MAX_MESSAGE_BYTES is also the ZMQ_MAXMSGSIZE set on every socket: a peer that
# sends a larger frame is disconnected by libzmq before Python sees it.
MAX_MESSAGE_BYTES = 32 * 1024 * 1024
MAX_ID_CHARS = 256  # request ids, worker ids, model names, codes
MAX_TEXT_CHARS = 8 * 1024 * 1024  # a prompt, a message body, an error message
MAX_TOKEN_IDS = 1_048_576  # prompt_token_ids / token_ids in one message
MAX_MESSAGES = 4096  # chat messages in one request
MAX_STEP_OUTPUTS = 8192  # requests touched in one engine step
MAX_RECORDS = 10_000  # records or snapshots in one RecordBatch
MAX_MAP_ITEMS = 256  # keys in a free-form dict (sampling params, stats, usage, timings)
MAX_NESTING = 8  # nesting depth of free-form values
MAX_TOKEN_ID = 2**31 - 1

LANES = ("interactive", "batch")
FINISH_REASONS = ("stop", "length", "abort", "error")
SAMPLING_FIELDS = frozenset(
    {
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
    }
)
"""Keys allowed in a wire ``sampling_params`` map (issue 3's SamplingParams fields)."""

ERROR_CODES = (
    "invalid_request",
    "prompt_too_long",
    "unauthorized",
    "not_found",
    "payload_too_large",
    "overloaded",
    "no_worker",
    "worker_lost",
    "deadline_exceeded",
    "engine_error",
    "client_too_slow",
    "internal",
)


class ProtocolError(ValueError):
    """A message that is not valid laneserve protocol (see the module docstring)."""


# --------------------------------------------------------------------------------------------
# Field checkers: each takes (name, value) and returns the (possibly normalized) value.

Check = Callable[[str, Any], Any]


def _fail(name: str, what: str) -> ProtocolError:
    return ProtocolError(f"field {name!r}: {what}")


def t_str(max_chars: int = MAX_ID_CHARS, choices: Sequence[str] | None = None) -> Check:
    def check(name: str, v: Any) -> str:
        if type(v) is not str:
            raise _fail(name, f"expected str, got {type(v).__name__}")
        if len(v) > max_chars:
            raise _fail(name, f"longer than {max_chars} characters")
        if choices is not None and v not in choices:
            raise _fail(name, f"{v[:40]!r} not one of {list(choices)}")
        return v

    return check


def t_int(lo: int = -(2**63), hi: int = 2**63 - 1) -> Check:
    def check(name: str, v: Any) -> int:
        if type(v) is not int:
            raise _fail(name, f"expected int, got {type(v).__name__}")
        if not lo <= v <= hi:
            raise _fail(name, f"{v} outside [{lo}, {hi}]")
        return v

    return check


def t_float(lo: float = -math.inf, hi: float = math.inf) -> Check:
    def check(name: str, v: Any) -> float:
        if type(v) not in (int, float):
            raise _fail(name, f"expected number, got {type(v).__name__}")
        if math.isnan(v) or not lo <= v <= hi:
            raise _fail(name, f"{v} outside [{lo}, {hi}]")
        return float(v)

    return check


def t_bool(name: str, v: Any) -> bool:
    if type(v) is not bool:
        raise _fail(name, f"expected bool, got {type(v).__name__}")
    return v


def t_opt(inner: Check) -> Check:
    def check(name: str, v: Any) -> Any:
        return None if v is None else inner(name, v)

    return check


def t_token_ids(max_items: int = MAX_TOKEN_IDS) -> Check:
    def check(name: str, v: Any) -> list[int]:
        if type(v) is not list:
            raise _fail(name, f"expected list of int, got {type(v).__name__}")
        if len(v) > max_items:
            raise _fail(name, f"more than {max_items} token ids")
        for t in v:
            if type(t) is not int or not 0 <= t <= MAX_TOKEN_ID:
                raise _fail(name, f"invalid token id {t!r}")
        return v

    return check


def _check_plain(name: str, v: Any, depth: int) -> None:
    """Free-form values: None, bool, int, float, str, list, dict with str keys (bounded)."""
    tv = type(v)
    if v is None or tv in (bool, int, float):
        return
    if tv is str:
        if len(v) > MAX_TEXT_CHARS:
            raise _fail(name, "string too long")
        return
    if depth >= MAX_NESTING:
        raise _fail(name, f"nested deeper than {MAX_NESTING}")
    if tv is list:
        if len(v) > MAX_TOKEN_IDS:
            raise _fail(name, "list too long")
        for item in v:
            _check_plain(name, item, depth + 1)
        return
    if tv is dict:
        if len(v) > MAX_MAP_ITEMS * 64:
            raise _fail(name, "map too large")
        for k, item in v.items():
            if type(k) is not str or len(k) > MAX_ID_CHARS:
                raise _fail(name, f"map key {k!r} is not a short string")
            _check_plain(name, item, depth + 1)
        return
    raise _fail(name, f"unsupported value type {tv.__name__}")


def t_map(max_items: int = MAX_MAP_ITEMS, keys: frozenset[str] | None = None) -> Check:
    def check(name: str, v: Any) -> dict:
        if type(v) is not dict:
            raise _fail(name, f"expected map, got {type(v).__name__}")
        if len(v) > max_items:
            raise _fail(name, f"more than {max_items} keys")
        if keys is not None:
            unknown = [k for k in v if k not in keys]
            if unknown:
                raise _fail(name, f"unknown keys {sorted(map(str, unknown))[:5]}")
        _check_plain(name, v, 1)
        return v

    return check


def t_list(inner: Check, max_items: int) -> Check:
    def check(name: str, v: Any) -> list:
        if type(v) is not list:
            raise _fail(name, f"expected list, got {type(v).__name__}")
        if len(v) > max_items:
            raise _fail(name, f"more than {max_items} items")
        return [inner(name, item) for item in v]

    return check


def t_any(name: str, v: Any) -> Any:
    _check_plain(name, v, 1)
    return v


def _chat_message(name: str, v: Any) -> dict:
    if type(v) is not dict or type(v.get("role")) is not str:
        raise _fail(name, "each chat message must be a map with a string 'role'")
    _check_plain(name, v, 1)
    return v


def _spec(check: Check, default: Any = dataclass, **kw: Any) -> Any:
    """A dataclass field carrying its wire checker in metadata."""
    if default is dataclass:
        return field(metadata={"check": check}, **kw)
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"check": check})
    return field(default=default, metadata={"check": check})


# --------------------------------------------------------------------------------------------
# Base class and registry.

_REGISTRY: dict[bytes, type[Message]] = {}


def _ext_refused(code: int, data: bytes) -> Any:
    raise ProtocolError(f"msgpack ext type {code} is not allowed")


class Message:
    """Base of every wire message. Subclasses are slotted dataclasses with ``KIND``."""

    KIND: ClassVar[str] = ""
    _fields: ClassVar[tuple[tuple[str, Check, bool], ...]] = ()
    __slots__ = ()

    @classmethod
    def _register(cls) -> None:
        specs = []
        for f in fields(cls):  # type: ignore[arg-type]
            required = f.default is MISSING and f.default_factory is MISSING
            specs.append((f.name, f.metadata["check"], required))
        cls._fields = tuple(specs)
        kind = cls.KIND.encode("ascii")
        assert kind not in _REGISTRY, f"duplicate kind {cls.KIND}"
        _REGISTRY[kind] = cls

    def payload(self) -> dict[str, Any]:
        """The msgpack-able payload map (field name -> value)."""
        return {name: getattr(self, name) for name, _, _ in self._fields}

    def to_frames(self) -> list[bytes]:
        """Encode as ``[VERSION_TAG, kind, msgpack(payload)]``; raises ProtocolError if too big."""
        body = msgpack.packb(self.payload(), use_bin_type=True)
        if len(body) > MAX_MESSAGE_BYTES:
            raise ProtocolError(f"{self.KIND} message of {len(body)} bytes exceeds the limit")
        return [VERSION_TAG, self.KIND.encode("ascii"), body]

    @classmethod
    def from_payload(cls, payload: Any) -> Message:
        """Validate a decoded payload map and build the message; raises ProtocolError."""
        if type(payload) is not dict:
            raise ProtocolError(f"{cls.KIND}: payload must be a map")
        kwargs = {}
        for name, check, required in cls._fields:
            if name in payload:
                kwargs[name] = check(name, payload[name])
            elif required:
                raise ProtocolError(f"{cls.KIND}: missing field {name!r}")
        if len(kwargs) != len(payload):
            extra = sorted(str(k) for k in payload if k not in kwargs)
            raise ProtocolError(f"{cls.KIND}: unknown fields {extra[:5]}")
        msg = cls(**kwargs)
        msg.validate()
        return msg

    def validate(self) -> None:
        """Cross-field checks; subclasses override. Raises ProtocolError."""

    @classmethod
    def from_frames(cls, frames: Sequence[bytes]) -> Message:
        """Decode frames that must hold this class's kind; raises ProtocolError."""
        return decode(frames, (cls,))


def decode(frames: Sequence[bytes], allowed: Sequence[type[Message]] | None = None) -> Message:
    """Decode ``[VERSION_TAG, kind, payload]`` into a validated message.

    ``allowed`` restricts the accepted message classes (one direction of one link); None accepts
    any kind. Raises ProtocolError on any malformed input, never another exception type.
    """
    if len(frames) != 3:
        raise ProtocolError(f"expected 3 frames, got {len(frames)}")
    version, kind, body = (bytes(f) if not isinstance(f, bytes) else f for f in frames)
    if version != VERSION_TAG:
        raise ProtocolError(f"unknown protocol version {version[:16]!r}")
    cls = _REGISTRY.get(kind)
    if cls is None or (allowed is not None and cls not in allowed):
        raise ProtocolError(f"unexpected message kind {kind[:32]!r}")
    if len(body) > MAX_MESSAGE_BYTES:
        raise ProtocolError("message too large")
    try:
        payload = msgpack.unpackb(
            body,
            raw=False,
            strict_map_key=True,
            use_list=True,
            ext_hook=_ext_refused,
            max_str_len=MAX_TEXT_CHARS * 4,
            max_bin_len=0,
            max_array_len=MAX_TOKEN_IDS,
            max_map_len=MAX_MAP_ITEMS * 64,
            max_ext_len=0,
        )
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises several types (ExtraData, ValueError, ...)
        raise ProtocolError(
            f"{cls.KIND}: undecodable payload: {type(exc).__name__}: {exc}"
        ) from exc
    if cls is Delta and type(payload) is dict:
        fast = _fast_delta(payload)
        if fast is not None:
            return fast
    try:
        return cls.from_payload(payload)
    except ProtocolError:
        raise
    except (TypeError, ValueError, RecursionError) as exc:
        raise ProtocolError(f"{cls.KIND}: invalid payload: {exc}") from exc


def message(cls: type) -> type:
    """Class decorator: slotted dataclass + registration under ``cls.KIND``.

    Not ``frozen``: frozen dataclass construction costs ~3 us per object on this CPU, which is
    too much for one object per streamed token. Treat messages as immutable all the same."""
    dc = dataclass(slots=True)(cls)
    dc._register()
    return dc


# --------------------------------------------------------------------------------------------
# client -> broker


def _one_prompt(kind: str, prompt: Any, messages: Any, prompt_token_ids: Any) -> None:
    given = sum(x is not None for x in (prompt, messages, prompt_token_ids))
    if given != 1:
        raise ProtocolError(
            f"{kind}: exactly one of prompt, messages, prompt_token_ids is required"
        )


@message
class Submit(Message):
    """A new request from an edge (gateway, jobs runner, CLI).

    ``arrival_time``: unix seconds when the edge accepted it (display). ``edge_ms``: ms the edge
    held the request before sending it (its monotonic clock), so the broker can extend its own
    monotonic intervals back to arrival. ``attempt`` lets the jobs runner carry a line's attempt
    count across resubmissions.
    """

    KIND: ClassVar[str] = "submit"
    request_id: str = _spec(t_str())
    lane: str = _spec(t_str(choices=LANES))
    sampling_params: dict = _spec(t_map(keys=SAMPLING_FIELDS), {})
    prompt: str | None = _spec(t_opt(t_str(MAX_TEXT_CHARS)), None)
    messages: list | None = _spec(t_opt(t_list(_chat_message, MAX_MESSAGES)), None)
    prompt_token_ids: list | None = _spec(t_opt(t_token_ids()), None)
    priority: int = _spec(t_int(-(2**31), 2**31 - 1), 0)
    model: str | None = _spec(t_opt(t_str()), None)
    stream: bool = _spec(t_bool, True)
    arrival_time: float = _spec(t_float(0.0), 0.0)
    edge_ms: float = _spec(t_float(0.0, 1e9), 0.0)
    job_id: str | None = _spec(t_opt(t_str()), None)
    custom_id: str | None = _spec(t_opt(t_str(4096)), None)
    attempt: int = _spec(t_int(0, 1000), 0)

    def validate(self) -> None:
        if not self.request_id:
            raise ProtocolError("submit: empty request_id")
        _one_prompt(self.KIND, self.prompt, self.messages, self.prompt_token_ids)


@message
class Abort(Message):
    """Abort a request (client -> broker, and broker -> worker)."""

    KIND: ClassVar[str] = "abort"
    request_id: str = _spec(t_str())


@message
class EdgeTimings(Message):
    """The edge's own TTFT and e2e for a finished request (client -> broker, after the final).

    DESIGN.md measures both at the edge; the broker forwards them to the recorder as a partial
    record that overwrites its own broker-side estimates.
    """

    KIND: ClassVar[str] = "edge_timings"
    request_id: str = _spec(t_str())
    ttft_ms: float | None = _spec(t_opt(t_float(0.0, 1e10)), None)
    e2e_ms: float | None = _spec(t_opt(t_float(0.0, 1e10)), None)


@message
class StatusRequest(Message):
    """Ask the broker for its status; answered by :class:`StatusReply` with the same ``request_id``."""

    KIND: ClassVar[str] = "status"
    request_id: str = _spec(t_str(), "")


@message
class Hello(Message):
    """Client liveness probe; the broker answers with a :class:`Heartbeat` carrying its epoch."""

    KIND: ClassVar[str] = "hello"
    client_id: str = _spec(t_str(), "")


# --------------------------------------------------------------------------------------------
# broker -> client


@message
class Delta(Message):
    """New output of a streaming request: text (UTF-8 safe), token ids, optional logprobs."""

    KIND: ClassVar[str] = "delta"
    request_id: str = _spec(t_str())
    text: str = _spec(t_str(MAX_TEXT_CHARS), "")
    token_ids: list = _spec(t_token_ids(), [])
    logprobs: list | None = _spec(t_opt(t_list(t_any, MAX_TOKEN_IDS)), None)


_DELTA_KEYS = frozenset({"request_id", "text", "token_ids", "logprobs"})


def _fast_delta(payload: dict) -> Delta | None:
    """The common streamed delta, validated with straight-line checks (the client's hot path);
    None sends anything unusual (logprobs, odd sizes, bad types) through the generic checks,
    which raise the ProtocolError."""
    rid = payload.get("request_id")
    text = payload.get("text")
    ids = payload.get("token_ids")
    if (
        len(payload) == 4
        and payload.keys() == _DELTA_KEYS
        and payload["logprobs"] is None
        and type(rid) is str
        and len(rid) <= MAX_ID_CHARS
        and type(text) is str
        and len(text) <= MAX_TEXT_CHARS
        and type(ids) is list
        and len(ids) <= 64
        and all(type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in ids)
    ):
        return Delta(rid, text, ids, None)
    return None


@message
class Final(Message):
    """End of a request. ``usage``: prompt_tokens, completion_tokens, cached_tokens.

    ``timings``: the DESIGN per-phase fields in ms (queue_ms, prefill_ms, decode_ms, tpot_ms,
    itl_p99_ms, ...) as far as known at the broker. ``text``/``token_ids`` hold the whole output
    for ``stream=False`` requests and any tail not yet sent as a delta for streaming ones
    (normally empty).
    """

    KIND: ClassVar[str] = "final"
    request_id: str = _spec(t_str())
    finish_reason: str = _spec(t_str(choices=FINISH_REASONS))
    usage: dict = _spec(t_map(), {})
    timings: dict = _spec(t_map(), {})
    text: str = _spec(t_str(MAX_TEXT_CHARS), "")
    token_ids: list = _spec(t_token_ids(), [])
    logprobs: list | None = _spec(t_opt(t_list(t_any, MAX_TOKEN_IDS)), None)
    worker_id: str | None = _spec(t_opt(t_str()), None)
    attempts: int = _spec(t_int(0, 1000), 1)


@message
class Error(Message):
    """A request failed. ``code`` is one of ERROR_CODES; ``retryable`` says a retry may succeed."""

    KIND: ClassVar[str] = "error"
    request_id: str = _spec(t_str())
    code: str = _spec(t_str(choices=ERROR_CODES))
    message: str = _spec(t_str(MAX_TEXT_CHARS), "")
    retryable: bool = _spec(t_bool, False)
    attempts: int = _spec(t_int(0, 1000), 0)


@message
class Heartbeat(Message):
    """Broker heartbeat (to workers every interval; to clients in answer to ``hello``).

    ``epoch`` changes when the broker restarts, so peers notice a restart even when the
    heartbeat never stopped. ``interval_s`` is the broker's heartbeat period.
    """

    KIND: ClassVar[str] = "heartbeat"
    epoch: str = _spec(t_str())
    interval_s: float = _spec(t_float(0.0, 3600.0), 1.0)


@message
class StatusReply(Message):
    """Broker status: ``workers`` (worker_id, pid, lanes, model, capacity, in_flight, load
    stats, last_seen_s), ``queues`` (interactive, batch depths), ``counters`` (invalid messages,
    dispatched, finished, requeued, ...)."""

    KIND: ClassVar[str] = "status_reply"
    request_id: str = _spec(t_str(), "")
    epoch: str = _spec(t_str(), "")
    workers: list = _spec(t_list(t_any, 4096), [])
    queues: dict = _spec(t_map(), {})
    counters: dict = _spec(t_map(), {})


# --------------------------------------------------------------------------------------------
# worker -> broker


@message
class Ready(Message):
    """A worker announces itself: its lanes and ``capacity`` (max requests it accepts at once,
    i.e. its credits). Sent on connect and again after a reconnect."""

    KIND: ClassVar[str] = "ready"
    worker_id: str = _spec(t_str())
    pid: int = _spec(t_int(0, 2**31))
    lanes: list = _spec(t_list(t_str(choices=LANES), 2))
    capacity: int = _spec(t_int(1, 1_000_000))
    model: str = _spec(t_str(), "")
    info: dict = _spec(t_map(), {})

    def validate(self) -> None:
        if not self.lanes:
            raise ProtocolError("ready: a worker must serve at least one lane")


@message
class WorkerHeartbeat(Message):
    """Worker heartbeat from its IO thread. ``stats``: running, waiting, kv_usage (0..1),
    prefix_hit_rate (0..1), step_ms, tokens_per_s, preemptions (see docs/interfaces.md)."""

    KIND: ClassVar[str] = "worker_heartbeat"
    worker_id: str = _spec(t_str())
    stats: dict = _spec(t_map(), {})
    draining: bool = _spec(t_bool, False)


class StepOutput(NamedTuple):
    """One request's output in one engine step (mirrors gpu_worker ``RequestDelta``).

    On the wire it is a msgpack array in field order (compact: one per request per step).
    """

    request_id: str
    text: str = ""
    token_ids: list[int] = []  # noqa: RUF012 - NamedTuple default, never mutated
    finished: bool = False
    finish_reason: str | None = None
    logprobs: list | None = None
    metrics: dict | None = None
    error: str | None = None


_STEP_OUTPUT_CHECKS: tuple[Check, ...] = (
    t_str(),
    t_str(MAX_TEXT_CHARS),
    t_token_ids(),
    t_bool,
    t_opt(t_str(choices=FINISH_REASONS)),
    t_opt(t_list(t_any, MAX_TOKEN_IDS)),
    t_opt(t_map()),
    t_opt(t_str(MAX_TEXT_CHARS)),
)


def _step_output(name: str, v: Any) -> StepOutput:
    if type(v) is not list or len(v) != len(StepOutput._fields):
        raise _fail(name, f"each output must be an array of {len(StepOutput._fields)} items")
    rid, text, token_ids, finished, reason, logprobs, metrics, error = v
    # Fast path for the common streaming item: short id, plain text, token ids, no extras.
    if not (
        type(rid) is str
        and 0 < len(rid) <= MAX_ID_CHARS
        and type(text) is str
        and len(text) <= MAX_TEXT_CHARS
        and type(finished) is bool
        and logprobs is None
        and metrics is None
        and error is None
        and reason is None
        and type(token_ids) is list
        and len(token_ids) <= 64
        and all(type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in token_ids)
    ):
        v = [
            check(f"{name}.{n}", x)
            for check, n, x in zip(_STEP_OUTPUT_CHECKS, StepOutput._fields, v, strict=True)
        ]
    out = StepOutput(*v)
    if out.finished and out.finish_reason is None:
        raise _fail(name, "finished output without finish_reason")
    return out


@message
class StepOutputs(Message):
    """Everything one engine step produced: one :class:`StepOutput` per request touched.

    ``step_ms``: wall time of the engine step (monotonic ms)."""

    KIND: ClassVar[str] = "step_outputs"
    worker_id: str = _spec(t_str())
    outputs: list = _spec(t_list(_step_output, MAX_STEP_OUTPUTS))
    step_ms: float = _spec(t_float(0.0), 0.0)

    def payload(self) -> dict[str, Any]:
        return {
            "worker_id": self.worker_id,
            "outputs": self.outputs,
            "step_ms": self.step_ms,
        }


@message
class WorkerError(Message):
    """A worker-side failure: for one request (``request_id`` set) or the whole worker."""

    KIND: ClassVar[str] = "worker_error"
    worker_id: str = _spec(t_str())
    code: str = _spec(t_str(choices=ERROR_CODES))
    message: str = _spec(t_str(MAX_TEXT_CHARS), "")
    request_id: str | None = _spec(t_opt(t_str()), None)


# --------------------------------------------------------------------------------------------
# broker -> worker


@message
class WorkRequest(Message):
    """A request dispatched to a worker (kind ``request``); fields as in :class:`Submit`."""

    KIND: ClassVar[str] = "request"
    request_id: str = _spec(t_str())
    lane: str = _spec(t_str(choices=LANES))
    sampling_params: dict = _spec(t_map(keys=SAMPLING_FIELDS), {})
    prompt: str | None = _spec(t_opt(t_str(MAX_TEXT_CHARS)), None)
    messages: list | None = _spec(t_opt(t_list(_chat_message, MAX_MESSAGES)), None)
    prompt_token_ids: list | None = _spec(t_opt(t_token_ids()), None)
    priority: int = _spec(t_int(-(2**31), 2**31 - 1), 0)
    model: str | None = _spec(t_opt(t_str()), None)
    attempt: int = _spec(t_int(0, 1000), 1)

    def validate(self) -> None:
        _one_prompt(self.KIND, self.prompt, self.messages, self.prompt_token_ids)


@message
class Disconnect(Message):
    """The broker tells a worker to forget its state and send ``ready`` again (e.g. unknown
    worker after a broker restart or a missed liveness window)."""

    KIND: ClassVar[str] = "disconnect"
    reason: str = _spec(t_str(MAX_TEXT_CHARS), "")


# --------------------------------------------------------------------------------------------
# broker <-> recorder


@message
class RecordBatch(Message):
    """Finished-request records and worker snapshots (dict shapes in docs/interfaces.md
    "Records to SQL"). ``seq`` increases per broker; the recorder answers ``RecordAck(seq)``
    after its commit, and may see a batch twice (writes are idempotent)."""

    KIND: ClassVar[str] = "record_batch"
    seq: int = _spec(t_int(0))
    records: list = _spec(t_list(t_map(), MAX_RECORDS), [])
    snapshots: list = _spec(t_list(t_map(), MAX_RECORDS), [])


@message
class RecordAck(Message):
    """The recorder committed the RecordBatch with this ``seq``."""

    KIND: ClassVar[str] = "record_ack"
    seq: int = _spec(t_int(0))


# Allowed kinds per direction (pass as ``allowed`` to :func:`decode`).
CLIENT_TO_BROKER: tuple[type[Message], ...] = (Submit, Abort, StatusRequest, Hello, EdgeTimings)
BROKER_TO_CLIENT: tuple[type[Message], ...] = (Delta, Final, Error, Heartbeat, StatusReply)
WORKER_TO_BROKER: tuple[type[Message], ...] = (Ready, WorkerHeartbeat, StepOutputs, WorkerError)
BROKER_TO_WORKER: tuple[type[Message], ...] = (WorkRequest, Abort, Heartbeat, Disconnect)
BROKER_TO_RECORDER: tuple[type[Message], ...] = (RecordBatch,)
RECORDER_TO_BROKER: tuple[type[Message], ...] = (RecordAck,)


def secure_socket_options(sock: Any, *, router: bool = False) -> None:
    """Apply the protocol's socket limits: ZMQ_MAXMSGSIZE, LINGER 0 and, on ROUTER sockets,
    ROUTER_MANDATORY (unroutable sends raise EHOSTUNREACH instead of vanishing)."""
    import zmq

    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    sock.setsockopt(zmq.LINGER, 0)
    if router:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)


def send_frames(sock: Any, frames: Sequence[bytes], nonblocking: bool = True) -> None:
    """Send a multipart message on a *synchronous* pyzmq socket, fast.

    Same semantics as ``sock.send_multipart(frames, zmq.NOBLOCK)`` (the message is atomic; with
    a full queue the first frame raises ``zmq.Again``, an unroutable ROUTER identity raises
    ``zmq.ZMQError(EHOSTUNREACH)``), but calls pyzmq's Cython ``send`` with precomputed integer
    flags: about 5x cheaper per message than ``send_multipart``, which dominates the broker's
    per-delta cost otherwise (measured on this project's CPU: 48k vs 270k messages/s).
    """
    send = _backend_send
    more, last = (_MORE_NB, _NB) if nonblocking else (_MORE, 0)
    n = len(frames) - 1
    for i in range(n):
        send(sock, frames[i], more)
    send(sock, frames[n], last)


def _init_fast_send() -> None:
    global _backend_send, _MORE_NB, _NB, _MORE
    import zmq

    _backend_send = zmq.backend.Socket.send
    _MORE_NB = int(zmq.SNDMORE | zmq.NOBLOCK)
    _NB = int(zmq.NOBLOCK)
    _MORE = int(zmq.SNDMORE)


_backend_send: Any = None
_MORE_NB = _NB = _MORE = 0
_init_fast_send()
