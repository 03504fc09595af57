"""The gateway's shared state: :class:`GatewayState`, one per app (``app.state.gateway``).

:mod:`laneserve.api.app` creates it and the route modules (``completions``, ``tokenize``,
``files``, ``inspection``, ``probes``) read it from the request; none of them imports the app.

Start-up (lifespan): load the model's tokenizer (``tokenizer.json``, no torch), connect the
broker client, start the status poller (workers per lane for the 503 check, gauges for /metrics,
parent-pid watch), the background responses' heartbeat (:mod:`laneserve.api.response_recovery`)
and, with ``metrics_port`` set, the metrics listener
(:mod:`laneserve.api.probes`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import time
import uuid
from typing import Any

from laneserve.api.config import ApiConfig
from laneserve.api.errors import ApiError
from laneserve.api.files import database_answers, open_jobs_service
from laneserve.api.health import ReadinessProbe
from laneserve.api.metrics import GatewayMetrics
from laneserve.api.model_info import load_served_model
from laneserve.api.probes import serve_metrics_port
from laneserve.api.response_recovery import keep_leases, let_go
from laneserve.broker.client import BrokerClient
from laneserve.contracts.openai.model import ServedModel, largest_kv_pool
from laneserve.contracts.procs import parent_gone

logger = logging.getLogger(__name__)

DATABASE_CHECK_S = 2.0  # seconds between two checks that the files/batches database answers


class GatewayState:
    """Per-app state: config, broker client, model info, metrics, last broker status."""

    def __init__(self, config: ApiConfig) -> None:
        self.config = config
        self.metrics = GatewayMetrics(stack_gauges=config.stack_gauges)
        self.model_info = ServedModel(
            served_name=config.served_model_name, max_model_len=config.max_model_len
        )
        self.client: BrokerClient | None = None
        self.status: dict[str, Any] | None = None
        self.status_at = 0.0  # monotonic s of the last answered status call
        self.readiness = ReadinessProbe(self._probe_status, config.ready_lanes, config.ready_ttl_s)
        self.jobs: Any = None  # files/batches service (laneserve.api.files)
        # the database answered its last check (/ready's "database"); None: never checked
        self.database: bool | None = None
        self.metrics_server: Any = None  # uvicorn server of the metrics port
        # this process in background responses' leases; the ones it runs, by response id
        self.instance_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.background: dict[str, Any] = {}  # laneserve.api.response_background.Running
        self._tasks: list[asyncio.Task] = []

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        try:
            self.model_info = await asyncio.to_thread(load_served_model, self.config)
        except (ValueError, RuntimeError) as exc:  # TokenizerError, ModelLoadError: say why
            logger.error("cannot load the model %s: %s", self.config.model, exc)
            raise
        if self.model_info.served_name:
            self.metrics.model_name = self.model_info.served_name
            self.metrics.served_name = True
        self.client = BrokerClient(self.config.broker)
        await self.client.start()
        await self.refresh_status()
        self.jobs = await asyncio.to_thread(open_jobs_service, self.config)
        self.database = self.jobs is not None
        self._tasks.append(asyncio.create_task(self._poll(), name="gateway-status-poll"))
        self._tasks.append(asyncio.create_task(self._watch_database(), name="gateway-db-check"))
        self._tasks.append(asyncio.create_task(keep_leases(self), name="gateway-leases"))
        if self.config.metrics_port is not None:
            await self._start_metrics_server()
        logger.info(
            "gateway ready: broker %s, model %s, auth %s",
            self.config.broker,
            self.model_info.served_name,
            "on" if self.config.api_key else "off",
        )

    async def _start_metrics_server(self) -> None:
        """Serve /metrics, /health and /ready without the key on the metrics port
        (:func:`laneserve.api.probes.serve_metrics_port`). The socket is bound here, so a port
        in use fails the start-up with OSError."""
        self.metrics_server, task = serve_metrics_port(self)
        self._tasks.append(task)

    async def stop(self) -> None:
        if self.metrics_server is not None:  # let it close its connections first (<= 2 s)
            self.metrics_server.should_exit = True
            serving = [t for t in self._tasks if t.get_name() == "gateway-metrics"]
            await asyncio.wait(serving, timeout=2.0)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await let_go(self)  # background responses: another gateway takes them at once
        if self.client is not None:
            await self.client.close()
        if self.jobs is not None and hasattr(self.jobs, "close"):
            await asyncio.to_thread(self.jobs.close)

    async def _poll(self) -> None:
        parent = self.config.parent_pid
        while True:
            await asyncio.sleep(self.config.status_interval_s)
            if parent_gone(parent):
                logger.warning("parent process %d is gone: stopping", parent)
                os.kill(os.getpid(), signal.SIGTERM)
                return
            await self.refresh_status()

    async def _watch_database(self) -> None:
        """Every `DATABASE_CHECK_S`: does the database answer (``database``, logged when it
        changes)? A gateway started while it was down opens it once it answers."""
        while True:
            await asyncio.sleep(DATABASE_CHECK_S)
            if self.jobs is None:
                self.jobs = await asyncio.to_thread(open_jobs_service, self.config, quiet=True)
                ok = self.jobs is not None
            else:
                ok = await asyncio.to_thread(database_answers, self.jobs.engine)
            if ok != self.database:
                log = logger.info if ok else logger.warning
                log("the database %s", "answers again" if ok else "does not answer")
            self.database = ok

    async def refresh_status(self) -> bool:
        """Ask the broker for its status; False when it does not answer in time."""
        assert self.client is not None
        started = time.monotonic()
        try:
            reply = await self.client.status(timeout_s=self.config.broker_timeout_s)
        except TimeoutError:
            logger.warning("broker %s did not answer a status call", self.config.broker)
            self.status = None
            self.metrics.broker.status = None
            self.readiness.observe(None, time.monotonic())
            return False
        self.status = {
            "workers": reply.workers,
            "queues": reply.queues,
            "counters": reply.counters,
            "epoch": reply.epoch,
        }
        self.status_at = time.monotonic()
        self.model_info.kv_pool = largest_kv_pool(reply.workers)  # checked at the edge
        self.metrics.broker.status = self.status
        self.metrics.model_name = (self.model_names() or [self.metrics.model_name])[0]
        self.readiness.observe(self.status, started)
        return True

    async def _probe_status(self) -> dict[str, Any] | None:
        """A fresh broker status for the readiness probe (None: the broker does not answer)."""
        return self.status if await self.refresh_status() else None

    # ------------------------------------------------------------------ checks

    def model_names(self) -> list[str]:
        names = [self.model_info.served_name] if self.model_info.served_name else []
        for w in (self.status or {}).get("workers") or []:
            m = w.get("model")
            if isinstance(m, str) and m and m not in names:
                names.append(m)
        return names

    async def check_model(self, model: str) -> None:
        """Raises ApiError ``not_found`` (404) for a model nobody serves, ``no_worker`` (503)
        while no model is known at all (a gateway without ``--model`` and no worker registered,
        e.g. the only one restarting)."""
        if model in self.model_names():
            return
        if time.monotonic() - self.status_at > 0.5:
            await self.refresh_status()
        names = self.model_names()
        if not names:  # no served name and no worker now (one restarting): nothing is unknown yet
            raise ApiError("no_worker", "no worker serves any model now; retry shortly")
        self.model_info.check_name(model, names)

    def _serves(self, lane: str) -> bool:
        workers = (self.status or {}).get("workers") or []
        return any(lane in (w.get("lanes") or []) and not w.get("draining") for w in workers)

    async def check_lane(self, lane: str) -> None:
        """Raises ApiError ``no_worker`` (503) when no live worker serves ``lane``."""
        if self._serves(lane):
            return
        if not await self.refresh_status():
            raise ApiError("no_worker", f"the broker at {self.config.broker} does not answer")
        if not self._serves(lane):
            raise ApiError("no_worker", f"no worker serves the {lane} lane")


async def model_objects(state: GatewayState) -> list[dict]:
    """The OpenAI model objects of every served name (``/v1/models``, ``/v1/models/{id}``)."""
    if state.status is None or (
        not state.model_names() and time.monotonic() - state.status_at > 0.5
    ):
        await state.refresh_status()  # none known yet: a worker may have joined since the last poll
    created = state.model_info.created
    data = []
    for name in state.model_names():
        entry = {"id": name, "object": "model", "created": created, "owned_by": "laneserve"}
        if name == state.model_info.served_name and state.model_info.max_model_len:
            entry["max_model_len"] = state.model_info.max_model_len
        pooling = _pooling_of(state, name)
        if pooling is not None:
            entry["pooling"] = pooling
        data.append(entry)
    return data


def _pooling_of(state: GatewayState, name: str) -> dict | None:
    """How ``/v1/embeddings`` pools for model ``name``: the first real worker serving it that
    announces its engine's ``pooling_type`` (vLLM's PoolerConfig names; vectors normalized)."""
    for w in (state.status or {}).get("workers") or []:
        info = w.get("info") or {}
        engine = info.get("engine") or {}
        kind = engine.get("pooling_type")
        served = w.get("model") == name or name == state.model_info.served_name
        if served and isinstance(kind, str) and not info.get("synthetic"):
            return {"pooling_type": kind, "normalize": True}
    return None
