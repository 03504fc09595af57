"""Gateway settings (``laneserve api`` flags map one to one onto :class:`ApiConfig`)."""

from __future__ import annotations

from dataclasses import dataclass

from laneserve.contracts.openai.requests import (
    DEFAULT_MAX_N,
    DEFAULT_MAX_TOKENS_LIMIT,
    LANES,
    Limits,
)

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024  # JSON request bodies; a prompt is text, not a file
DEFAULT_MAX_FILE_BYTES = 200 * 1024 * 1024  # OpenAI's limit for a batch input file (200 MB)
# A dead gateway's background responses run again this long after its last heartbeat: a few
# missed renewals (every third of it), not a slow database write, must make a gateway look dead.
DEFAULT_BACKGROUND_LEASE_S = 10.0


@dataclass(frozen=True, slots=True)
class ApiConfig:
    """Everything the gateway needs.

    ``broker``: the broker's front endpoint (``ipc://...`` or ``tcp://127.0.0.1:P``).
    ``api_key``: when set, every route except ``/health`` needs ``Authorization: Bearer KEY``;
    None disables auth (any Authorization header is ignored; DESIGN.md "Error codes").
    ``model``: an alias, ``.gguf`` file or HF directory whose tokenizer counts prompt tokens at the
    edge; None: no tokenizer (the engine still rejects over-length prompts, mapped to 400).
    ``served_model_name``: the name clients send as ``model`` (default: the model's display
    name). ``max_model_len``: tokens (prompt + output); default: the model's config.
    ``db_url``: database for files and batches (default: ``$LANESERVE_DB_URL`` or SQLite in
    ``$LANESERVE_HOME``).
    ``metrics_port``: when set, ``/metrics`` (and ``/health``, ``/ready``) are also served on
    ``metrics_host:metrics_port`` without the key (0 picks a free port). ``stack_gauges``: export
    the broker status and bulk-job gauges (one gateway per broker; laneserve.api.metrics).
    ``ready_lanes``: lanes that need a live worker for ``/ready`` to answer 200;
    ``ready_ttl_s``: seconds a readiness answer is reused (laneserve.api.health).
    ``tool_call_parser``: how replies are read for tool calls (``hermes``, ``llama3_json``,
    ``mistral``); None: the one the chat template implies (docs/tool-calling.md).
    ``background_lease_s``: seconds a background response's lease lasts without a renewal
    (laneserve.api.response_leases); the same on every gateway sharing a database.
    """

    broker: str
    api_key: str | None = None
    model: str | None = None
    served_model_name: str | None = None
    max_model_len: int | None = None
    db_url: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES
    max_n: int = DEFAULT_MAX_N
    max_tokens_limit: int = DEFAULT_MAX_TOKENS_LIMIT
    status_interval_s: float = 1.0  # broker status poll (workers per lane, /metrics gauges)
    broker_timeout_s: float = 2.0  # a status call without answer: broker unavailable (503)
    parent_pid: int | None = None  # exit when this process is gone (supervisor)
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    stack_gauges: bool = True
    ready_lanes: tuple[str, ...] = LANES
    ready_ttl_s: float = 1.0
    tool_call_parser: str | None = None
    background_lease_s: float = DEFAULT_BACKGROUND_LEASE_S

    @property
    def limits(self) -> Limits:
        """The per-request caps shared with bulk-job lines (:mod:`laneserve.contracts.openai`)."""
        return Limits(max_n=self.max_n, max_tokens_limit=self.max_tokens_limit)
