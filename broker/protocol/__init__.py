"""The laneserve wire protocol: typed messages, msgpack frames, strict validation.

Every message on a laneserve socket is a typed dataclass. On the wire a message is exactly
three ZMQ frames (after any ROUTER identity frames)::

    [VERSION_TAG, kind (ASCII), msgpack(payload map)]

``to_frames()`` encodes a message; ``decode(frames, allowed)`` decodes and validates one,
raising :class:`ProtocolError` on anything unexpected: a wrong frame count, an unknown
version or kind, a kind not allowed in that direction, bytes that are not msgpack, a payload
that is not a map, missing or unknown fields, a wrong type, or a size over the limits.
Never pickle: msgpack only, with ext types refused.

Modules, by direction (DESIGN.md "Wire protocol"):

- :mod:`laneserve.broker.protocol.checks`: vocabulary (lanes, finish reasons, error codes, sampling
  keys), size limits, ``ProtocolError`` and the field checkers (``t_str``, ``t_int``, ...);
- :mod:`laneserve.broker.protocol.base`: the ``Message`` base class, the kind registry, ``decode``;
- :mod:`laneserve.broker.protocol.front`: client <-> broker (``submit``, ``abort``, ``edge_timings``,
  ``status``, ``hello``; ``delta``, ``final``, ``error``, ``heartbeat``, ``status_reply``);
- :mod:`laneserve.broker.protocol.back`: worker <-> broker (``ready``, ``worker_heartbeat``,
  ``step_outputs``, ``worker_error``; ``request``, ``abort``, ``heartbeat``, ``disconnect``);
- :mod:`laneserve.broker.protocol.recorder`: broker <-> recorder (``record_batch`` of typed
  ``RequestRecord``/``EdgeTimings``/``WorkerSnapshot`` items; ``record_ack``);
- :mod:`laneserve.broker.protocol.sockets`: socket limits and the fast multipart send.

Everything is re-exported here: ``from laneserve.broker import protocol as p; p.Submit(...)``.

Times: ``*_time`` / ``*_at`` fields are unix seconds (wall clock, display only); ``*_ms`` fields
are durations in milliseconds measured with monotonic clocks on one host.
"""

from __future__ import annotations

from laneserve.broker.protocol.back import (
    BROKER_TO_WORKER,
    WORKER_TO_BROKER,
    Disconnect,
    Ready,
    StepOutput,
    StepOutputs,
    WorkerError,
    WorkerHeartbeat,
    WorkRequest,
)
from laneserve.broker.protocol.base import VERSION_TAG, Message, decode, message
from laneserve.broker.protocol.checks import (
    ERROR_CODES,
    FINISH_REASONS,
    LANES,
    MAX_ID_CHARS,
    MAX_MAP_ITEMS,
    MAX_MESSAGE_BYTES,
    MAX_MESSAGES,
    MAX_NESTING,
    MAX_RECORDS,
    MAX_STEP_OUTPUTS,
    MAX_TEXT_CHARS,
    MAX_TOKEN_ID,
    MAX_TOKEN_IDS,
    SAMPLING_FIELDS,
    ProtocolError,
)
from laneserve.broker.protocol.front import (
    BROKER_TO_CLIENT,
    CLIENT_TO_BROKER,
    Abort,
    Delta,
    EdgeTimings,
    Error,
    Final,
    Heartbeat,
    Hello,
    PromptRequest,
    StatusReply,
    StatusRequest,
    Submit,
    WorkerExited,
    encode_delta,
)
from laneserve.broker.protocol.recorder import (
    BROKER_TO_RECORDER,
    RECORDER_TO_BROKER,
    REQUEST_STATUSES,
    RecordAck,
    RecordBatch,
    RequestRecord,
    WorkerSnapshot,
)
from laneserve.broker.protocol.sockets import bind_router, secure_socket_options, send_frames

__all__ = [
    "BROKER_TO_CLIENT",
    "BROKER_TO_RECORDER",
    "BROKER_TO_WORKER",
    "CLIENT_TO_BROKER",
    "ERROR_CODES",
    "FINISH_REASONS",
    "LANES",
    "MAX_ID_CHARS",
    "MAX_MAP_ITEMS",
    "MAX_MESSAGES",
    "MAX_MESSAGE_BYTES",
    "MAX_NESTING",
    "MAX_RECORDS",
    "MAX_STEP_OUTPUTS",
    "MAX_TEXT_CHARS",
    "MAX_TOKEN_ID",
    "MAX_TOKEN_IDS",
    "RECORDER_TO_BROKER",
    "REQUEST_STATUSES",
    "SAMPLING_FIELDS",
    "VERSION_TAG",
    "WORKER_TO_BROKER",
    "Abort",
    "Delta",
    "Disconnect",
    "EdgeTimings",
    "Error",
    "Final",
    "Heartbeat",
    "Hello",
    "Message",
    "PromptRequest",
    "ProtocolError",
    "Ready",
    "RecordAck",
    "RecordBatch",
    "RequestRecord",
    "StatusReply",
    "StatusRequest",
    "StepOutput",
    "StepOutputs",
    "Submit",
    "WorkerExited",
    "WorkRequest",
    "WorkerError",
    "WorkerHeartbeat",
    "WorkerSnapshot",
    "bind_router",
    "decode",
    "encode_delta",
    "message",
    "secure_socket_options",
    "send_frames",
]
