"""Client <-> broker messages (the broker's front socket): edges (gateway, jobs runner, CLI).

- client -> broker: ``submit``, ``abort``, ``edge_timings``, ``status``, ``hello`` (a liveness
  probe the broker answers with ``heartbeat``)
- broker -> client: ``delta``, ``final``, ``error``, ``heartbeat`` (broker epoch),
  ``status_reply``

``abort`` and ``heartbeat`` also travel broker -> worker (:mod:`laneserve.broker.protocol.back`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import msgpack

from laneserve.broker.protocol.base import VERSION_TAG, Message, message
from laneserve.broker.protocol.checks import (
    ERROR_CODES,
    FINISH_REASONS,
    LANES,
    MAX_EMBEDDING_BYTES,
    MAX_ID_CHARS,
    MAX_MESSAGES,
    MAX_TEXT_CHARS,
    MAX_TOKEN_ID,
    MAX_TOKEN_IDS,
    SAMPLING_FIELDS,
    TASKS,
    ProtocolError,
    one_prompt,
    spec,
    t_any,
    t_bool,
    t_bytes,
    t_chat_message,
    t_float,
    t_int,
    t_list,
    t_map,
    t_opt,
    t_str,
    t_token_ids,
)

# client -> broker


@dataclass(slots=True)
class PromptRequest(Message):
    """The fields ``submit`` (client -> broker) and ``request`` (broker -> worker) share: the
    request id, its lane, sampling params, exactly one prompt form (``prompt`` text, chat
    ``messages`` or ``prompt_token_ids``), ``priority`` (lower = more urgent), ``model`` and
    ``task``: ``"generate"`` (sample tokens) or ``"embed"`` (prefill only; the final carries the
    pooled, normalized hidden state). Not a message kind itself."""

    request_id: str = spec(t_str())
    lane: str = spec(t_str(choices=LANES))
    sampling_params: dict = spec(t_map(keys=SAMPLING_FIELDS), {})
    prompt: str | None = spec(t_opt(t_str(MAX_TEXT_CHARS)), None)
    messages: list | None = spec(t_opt(t_list(t_chat_message, MAX_MESSAGES)), None)
    prompt_token_ids: list | None = spec(t_opt(t_token_ids()), None)
    priority: int = spec(t_int(-(2**31), 2**31 - 1), 0)
    model: str | None = spec(t_opt(t_str()), None)
    task: str = spec(t_str(choices=TASKS), "generate")

    def validate(self) -> None:
        one_prompt(self.KIND, self.prompt, self.messages, self.prompt_token_ids)


@message
class Submit(PromptRequest):
    """A new request from an edge (gateway, jobs runner, CLI); the prompt fields are
    :class:`PromptRequest`'s.

    ``arrival_time``: unix seconds when the edge accepted it (display). ``edge_ms``: ms the edge
    held the request before sending it (its monotonic clock), so the broker can extend its own
    monotonic intervals back to arrival. ``attempt`` lets the jobs runner carry a line's attempt
    count across resubmissions.
    """

    KIND: ClassVar[str] = "submit"
    stream: bool = spec(t_bool, True)
    arrival_time: float = spec(t_float(0.0), 0.0)
    edge_ms: float = spec(t_float(0.0, 1e9), 0.0)
    job_id: str | None = spec(t_opt(t_str()), None)
    custom_id: str | None = spec(t_opt(t_str(4096)), None)
    attempt: int = spec(t_int(0, 1000), 0)

    def validate(self) -> None:
        if not self.request_id:
            raise ProtocolError("submit: empty request_id")
        PromptRequest.validate(self)


@message
class Abort(Message):
    """Abort a request (client -> broker, and broker -> worker)."""

    KIND: ClassVar[str] = "abort"
    request_id: str = spec(t_str())


@message
class EdgeTimings(Message):
    """The edge's own TTFT and e2e for a finished request (client -> broker, after the final).

    DESIGN.md measures both at the edge; the broker forwards them to the recorder as a partial
    record that overwrites its own broker-side estimates.
    """

    KIND: ClassVar[str] = "edge_timings"
    request_id: str = spec(t_str())
    ttft_ms: float | None = spec(t_opt(t_float(0.0, 1e10)), None)
    e2e_ms: float | None = spec(t_opt(t_float(0.0, 1e10)), None)


@message
class StatusRequest(Message):
    """Ask the broker for its status; answered by :class:`StatusReply` with the same ``request_id``."""

    KIND: ClassVar[str] = "status"
    request_id: str = spec(t_str(), "")


@message
class WorkerExited(Message):
    """A supervisor saw its worker process exit (``laneserve up``): the broker drops the worker
    registered with this ``worker_id`` and ``pid`` at once and requeues its requests, instead of
    waiting for its next heartbeat to fail (up to an interval) or, where the dead peer's
    connection lingers, the liveness window. Ignored while that pid still runs on the broker's
    host."""

    KIND: ClassVar[str] = "worker_exited"
    worker_id: str = spec(t_str())
    pid: int = spec(t_int(1, 2**31))


@message
class Hello(Message):
    """Client liveness probe; the broker answers with a :class:`Heartbeat` carrying its epoch."""

    KIND: ClassVar[str] = "hello"
    client_id: str = spec(t_str(), "")


# broker -> client


@message
class Delta(Message):
    """New output of a streaming request: text (UTF-8 safe), token ids, optional logprobs."""

    KIND: ClassVar[str] = "delta"
    request_id: str = spec(t_str())
    text: str = spec(t_str(MAX_TEXT_CHARS), "")
    token_ids: list = spec(t_token_ids(), [])
    logprobs: list | None = spec(t_opt(t_list(t_any, MAX_TOKEN_IDS)), None)


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


Delta.FAST_PATH = staticmethod(_fast_delta)
_DELTA_KIND = Delta.KIND.encode()
_packb = msgpack.Packer(use_bin_type=True).pack


def encode_delta(
    request_id: str, text: str, token_ids: list[int], logprobs: list | None
) -> list[bytes]:
    """Frames of ``Delta(request_id, text, token_ids, logprobs)`` without building the object
    (the broker's hot path; byte-identical to ``Delta(...).to_frames()``)."""
    payload = {"request_id": request_id, "text": text, "token_ids": token_ids, "logprobs": logprobs}
    return [VERSION_TAG, _DELTA_KIND, _packb(payload)]


@message
class Final(Message):
    """End of a request. ``usage``: prompt_tokens, completion_tokens, cached_tokens.

    ``timings``: the DESIGN per-phase fields in ms (queue_ms, prefill_ms, decode_ms, tpot_ms,
    itl_p99_ms, ...) as far as known at the broker. ``text``/``token_ids`` hold the whole output
    for ``stream=False`` requests and any tail not yet sent as a delta for streaming ones
    (normally empty). ``prompt_logprobs``: with ``sampling_params.prompt_logprobs``, one entry
    per prompt position (None for the first, else ``{token_id, logprob, rank, top}``), streamed
    or not. ``embedding`` (``task="embed"``): the pooled vector as little-endian float32 bytes.
    """

    KIND: ClassVar[str] = "final"
    request_id: str = spec(t_str())
    finish_reason: str = spec(t_str(choices=FINISH_REASONS))
    usage: dict = spec(t_map(), {})
    timings: dict = spec(t_map(), {})
    text: str = spec(t_str(MAX_TEXT_CHARS), "")
    token_ids: list = spec(t_token_ids(), [])
    logprobs: list | None = spec(t_opt(t_list(t_any, MAX_TOKEN_IDS)), None)
    worker_id: str | None = spec(t_opt(t_str()), None)
    attempts: int = spec(t_int(0, 1000), 1)
    prompt_logprobs: list | None = spec(t_opt(t_list(t_any, MAX_TOKEN_IDS)), None)
    embedding: bytes | None = spec(t_opt(t_bytes(MAX_EMBEDDING_BYTES)), None)


@message
class Error(Message):
    """A request failed. ``code`` is one of ERROR_CODES; ``retryable`` says a retry may succeed."""

    KIND: ClassVar[str] = "error"
    request_id: str = spec(t_str())
    code: str = spec(t_str(choices=ERROR_CODES))
    message: str = spec(t_str(MAX_TEXT_CHARS), "")
    retryable: bool = spec(t_bool, False)
    attempts: int = spec(t_int(0, 1000), 0)


@message
class Heartbeat(Message):
    """Broker heartbeat (to workers every interval; to clients in answer to ``hello``).

    ``epoch`` changes when the broker restarts, so peers notice a restart even when the
    heartbeat never stopped. ``interval_s`` is the broker's heartbeat period.
    """

    KIND: ClassVar[str] = "heartbeat"
    epoch: str = spec(t_str())
    interval_s: float = spec(t_float(0.0, 3600.0), 1.0)


@message
class StatusReply(Message):
    """Broker status: ``workers`` (worker_id, pid, lanes, model, capacity, in_flight, load
    stats, last_seen_s), ``queues`` (interactive, batch depths), ``counters`` (invalid messages,
    dispatched, finished, requeued, ...)."""

    KIND: ClassVar[str] = "status_reply"
    request_id: str = spec(t_str(), "")
    epoch: str = spec(t_str(), "")
    workers: list = spec(t_list(t_any, 4096), [])
    queues: dict = spec(t_map(), {})
    counters: dict = spec(t_map(), {})


CLIENT_TO_BROKER: tuple[type[Message], ...] = (
    Submit,
    Abort,
    StatusRequest,
    Hello,
    EdgeTimings,
    WorkerExited,
)
BROKER_TO_CLIENT: tuple[type[Message], ...] = (Delta, Final, Error, Heartbeat, StatusReply)
