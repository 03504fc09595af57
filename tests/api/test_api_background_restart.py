"""Background responses survive their gateway (real SmolLM2 worker, official `openai` client):
a response left `in_progress` by a gateway killed with SIGKILL runs again from its stored
request, on the restarted gateway (SQLite) or on another gateway sharing the database
(PostgreSQL), and completes with the text a foreground request gives (greedy, float32); a
live gateway's responses are not taken over, and cancel works on a re-run response, also
from another gateway."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator

import openai
import pytest
import sqlalchemy as sa

import laneserve.api.response_leases as leases
from laneserve.db import migrate
from laneserve.db.models import StoredResponse
from laneserve.db.session import make_engine, read_session, write_session
from tests.harness import API_KEY, Stack, free_port, real_model_stack, wait_for

pytestmark = pytest.mark.slow

MODEL = "smollm2"
ASK = {"model": MODEL, "input": "Tell me about the sea.", "max_output_tokens": 64, "temperature": 0}
LONG = {
    "model": MODEL,
    "input": "Write a long story about the sea.",
    "max_output_tokens": 2000,
    "temperature": 0,
}
ENDED = ("completed", "incomplete", "failed", "cancelled")


# Every gateway here holds its leases 2 s (not 10): a dead one's responses run again sooner.
LEASE = ("--background-lease-timeout", "2")


@pytest.fixture(scope="module")
def stack(smollm2_gguf, smollm2_dir) -> Iterator[Stack]:
    with real_model_stack(smollm2_gguf, api_extra=LEASE) as s:
        yield s


def _restart_api(stack: Stack, gguf) -> None:
    stack.start_api("--model", str(gguf), "--served-model-name", MODEL, *LEASE)
    stack.wait_api()


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)


def _row(engine: sa.Engine, resp_id: str) -> StoredResponse:
    with read_session(engine) as session:
        return session.get(StoredResponse, resp_id)


def _wait(client: openai.OpenAI, resp_id: str, statuses: tuple[str, ...], timeout_s: float):
    """Poll `GET /v1/responses/{id}` until its status is one of `statuses`."""
    last = None

    def reached():
        nonlocal last
        last = client.responses.retrieve(resp_id)
        return last if last.status in statuses else None

    try:
        return wait_for(reached, timeout_s, f"{resp_id} in {statuses}", poll_s=0.1)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; last {last}") from None


def _check_rerun(engine: sa.Engine, done, ref) -> None:
    """`done` was run twice (killed once) and answered what a foreground request answers."""
    assert done.status == ref.status == "incomplete", done  # cut at max_output_tokens
    assert done.usage.output_tokens == ASK["max_output_tokens"]  # the whole run, not a tail
    assert done.output_text and done.output_text == ref.output_text
    row = _row(engine, done.id)
    assert row.runs == 2 and row.lease_owner is None, (row.runs, row.lease_owner)


def test_a_killed_gateways_background_response_runs_again_after_restart(
    stack: Stack, smollm2_gguf
) -> None:
    client = _client(stack.url)
    first = client.responses.create(background=True, **ASK)
    long = client.responses.create(background=True, **LONG)
    _wait(client, first.id, ("in_progress", *ENDED), 30)
    stack.kill("api")
    engine = make_engine(stack.db_url)
    killed = _row(engine, first.id)
    assert killed.response["status"] == "in_progress", "ended before the kill: nothing to test"
    dead = killed.lease_owner
    _restart_api(stack, smollm2_gguf)
    done = _wait(client, first.id, ENDED, 45)  # the dead gateway's lease lapses (2 s) first
    _check_rerun(engine, done, client.responses.create(**ASK))
    # the long one runs again here too; cancel reaches the re-run
    wait_for(lambda: _row(engine, long.id).lease_owner not in (None, dead), 20, "long re-run")
    assert client.responses.cancel(long.id).status == "cancelled"
    stack.wait_status(lambda st: st["queues"]["in_flight"] == 0, 10)  # aborted at the worker
    assert client.responses.retrieve(long.id).status == "cancelled"
    # a clean shutdown lets its leases go at once: the restarted gateway takes them at its
    # first heartbeat, without waiting out the lease
    third = client.responses.create(background=True, **LONG)
    _wait(client, third.id, ("in_progress", *ENDED), 30)
    stack.stop_proc("api")  # SIGINT
    left = _row(engine, third.id)
    assert left.response["status"] == "in_progress" and left.lease_expires_at == 0.0
    _restart_api(stack, smollm2_gguf)
    wait_for(lambda: _row(engine, third.id).lease_owner != left.lease_owner, 20, "third re-run")
    assert client.responses.cancel(third.id).status == "cancelled"
    engine.dispose()


def test_a_response_that_cannot_run_again_ends_failed_with_an_error(stack: Stack) -> None:
    """Rows left by a dead gateway that must not run again: a body naming a model nobody
    serves now, a row stored without its body, one whose gateway died under it 3 times."""
    client, engine = _client(stack.url), make_engine(stack.db_url)
    key = hashlib.sha256(API_KEY.encode()).hexdigest()
    cases = {
        "resp_gone_model": ({**ASK, "model": "retired-model"}, 0, "not_found", "retired-model"),
        "resp_no_body": (None, 0, "server_error", "request was not kept"),
        "resp_died_thrice": (ASK, 2, "server_error", "stopped 3 times"),
    }
    for resp_id, (body, extra_runs, _code, _words) in cases.items():
        obj = {"id": resp_id, "object": "response", "created_at": time.time(), "status": "queued"}
        obj.update(background=True, error=None, output=[], model=MODEL)
        leases.insert(engine, key, [], obj, body, "gw-dead", lease_s=-1)
        with write_session(engine) as session:
            session.get(StoredResponse, resp_id).runs += extra_runs
    for resp_id, (_body, _runs, code, words) in cases.items():
        failed = _wait(client, resp_id, ENDED, 20)
        assert failed.status == "failed" and failed.error.code == code, failed
        assert words in failed.error.message, failed.error
        assert _row(engine, resp_id).lease_owner is None
    engine.dispose()


def _gateway(stack: Stack, name: str, db_url: str, gguf) -> str:
    port = free_port()
    args = ["--broker", stack.front, "--port", str(port), "--db", db_url, "--api-key", API_KEY]
    args += ["--model", str(gguf), "--served-model-name", MODEL]
    stack.spawn(name, ["laneserve.commands.api", *args, *LEASE])
    return f"http://127.0.0.1:{port}"


@pytest.mark.postgres
def test_another_gateway_on_the_database_takes_over_a_dead_ones_responses(
    stack: Stack, smollm2_gguf, own_pg_url
) -> None:
    migrate.upgrade(own_pg_url)
    # three gateways start at once: a (killed), b (alive throughout), c (a cancel through it)
    a, b, c = (_client(_gateway(stack, f"api-{x}", own_pg_url, smollm2_gguf)) for x in "abc")
    for client in (a, b, c):
        wait_for(lambda cl=client: _models(cl), 120, "gateway up", poll_s=0.3)
    long = b.responses.create(background=True, **LONG)  # b and c are alive: b keeps it
    first = a.responses.create(background=True, **ASK)
    _wait(a, first.id, ("in_progress", *ENDED), 30)
    stack.kill("api-a")
    engine = make_engine(own_pg_url)
    assert _row(engine, first.id).response["status"] == "in_progress", "ended before the kill"
    done = _wait(b, first.id, ENDED, 45)
    _check_rerun(engine, done, b.responses.create(**ASK))
    live = _row(engine, long.id)
    assert live.runs == 1 and live.response["status"] == "in_progress", live.response["usage"]
    # a cancel through a third gateway: b stops its run at its next renewal
    assert c.responses.cancel(long.id).status == "cancelled"
    stack.wait_status(lambda st: st["queues"]["in_flight"] == 0, 10)
    time.sleep(1.0)  # b's final write, if it made one, would come now
    assert b.responses.retrieve(long.id).status == "cancelled"
    engine.dispose()
    for name in ("api-b", "api-c"):
        stack.stop_proc(name)


def _models(client: openai.OpenAI) -> bool:
    try:
        return bool(client.models.list().data)
    except openai.APIError:
        return False
