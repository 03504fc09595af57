"""The background-response heartbeat: renew this gateway's leases, run again the responses of
gateways that died.

Every ``background_lease_s / 3`` seconds (:func:`keep_leases`, started with the gateway) this
process renews the leases of the background responses it runs (:mod:`laneserve.api.response_leases`)
and stops any whose lease is gone (cancelled or deleted through another gateway). Then it claims
the responses whose lease lapsed, left ``queued`` / ``in_progress`` by a gateway process that died
(killed, its machine gone), and runs each again from its stored create body: a response is a
pure function of its input, so the re-run answers the same request (with ``temperature: 0``, the
same text). Several gateways sharing one database claim each lapsed response once.

A claimed response that cannot run again ends ``failed`` with an error object saying why: its
body was not kept (stored before re-runs existed), the body no longer validates or names a
model nobody serves now (``not_found``, as a new request would be answered), or its gateway died
under it ``MAX_RUNS`` times. While its lane has no worker (a 503), it is handed back unrun and
tried again once its lease lapses. A gateway that shuts down cleanly lets its leases go
(:func:`let_go`): they are run again at the next heartbeat of another gateway (or of this one
restarted) instead of a lease later.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

import laneserve.api.response_background as background
import laneserve.api.response_leases as leases
from laneserve.api.completions import checked_generation
from laneserve.api.errors import ApiError
from laneserve.api.files import jobs_call
from laneserve.api.responses import background_result
from laneserve.contracts.openai import responses_api as api

if TYPE_CHECKING:
    from laneserve.api.state import GatewayState

logger = logging.getLogger(__name__)

MAX_RUNS = 3  # starts of one response; a response whose gateway keeps dying then fails


async def keep_leases(state: GatewayState) -> None:
    """Renew, stop lost runs and take over lapsed responses, every third of the lease, until
    cancelled. A database that does not answer is logged and tried again at the next beat."""
    lease_s = state.config.background_lease_s
    while True:
        await asyncio.sleep(lease_s / 3)
        if state.jobs is None:
            continue
        try:
            await _renew(state, lease_s)
            claimed = await jobs_call(
                leases.claim_lapsed, state.jobs.engine, state.instance_id, lease_s
            )
            for c in claimed:
                await _resume(state, c)
        except ApiError as exc:
            logger.warning("background responses: %s", exc.message)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("background responses: the heartbeat failed")


async def let_go(state: GatewayState) -> None:
    """At shutdown: stop this process's runs and let their leases lapse at once (another
    gateway, or this one restarted, runs them again without waiting out the lease)."""
    runs, state.background = list(state.background.values()), {}
    for run in runs:
        if run.task is not None:
            run.task.cancel()
        run.gen.close()
    if runs and state.jobs is not None:
        try:
            n = await jobs_call(leases.let_go, state.jobs.engine, state.instance_id)
        except ApiError as exc:  # they lapse on their own
            logger.warning("background responses not let go: %s", exc.message)
            return
        logger.info("%d background responses let go for another gateway", n)


async def _renew(state: GatewayState, lease_s: float) -> None:
    ids = list(state.background)
    kept = await jobs_call(leases.renew, state.jobs.engine, state.instance_id, ids, lease_s)
    for resp_id in set(ids) - kept:
        run = state.background.pop(resp_id, None)
        if run is None:  # it ended meanwhile
            continue
        logger.info("background response %s: cancelled or deleted elsewhere, stopping", resp_id)
        if run.task is not None:
            run.task.cancel()
        run.gen.close()


def _cannot_run(c: leases.Claimed) -> dict | None:
    """The error object of a claimed response that must not run again; None when it may."""
    if c.request_body is None:
        return {
            "code": "server_error",
            "message": "the gateway running this background response stopped, and its request "
            "was not kept, so it cannot run again",
        }
    if c.runs > MAX_RUNS:
        return {
            "code": "server_error",
            "message": f"the gateway running this background response stopped {c.runs - 1} "
            "times; it is not run again",
        }
    return None


async def _resume(state: GatewayState, c: leases.Claimed) -> None:
    """Run claimed response ``c`` again, or end it ``failed`` when it cannot run."""
    engine, holder = state.jobs.engine, state.instance_id
    logger.warning(
        "background response %s: gateway %s stopped running it; run %d here",
        c.id,
        c.previous_owner,
        c.runs,
    )
    if c.response.get("status") in leases.TERMINAL:  # ended, lease not released: release it
        await jobs_call(leases.write_held, engine, c.id, holder, c.response, None)
        return
    error = _cannot_run(c)
    if error is None:
        try:
            run = await _rerun(state, c)
        except ApiError as exc:
            if exc.status == 503:  # no worker, broker away: not the request's fault
                logger.warning("background response %s: handed back: %s", c.id, exc.message)
                await jobs_call(leases.hand_back, engine, c.id, holder, c.runs)
                return
            error = {"code": exc.code, "message": exc.message}
    if error is not None:
        failed = {**c.response, "status": "failed", "error": error}
        await jobs_call(leases.write_held, engine, c.id, holder, failed, None)
        return
    background.follow(state, run, background_result(state, c.request_body, c.created_at))


async def _rerun(state: GatewayState, c: leases.Claimed) -> background.Running:
    """Validate the stored body again (as the create call did) and submit it under the same
    response id. Raises ApiError as the create call would."""
    body = c.request_body
    own = api.input_items(body)
    prior = c.input_items[: len(c.input_items) - len(own)]  # the earlier turns' items
    req = await asyncio.to_thread(api.parse_response_request, body, state.config.limits, prior)
    gen = await checked_generation(state, req, c.id, (time.monotonic(), time.time()))
    gen.start()
    return background.Running(gen, None, c.owner, c.input_items, body, c.created_at)


__all__ = ["MAX_RUNS", "keep_leases", "let_go"]
