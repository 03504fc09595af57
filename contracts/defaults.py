"""Defaults that several processes, classes and command-line flags share, declared once here;
the flags read them (``--heartbeat-interval``, ``--liveness``, ``--drain-timeout``, ...) and so
do the classes they configure. A setting of one component alone lives with that component's
config (``broker.config.BrokerConfig``, ``gpu_worker.scheduler_config``); its flag reads it from
there (:func:`field_default`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

HEARTBEAT_INTERVAL_S = 1.0  # broker <-> worker and broker <-> client heartbeats (DESIGN.md)
LIVENESS = 3  # heartbeat intervals of silence before a worker is lost (a busy CPU needs more)
CLIENT_LIVENESS_S = 10.0  # a broker client's silence bound before it reconnects
DRAIN_TIMEOUT_S = 30.0  # a draining worker's time to finish what it holds (SIGTERM)
MAX_MODEL_LEN = 8192  # context of an engine whose model does not say (synthetic engines)
RECORD_RESEND_S = 5.0  # an unacknowledged record batch is resent after this long


def field_default(cls: type, name: str) -> Any:
    """The default of dataclass ``cls``'s field ``name`` (for a flag that sets that field).

    Raises:
        KeyError: no such field; ValueError: the field has no plain default.
    """
    field = {f.name: f for f in dataclasses.fields(cls)}[name]
    if field.default is dataclasses.MISSING:
        raise ValueError(f"{cls.__name__}.{name} has no plain default")
    return field.default
