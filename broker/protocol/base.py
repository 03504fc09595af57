"""The message machinery: the ``Message`` base class, the kind registry and :func:`decode`.

On the wire a message is exactly three ZMQ frames (after any ROUTER identity frames)::

    [VERSION_TAG, kind (ASCII), msgpack(payload map)]

A message class may set ``FAST_PATH``, a function that validates the class's most common
payload with straight-line checks and returns the message, or None to fall back to the generic
field checks (which raise the ProtocolError).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import MISSING, dataclass, fields
from typing import Any, ClassVar

import msgpack

from laneserve.broker.protocol.checks import (
    MAX_EMBEDDING_BYTES,
    MAX_MAP_ITEMS,
    MAX_MESSAGE_BYTES,
    MAX_TEXT_CHARS,
    MAX_TOKEN_IDS,
    Check,
    ProtocolError,
)

VERSION_TAG = b"LS1"
"""First frame of every message; bump on an incompatible change."""

_REGISTRY: dict[bytes, type[Message]] = {}


def _ext_refused(code: int, data: bytes) -> Any:
    raise ProtocolError(f"msgpack ext type {code} is not allowed")


class Message:
    """Base of every wire message. Subclasses are slotted dataclasses with ``KIND``."""

    KIND: ClassVar[str] = ""
    FAST_PATH: ClassVar[Callable[[dict], Message | None] | None] = None
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
        """Encode as ``[VERSION_TAG, kind, msgpack(payload)]``; raises ProtocolError if too big
        or not encodable (an int outside msgpack's [-2**63, 2**64 - 1], an unknown type).

        Messages nested in a field (a batch's records) travel as their payload maps."""
        try:
            body = msgpack.packb(self.payload(), use_bin_type=True, default=_nested_payload)
        except (TypeError, ValueError, OverflowError) as exc:  # e.g. an int past 64 bits
            raise ProtocolError(f"{self.KIND} message cannot be encoded: {exc}") from None
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
    def checked(cls, **fields_: Any) -> Message:
        """Build a message validated exactly as a receiver would validate it (for a sender that
        must not put an invalid message on the wire); raises ProtocolError."""
        return cls.from_payload(fields_)

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
            max_bin_len=MAX_EMBEDDING_BYTES,  # the one binary field: an embedding vector
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
    if cls.FAST_PATH is not None and type(payload) is dict:
        fast = cls.FAST_PATH(payload)
        if fast is not None:
            return fast
    try:
        return cls.from_payload(payload)
    except ProtocolError:
        raise
    except (TypeError, ValueError, RecursionError) as exc:
        raise ProtocolError(f"{cls.KIND}: invalid payload: {exc}") from exc


def _nested_payload(obj: Any) -> Any:
    if isinstance(obj, Message):
        return obj.payload()
    raise TypeError(f"cannot encode {type(obj).__name__} in a message")


def t_message(cls: type[Message]) -> Check:
    """Checker of a message nested in a field (a payload map), validated as ``cls``."""

    def check(name: str, v: Any) -> Message:
        if type(v) is not dict:
            raise ProtocolError(f"field {name!r}: expected a {cls.KIND} map")
        try:
            return cls.from_payload(v)
        except ProtocolError as exc:
            raise ProtocolError(f"field {name!r}: {exc}") from exc

    return check


def message(cls: type) -> type:
    """Class decorator: slotted dataclass + registration under ``cls.KIND``.

    Not ``frozen``: frozen dataclass construction costs ~3 us per object on this CPU, which is
    too much for one object per streamed token. Treat messages as immutable all the same."""
    dc = dataclass(slots=True)(cls)
    dc._register()
    return dc
