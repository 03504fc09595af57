"""Worker <-> broker messages (the broker's back socket).

- worker -> broker: ``ready``, ``worker_heartbeat``, ``step_outputs``, ``worker_error``
- broker -> worker: ``request``, ``abort``, ``heartbeat``, ``disconnect`` (``abort`` and
  ``heartbeat`` are the client-side classes of :mod:`laneserve.broker.protocol.front`)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from typing import Any, ClassVar

from laneserve.broker.protocol.base import Message, message
from laneserve.broker.protocol.checks import (
    ERROR_CODES,
    FINISH_REASONS,
    LANES,
    MAX_EMBEDDING_BYTES,
    MAX_ID_CHARS,
    MAX_STEP_OUTPUTS,
    MAX_TEXT_CHARS,
    MAX_TOKEN_ID,
    MAX_TOKEN_IDS,
    Check,
    ProtocolError,
    fail,
    spec,
    t_any,
    t_bool,
    t_bytes,
    t_float,
    t_int,
    t_list,
    t_map,
    t_opt,
    t_str,
    t_token_ids,
)
from laneserve.broker.protocol.front import Abort, Heartbeat, PromptRequest
from laneserve.contracts.engine_io import EngineOutput, EngineRequest

# worker -> broker


@message
class Ready(Message):
    """A worker announces itself: its lanes and ``capacity`` (max requests it accepts at once,
    i.e. its credits). Sent on connect and again after a reconnect."""

    KIND: ClassVar[str] = "ready"
    worker_id: str = spec(t_str())
    pid: int = spec(t_int(0, 2**31))
    lanes: list = spec(t_list(t_str(choices=LANES), 2))
    capacity: int = spec(t_int(1, 1_000_000))
    model: str = spec(t_str(), "")
    info: dict = spec(t_map(), {})

    def validate(self) -> None:
        if not self.lanes:
            raise ProtocolError("ready: a worker must serve at least one lane")


@message
class WorkerHeartbeat(Message):
    """Worker heartbeat from its IO thread. ``stats``: running, waiting, kv_usage (0..1),
    prefix_hit_rate (0..1), step_ms, tokens_per_s, preemptions (see docs/interfaces.md)."""

    KIND: ClassVar[str] = "worker_heartbeat"
    worker_id: str = spec(t_str())
    stats: dict = spec(t_map(), {})
    draining: bool = spec(t_bool, False)


StepOutput = EngineOutput
"""One request's output in one engine step: the engine's own :class:`EngineOutput`, sent as a
msgpack array in field order (compact: one per request per step). The 9th item,
``prompt_logprobs``, and the 10th, ``embedding``, are optional (workers before them sent 8)."""


_STEP_OUTPUT_CHECKS: tuple[Check, ...] = (
    t_str(),
    t_str(MAX_TEXT_CHARS),
    t_token_ids(),
    t_bool,
    t_opt(t_str(choices=FINISH_REASONS)),
    t_opt(t_list(t_any, MAX_TOKEN_IDS)),
    t_opt(t_map()),
    t_opt(t_str(MAX_TEXT_CHARS)),
    t_opt(t_list(t_any, MAX_TOKEN_IDS)),
    t_opt(t_bytes(MAX_EMBEDDING_BYTES)),
)
_STEP_OUTPUT_MIN_ITEMS = 8  # without prompt_logprobs (what workers before it sent)


def _step_output(name: str, v: Any) -> StepOutput:
    if type(v) is not list or not _STEP_OUTPUT_MIN_ITEMS <= len(v) <= len(StepOutput._fields):
        raise fail(
            name,
            f"each output must be an array of {_STEP_OUTPUT_MIN_ITEMS}.."
            f"{len(StepOutput._fields)} items",
        )
    rid, text, token_ids, finished, reason, logprobs, metrics, error = v[:_STEP_OUTPUT_MIN_ITEMS]
    extra = v[_STEP_OUTPUT_MIN_ITEMS:]
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
        and all(x is None for x in extra)
        and type(token_ids) is list
        and len(token_ids) <= 64
        and all(type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in token_ids)
    ):
        v = [
            check(f"{name}.{n}", x)
            for check, n, x in zip(_STEP_OUTPUT_CHECKS, StepOutput._fields, v, strict=False)
        ]
    out = StepOutput(*v)
    if out.finished and out.finish_reason is None:
        raise fail(name, "finished output without finish_reason")
    return out


@message
class StepOutputs(Message):
    """Everything one engine step produced: one :class:`StepOutput` per request touched.

    ``step_ms``: wall time of the engine step (monotonic ms)."""

    KIND: ClassVar[str] = "step_outputs"
    worker_id: str = spec(t_str())
    outputs: list = spec(t_list(_step_output, MAX_STEP_OUTPUTS))
    step_ms: float = spec(t_float(0.0), 0.0)

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
    worker_id: str = spec(t_str())
    code: str = spec(t_str(choices=ERROR_CODES))
    message: str = spec(t_str(MAX_TEXT_CHARS), "")
    request_id: str | None = spec(t_opt(t_str()), None)


# broker -> worker


@message
class WorkRequest(PromptRequest):
    """A request dispatched to a worker (kind ``request``): the prompt fields of
    :class:`~laneserve.broker.protocol.front.PromptRequest`, the dispatch ``attempt`` (1-based)
    and, for a request resumed after its worker was lost, the ``output_token_ids`` its earlier
    attempt generated (``EngineRequest.output_token_ids``)."""

    KIND: ClassVar[str] = "request"
    attempt: int = spec(t_int(0, 1000), 1)
    output_token_ids: list | None = spec(t_opt(t_token_ids()), None)

    @classmethod
    def of(
        cls,
        submit: PromptRequest,
        attempt: int,
        output_token_ids: list[int] | None = None,
        sampling_params: dict | None = None,
    ) -> WorkRequest:
        """The work message of a submitted request: its prompt fields and ``attempt``; a
        resumed one also its ``output_token_ids`` and the ``sampling_params`` it goes on with."""
        shared = {name: getattr(submit, name) for name in _PROMPT_FIELDS}
        if sampling_params is not None:
            shared["sampling_params"] = sampling_params
        return cls(**shared, attempt=attempt, output_token_ids=output_token_ids or None)

    def engine_request(
        self, arrival_time: float, encode: Callable[..., list[int]] | None = None
    ) -> EngineRequest:
        """What the worker hands its engine; ``arrival_time``: ``time.monotonic()`` s when the
        worker took it. A prompt sent as text or messages (a sender without a tokenizer) is
        templated and tokenized by ``encode(prompt=..., messages=...)``, the worker's front end
        (gpu_worker/prompt_encoder.py): the engine takes ids only.

        Raises:
            ValueError: a text prompt and no ``encode``; what ``encode`` raises for a bad prompt.
        """
        ids = self.prompt_token_ids
        if ids is None:
            if encode is None:
                raise ValueError("a text prompt needs the worker's prompt encoder")
            ids = encode(prompt=self.prompt, messages=self.messages)
        return EngineRequest(
            request_id=self.request_id,
            prompt_token_ids=ids,
            sampling_params=self.sampling_params,
            lane=self.lane,
            priority=self.priority,
            arrival_time=arrival_time,
            task=self.task,
            output_token_ids=self.output_token_ids,
        )


_PROMPT_FIELDS = tuple(f.name for f in fields(PromptRequest))


@message
class Disconnect(Message):
    """The broker tells a worker to forget its state and send ``ready`` again (e.g. unknown
    worker after a broker restart or a missed liveness window)."""

    KIND: ClassVar[str] = "disconnect"
    reason: str = spec(t_str(MAX_TEXT_CHARS), "")


WORKER_TO_BROKER: tuple[type[Message], ...] = (Ready, WorkerHeartbeat, StepOutputs, WorkerError)
BROKER_TO_WORKER: tuple[type[Message], ...] = (WorkRequest, Abort, Heartbeat, Disconnect)
