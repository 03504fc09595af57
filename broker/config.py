"""Broker settings (``laneserve broker`` flags map onto these fields)."""

from __future__ import annotations

from dataclasses import dataclass

from laneserve.contracts import defaults


@dataclass(frozen=True, slots=True)
class BrokerConfig:
    """Broker settings. Addresses are ZMQ endpoints (``tcp://127.0.0.1:PORT`` or ``ipc://PATH``)."""

    front: str
    back: str
    recorder: str | None = None
    heartbeat_interval_s: float = defaults.HEARTBEAT_INTERVAL_S  # DESIGN.md: every 1 s
    liveness: int = defaults.LIVENESS  # intervals of silence before a worker is lost
    max_interactive_queue: int = 256  # full -> `overloaded` (HTTP 429)
    max_batch_queue: int = 20_000  # the jobs runner keeps the rest in SQL
    batch_every: int = 4  # >= 1 batch dispatch per 5 when both lanes wait: 20 % minimum share
    # Of a mixed worker's credits, the share batch may not take. Workers advertise twice their
    # engine's max_num_seqs, so batch fills every engine seat and keeps a queue of half as many
    # there to refill seats as lines finish (at exactly the seats, a quarter of a bulk job's
    # steps found no prompt to prefill once interleaving made them large: issue 53), and
    # interactive arrivals (which preempt batch inside the engine) still reach it, half as many
    # as there are seats at a time.
    interactive_reserve_fraction: float = 0.25
    max_attempts: int = 3  # dispatches before a lost request ends with `worker_lost`
    no_worker_timeout_s: float = 30.0  # interactive waits this long without any serving worker
    record_flush_s: float = 0.5  # recorder commits finished requests within about a second
    record_batch_size: int = 512
    record_resend_s: float = (
        defaults.RECORD_RESEND_S
    )  # resend an unacknowledged RecordBatch after this long
    record_retention: int = 50_000  # max records held unacknowledged; oldest dropped beyond
    snapshot_interval_s: float = 5.0  # worker_stats snapshots
    client_sndhwm: int = 100_000  # messages queued per client before it counts as not reading
    max_reads_per_poll: int = 2000
    max_drain_s: float = 0.01  # time slice per socket per loop, so heartbeats stay on time
    parent_pid: int | None = None  # exit when this process is gone (supervisor)
    curve_server_key: str | None = None  # server .key_secret file: back socket is a CURVE server
    curve_allow: str | None = None  # directory of allowed client .key files (broker/curve.py)
