"""`/v1/files` list / retrieve / delete with the official `openai` client on a real stack
(broker, synthetic workers, gateway; a jobs runner for the batch part)."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from tests.harness import API_KEY, Stack

MODEL = "smollm2"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client(synth_stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=synth_stack.url + "/v1", api_key=API_KEY, max_retries=0)


def _jsonl(n: int, tag: str) -> bytes:
    lines = [
        {
            "custom_id": f"{tag}{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": MODEL, "prompt": f"{tag} {i}", "max_tokens": 2},
        }
        for i in range(n)
    ]
    return "".join(json.dumps(x) + "\n" for x in lines).encode()


def _wait_batch(client: openai.OpenAI, batch_id: str, statuses: set[str], stack: Stack):
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        time.sleep(0.2)
    raise AssertionError(f"batch {batch_id} not in {statuses}:\n{stack.logs()}")


def test_list_retrieve_delete_and_in_use_conflict(client, synth_stack, smollm2_gguf) -> None:
    uploads = [client.files.create(file=(f"in{i}.jsonl", _jsonl(2, f"u{i}")), purpose="batch")
               for i in range(5)]  # fmt: skip
    ids = [f.id for f in uploads]

    # newest first by default; pages of 2 follow `after` (the SDK's auto-pagination)
    page = client.files.list(limit=2)
    assert [f.id for f in page.data] == ids[::-1][:2]
    assert page.has_more is True
    assert [f.id for f in client.files.list(limit=2)] == ids[::-1]  # iterates every page
    asc = client.files.list(limit=3, order="asc")
    assert [f.id for f in asc.data] == ids[:3] and asc.has_more is True
    rest = client.files.list(limit=3, order="asc", after=ids[2])
    assert [f.id for f in rest.data] == ids[3:] and rest.has_more is False
    assert client.files.list(purpose="batch_output").data == []

    got = client.files.retrieve(ids[0])
    assert (got.id, got.filename, got.purpose, got.bytes) == (
        ids[0],
        "in0.jsonl",
        "batch",
        len(_jsonl(2, "u0")),
    )

    # a batch that has not ended holds its input (no jobs runner yet: it stays `validating`)
    held = client.batches.create(
        input_file_id=ids[1], endpoint="/v1/completions", completion_window="24h"
    )
    with pytest.raises(openai.ConflictError) as exc:
        client.files.delete(ids[1])
    assert held.id in str(exc.value) and exc.value.status_code == 409
    assert client.files.content(ids[1]).content == _jsonl(2, "u1")  # still there

    # every files route needs the key
    for method in ("GET", "DELETE"):
        r = httpx.request(method, f"{synth_stack.url}/v1/files/{ids[0]}", timeout=10)
        assert r.status_code == 401, (method, r.text)
    assert httpx.get(f"{synth_stack.url}/v1/files", timeout=10).status_code == 401
    assert client.files.retrieve(ids[0]).id == ids[0]

    deleted = client.files.delete(ids[0])
    assert (deleted.id, deleted.object, deleted.deleted) == (ids[0], "file", True)
    with pytest.raises(openai.NotFoundError):
        client.files.content(ids[0])
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(ids[0])
    with pytest.raises(openai.NotFoundError):
        client.files.delete(ids[0])
    assert ids[0] not in [f.id for f in client.files.list()]

    # the jobs runner ends the held batch (cancelled) and runs another: then the input can go,
    # and the output file lists under purpose batch_output
    client.batches.cancel(held.id)
    synth_stack.start_worker("batchw", "--synthetic", "--capacity", "8", lanes="batch")
    synth_stack.start_jobs_runner(
        "--model", str(smollm2_gguf), "--model-name", MODEL, "--no-length-check"
    )
    synth_stack.wait_workers({"synth", "batchw"})
    run = client.batches.create(
        input_file_id=ids[2], endpoint="/v1/completions", completion_window="24h"
    )
    cancelled = _wait_batch(client, held.id, {"cancelled"}, synth_stack)
    done = _wait_batch(client, run.id, {"completed", "failed"}, synth_stack)
    assert done.status == "completed" and done.output_file_id, synth_stack.logs()
    usage = done.usage  # OpenAI's batch usage: the lines' tokens (it was null)
    assert usage is not None and usage.output_tokens > 0 and usage.input_tokens > 0, done
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    auth = {"Authorization": f"Bearer {API_KEY}"}
    stats = httpx.get(f"{client.base_url}batches/{run.id}/stats", headers=auth).json()
    assert (usage.input_tokens, usage.output_tokens) == (
        stats["prompt_tokens"],
        stats["completion_tokens"],
    )
    # laneserve's `model` extra: a string naming a served model, or a 400 / 404 at creation
    with pytest.raises(openai.BadRequestError, match="'model' must be a non-empty string"):
        client.batches.create(input_file_id=ids[2], endpoint="/v1/completions",
                              completion_window="24h", extra_body={"model": {"a": 1}})  # fmt: skip
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id=ids[2], endpoint="/v1/completions",
                              completion_window="24h", extra_body={"model": "no-such-model"})  # fmt: skip
    produced = {done.output_file_id, cancelled.output_file_id, cancelled.error_file_id} - {None}
    assert {f.id for f in client.files.list(purpose="batch_output")} == produced
    batch_ids = {f.id for f in client.files.list(purpose="batch")}
    assert batch_ids == set(ids[1:])

    assert client.files.delete(ids[1]).deleted is True  # its batch has ended
    assert client.files.delete(done.output_file_id).deleted is True
    with pytest.raises(openai.NotFoundError):
        client.files.content(done.output_file_id)
    after = client.batches.retrieve(run.id)
    assert after.status == "completed" and after.output_file_id is None  # reference cleared

    with pytest.raises(openai.BadRequestError):
        client.files.list(order="sideways")
    with pytest.raises(openai.BadRequestError):
        client.files.list(limit=0)
