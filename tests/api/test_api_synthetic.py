"""The gateway as a real process with the official `openai` client, behind a real broker,
recorder and synthetic worker (fake tokens " w0 w1 ...", no model weights)."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import subprocess
import sys
import time

import httpx
import openai
import pytest

from tests.harness import API_KEY, ROOT, Stack

pytestmark = pytest.mark.slow

MODEL = "smollm2"
MSG = [{"role": "user", "content": "Say hi."}]
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture
def client(synth_stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=synth_stack.url + "/v1", api_key=API_KEY, max_retries=0)


def test_chat_non_streamed_and_streamed(client, synth_stack) -> None:
    r = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=5)
    assert r.object == "chat.completion" and r.model == MODEL
    assert r.choices[0].message.content == " w0 w1 w2 w3 w4"
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + 5
    assert r.usage.prompt_tokens_details.cached_tokens == 0

    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=MSG,
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert len({c.id for c in chunks}) == 1


def test_completion_forms_and_n_fan_out(client) -> None:
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=3)
    assert r.object == "text_completion" and r.choices[0].text == " w0 w1 w2"
    r = client.completions.create(model=MODEL, prompt=["a b", "c"], max_tokens=2, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.usage.completion_tokens == 8
    r = client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=2)
    assert len(r.choices) == 1 and r.usage.prompt_tokens == 3
    r = client.completions.create(model=MODEL, prompt=[[1, 2], [3]], max_tokens=2)
    assert len(r.choices) == 2 and r.usage.prompt_tokens == 3
    stream = client.completions.create(
        model=MODEL, prompt="x", max_tokens=3, n=2, stream=True, seed=5
    )
    texts: dict[int, str] = {}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    # the synthetic engine's token i is (seed + i) % 1000: n fans out with seed + j
    assert texts == {0: " w5 w6 w7", 1: " w6 w7 w8"}


def test_response_id_is_the_sql_request_id(client, synth_stack) -> None:
    r = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=2)
    deadline = time.monotonic() + 20
    row = None
    while time.monotonic() < deadline and row is None:
        with sqlite3.connect(synth_stack.db_path) as db:
            row = db.execute(
                "SELECT id, lane, completion_tokens, ttft_ms, e2e_ms FROM requests WHERE id = ?",
                (r.id,),
            ).fetchone()
        time.sleep(0.2)
    assert row is not None, synth_stack.logs()
    assert row[0] == r.id and row[1] == "interactive" and row[2] == 2
    assert row[3] is not None and row[4] >= row[3] > 0


def test_service_tier_picks_the_lane(client, synth_stack) -> None:
    """OpenAI's own `service_tier` chooses the lane from an unmodified SDK call: "priority" and
    "default" are interactive (served and recorded so, the response's `service_tier` saying
    "default", the tier of that lane); "flex" is the batch lane, which no
    worker of this stack serves (503 no_worker); an unknown tier is a 400 naming the field."""
    ids = []
    for tier in ("priority", "default", "auto"):
        r = client.chat.completions.create(
            model=MODEL, messages=MSG, max_tokens=1, service_tier=tier
        )
        assert r.choices[0].message.content == " w0"
        assert r.service_tier == "default"  # the tier that served it, as OpenAI echoes
        ids.append(r.id)
    chunks = list(client.completions.create(model=MODEL, prompt="hi", max_tokens=2, stream=True))
    assert chunks and {c.service_tier for c in chunks} == {"default"}
    with pytest.raises(openai.APIStatusError) as exc:
        client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=1, service_tier="flex")
    assert exc.value.status_code == 503 and exc.value.body["code"] == "no_worker"
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL, prompt="hi", extra_body={"service_tier": "gold"})
    assert exc.value.body["param"] == "service_tier"
    with pytest.raises(openai.BadRequestError) as exc:  # contradicting the laneserve extra
        client.chat.completions.create(
            model=MODEL, messages=MSG, service_tier="flex", extra_body={"lane": "interactive"}
        )
    assert exc.value.body["param"] == "service_tier"
    deadline = time.monotonic() + 20
    lanes: list = []
    while time.monotonic() < deadline and len(lanes) < len(ids):
        with sqlite3.connect(synth_stack.db_path) as db:
            marks = ",".join("?" * len(ids))
            lanes = db.execute(f"SELECT lane FROM requests WHERE id IN ({marks})", ids).fetchall()
        time.sleep(0.2)
    assert sorted(lanes) == [("interactive",)] * 3, synth_stack.logs()


def _post(stack: Stack, path: str, body, headers=AUTH) -> httpx.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(stack.url + path, content=data, headers=headers, timeout=30)


@pytest.mark.parametrize(
    ("path", "body", "status", "code", "param"),
    [
        ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "invalid_request", "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": []}, 400, "invalid_request", "prompt"),
        ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "invalid_request", "messages"),
        ("/v1/completions", {"model": MODEL, "prompt": "hello " * 9000}, 400, "prompt_too_long", "prompt"),
        ("/v1/chat/completions", {"model": MODEL, "messages": MSG, "max_tokens": 100000}, 400, "invalid_request", "max_tokens"),
        ("/v1/completions", {"model": MODEL, "prompt": "hello " * 8000, "max_tokens": 500}, 400, "invalid_request", "max_tokens"),
        ("/v1/chat/completions", {"model": MODEL, "messages": MSG, "n": 1000}, 400, "invalid_request", "n"),
        ("/v1/chat/completions", {"model": "gpt-4o", "messages": MSG}, 404, "not_found", "model"),
        ("/v1/chat/completions", b'{"model": "smollm2", "messages": [', 400, "invalid_request", None),
        ("/v1/chat/completions", {"model": MODEL, "messages": MSG, "temperature": "hot"}, 400, "invalid_request", "temperature"),
        ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, 400, "invalid_request", "messages"),
        ("/v1/completions", {"model": MODEL, "prompt": [1, 2, 10**9]}, 400, "invalid_request", "prompt"),
        ("/v1/chat/completions", {"model": MODEL, "messages": MSG, "tools": [{"type": "function"}]}, 400, "invalid_request", "tools"),
        ("/v1/chat/completions", {"model": MODEL, "messages": MSG, "stream": True, "lane": "batch"}, 503, "no_worker", None),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x" * 5_000_000}]}, 413, "payload_too_large", None),
        # unpaired UTF-16 surrogates (json.dumps writes the lone \ud800 escape): once a 500
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "a \ud800"}]}, 400, "invalid_request", None),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "stop": ["\udfff"]}, 400, "invalid_request", None),
        ("/tokenize", {"model": MODEL, "prompt": "\ud800"}, 400, "invalid_request", None),
    ],
)  # fmt: skip
def test_documented_4xx_then_still_serving(synth_stack, client, path, body, status, code, param):
    r = _post(synth_stack, path, body)
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")  # never a started stream
    err = r.json()["error"]
    assert err["code"] == code and err["param"] == param and err["message"]
    r = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=1)
    assert r.choices[0].message.content == " w0"


def _route_table(stack: Stack) -> list[tuple[str, str]]:
    """Every (method, path) the app serves, from the app object itself."""
    from laneserve.api.app import create_app
    from laneserve.api.config import ApiConfig

    app = create_app(ApiConfig(broker="ipc:///unused", api_key="k"))
    routes = []
    for route in app.router.routes:
        for method in sorted(getattr(route, "methods", None) or ()):
            path = route.path.replace("{file_id}", "file-x").replace("{batch_id}", "batch_x")
            routes.append((method, path))
    return routes


def test_every_route_but_health_refuses_missing_or_wrong_key(synth_stack) -> None:
    routes = _route_table(synth_stack)
    assert ("POST", "/v1/chat/completions") in routes and ("GET", "/metrics") in routes
    assert len(routes) >= 13
    checked = 0
    probes = ("/health", "/ready")  # open to probes, no key (laneserve.api.health)
    expected = 2 * (len([r for r in routes if r[1] not in probes]) + 2)
    for method, path in [*routes, ("GET", "/no/such/route"), ("POST", "/v1/embeddings")]:
        for headers in ({}, {"Authorization": "Bearer wrong-key"}):
            r = httpx.request(method, synth_stack.url + path, headers=headers, timeout=10)
            if path in probes:
                assert r.status_code in (200, 503)  # /ready: 503 here, no batch-lane worker
            else:
                assert r.status_code == 401, (method, path, r.status_code)
                assert r.json()["error"]["code"] == "unauthorized"
                checked += 1
    assert checked == expected
    assert httpx.get(synth_stack.url + "/v1/models", headers=AUTH).status_code == 200


def test_overloaded_interactive_lane_is_429(synth_stack) -> None:
    """Capacity 8 + broker queue 24: of 48 concurrent requests some must get 429."""

    async def one(c: httpx.AsyncClient) -> int:
        body = {"model": MODEL, "messages": MSG, "max_tokens": 40, "stream": True}
        async with c.stream("POST", "/v1/chat/completions", json=body, headers=AUTH) as r:
            if r.status_code == 429:
                assert r.headers["retry-after"]
                assert json.loads(await r.aread())["error"]["code"] == "overloaded"
            else:
                async for _ in r.aiter_bytes():
                    pass
            return r.status_code

    async def main() -> list[int]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=synth_stack.url, timeout=60, limits=limits) as c:
            return await asyncio.gather(*(one(c) for _ in range(48)))

    codes = asyncio.run(asyncio.wait_for(main(), 120))
    assert set(codes) <= {200, 429} and codes.count(429) > 0 and codes.count(200) >= 8, codes


CLIENTS = """
import sys, threading, time, httpx
url, key, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
started = []
def one():
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2000, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60,
                      headers={"Authorization": "Bearer " + key}) as r:
        for chunk in r.iter_bytes():
            started.append(1)
            break
        for chunk in r.iter_bytes():
            pass
for _ in range(n):
    threading.Thread(target=one, daemon=True).start()
while len(started) < n:
    time.sleep(0.01)
print("streaming", flush=True)
time.sleep(600)
"""


def kill_streaming_clients(stack: Stack, n: int, after_s: float) -> None:
    """Start n streaming clients in one process; SIGKILL it `after_s` after all stream."""
    proc = subprocess.Popen(
        [sys.executable, "-c", CLIENTS, stack.url, API_KEY, str(n)],
        stdout=subprocess.PIPE,
        cwd=ROOT,
    )
    try:
        assert proc.stdout.readline().strip() == b"streaming"
        time.sleep(after_s)
    finally:
        proc.kill()
        proc.wait()


def worker_load(stack: Stack) -> dict:
    return stack.status()["workers"][0]["load"]


def wait_idle(stack: Stack, timeout_s: float = 30.0) -> dict:
    """Wait until the broker holds nothing and the worker runs nothing; return its load."""
    deadline = time.monotonic() + timeout_s
    st: dict = {}
    while time.monotonic() < deadline:
        st = stack.status()
        load = st["workers"][0]["load"]
        if st["queues"]["in_flight"] == 0 and load.get("num_running") == 0:
            time.sleep(0.6)  # one more stats report (every 0.25 s) after the last step
            return worker_load(stack)
        time.sleep(0.1)
    raise AssertionError(f"not idle: {st}")


def test_killed_streaming_clients_free_their_kv_blocks(synth_stack) -> None:
    load = wait_idle(synth_stack)
    baseline = load["num_free_blocks"]
    assert baseline == load["num_total_blocks"]
    aborted_before = synth_stack.status()["counters"].get("aborted", 0)
    kill_streaming_clients(synth_stack, 8, 0.5)
    deadline = time.monotonic() + 15
    load = {}
    while time.monotonic() < deadline:
        load = worker_load(synth_stack)
        st = synth_stack.status()
        if load["num_free_blocks"] == baseline and st["queues"]["in_flight"] == 0:
            break
        time.sleep(0.1)
    assert load["num_free_blocks"] == baseline and load["num_running"] == 0, load
    assert synth_stack.status()["counters"].get("aborted", 0) - aborted_before == 8


def test_client_gone_before_first_byte_aborts_queued_request(synth_stack) -> None:
    """8 streams fill the worker (capacity 8); a 9th waits in the broker's queue without any
    byte sent. Closing all 9 connections aborts all 9 requests."""
    wait_idle(synth_stack)
    aborted_before = synth_stack.status()["counters"].get("aborted", 0)
    body = json.dumps({"model": MODEL, "messages": MSG, "max_tokens": 2000, "stream": True})
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Authorization: Bearer {API_KEY}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )

    async def main() -> dict:
        conns = []
        for _ in range(9):  # raw sockets: closing one is a real TCP close
            reader, writer = await asyncio.open_connection("127.0.0.1", synth_stack.port)
            writer.write((head + body).encode())
            await writer.drain()
            conns.append(writer)
        st: dict = {}
        for _ in range(100):
            await asyncio.sleep(0.1)
            st = await asyncio.to_thread(synth_stack.status)
            if st["queues"]["in_flight"] == 8 and st["queues"]["interactive"] == 1:
                break
        for writer in conns:
            writer.close()
        return st

    st = asyncio.run(asyncio.wait_for(main(), 60))
    assert st["queues"]["interactive"] == 1, st["queues"]
    wait_idle(synth_stack)
    st = synth_stack.status()
    assert st["queues"]["interactive"] == 0
    assert st["counters"].get("aborted", 0) - aborted_before == 9


def test_metrics_exposes_vllm_style_names(client, synth_stack) -> None:
    for _ in client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=3, stream=True):
        pass
    text = httpx.get(synth_stack.url + "/metrics", headers=AUTH).text
    for name in (
        'laneserve:time_to_first_token_seconds_count{lane="interactive",model_name="smollm2"}',
        'laneserve:inter_token_latency_seconds_count{lane="interactive",model_name="smollm2"}',
        'laneserve:e2e_request_latency_seconds_count{lane="interactive",model_name="smollm2"}',
        'laneserve:request_queue_time_seconds_count{lane="interactive",model_name="smollm2"}',
        'laneserve:request_prefill_time_seconds_count{lane="interactive",model_name="smollm2"}',
        'laneserve:request_decode_time_seconds_count{lane="interactive",model_name="smollm2"}',
        'laneserve:num_requests_running{model_name="smollm2",worker_id="synth"}',
        'laneserve:num_requests_waiting{model_name="smollm2",worker_id="synth"}',
        'laneserve:kv_cache_usage_perc{model_name="smollm2",worker_id="synth"}',
        'laneserve:prefix_cache_hits_total{model_name="smollm2",worker_id="synth"}',
        'laneserve:prefix_cache_queries_total{model_name="smollm2",worker_id="synth"}',
        'laneserve:num_preemptions_total{model_name="smollm2",worker_id="synth"}',
        'laneserve:spec_decode_num_draft_tokens_total{model_name="smollm2",worker_id="synth"}',
        'laneserve:spec_decode_num_accepted_tokens_total{model_name="smollm2",worker_id="synth"}',
        'laneserve:spec_decode_num_drafts_total{model_name="smollm2",worker_id="synth"}',
        'laneserve:prompt_tokens_total{lane="interactive",model_name="smollm2"}',
        'laneserve:generation_tokens_total{lane="interactive",model_name="smollm2"}',
        'laneserve:num_workers{lane="interactive",model_name="smollm2"} 1.0',
        'laneserve:num_workers{lane="batch",model_name="smollm2"} 0.0',
    ):
        assert name in text, name
    ttft = [ln for ln in text.splitlines() if ln.startswith(
        'laneserve:time_to_first_token_seconds_count{lane="interactive",model_name="smollm2"}')]  # fmt: skip
    assert float(ttft[0].split()[-1]) >= 1


def test_files_and_batches_with_the_sdk(client, tmp_path) -> None:
    lines = [
        {
            "custom_id": f"r{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": MSG, "max_tokens": 2},
        }
        for i in range(3)
    ]
    data = "".join(json.dumps(x) + "\n" for x in lines).encode()
    f = client.files.create(file=("in.jsonl", data), purpose="batch")
    assert f.id.startswith("file-") and f.bytes == len(data) and f.purpose == "batch"
    assert client.files.retrieve(f.id).filename == "in.jsonl"
    assert client.files.content(f.id).content == data
    b = client.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert b.status == "validating" and b.input_file_id == f.id
    assert client.batches.retrieve(b.id).id == b.id
    assert b.id in [x.id for x in client.batches.list(limit=10).data]
    assert client.batches.cancel(b.id).status == "cancelling"
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nope")
    with pytest.raises(openai.NotFoundError):
        client.files.content("file-nope")
    with pytest.raises(openai.BadRequestError) as bad:
        client.batches.create(
            input_file_id=f.id, endpoint="/v1/moderations", completion_window="24h"
        )
    assert bad.value.param == "endpoint"
    # a task's max_tokens above the gateway's cap is the job's 400, not an error on every line;
    # the error names the field, and a value echoes as JSON spells it
    for value, message in ((5000, "max_tokens must be <= 4096, got 5000"),
                           (True, "max_tokens must be a positive integer, got true")):  # fmt: skip
        with pytest.raises(openai.BadRequestError, match=message) as bad:
            client.batches.create(
                input_file_id=f.id,
                endpoint="/v1/chat/completions",
                completion_window="24h",
                extra_body={"task": "summarize", "task_options": {"max_tokens": value}},
            )
        assert bad.value.param == "task_options.max_tokens"


def test_batch_round_trip_with_the_sdk(client, synth_stack, smollm2_gguf) -> None:
    """Upload -> batch -> the jobs runner runs it on a batch-lane worker -> output file."""
    stack = synth_stack
    stack.start_worker("batchw", "--synthetic", "--capacity", "8", lanes="batch")
    stack.start_jobs_runner(
        "--model", str(smollm2_gguf), "--model-name", MODEL, "--no-length-check"
    )
    try:
        stack.wait_workers({"synth", "batchw"})
        lines = [
            {
                "custom_id": f"r{i}",
                "method": "POST",
                "url": "/v1/completions",
                "body": {"model": MODEL, "prompt": f"line {i}", "max_tokens": 2},
            }
            for i in range(4)
        ]
        data = "".join(json.dumps(x) + "\n" for x in lines).encode()
        f = client.files.create(file=("in.jsonl", data), purpose="batch")
        b = client.batches.create(
            input_file_id=f.id, endpoint="/v1/completions", completion_window="24h"
        )
        deadline = time.monotonic() + 90
        while b.status not in ("completed", "failed", "cancelled", "expired"):
            assert time.monotonic() < deadline, (b, stack.logs())
            time.sleep(0.3)
            b = client.batches.retrieve(b.id)
        assert b.status == "completed", (b, stack.logs())
        assert b.request_counts.total == 4 and b.request_counts.completed == 4
        out = client.files.content(b.output_file_id).content.decode().splitlines()
        results = {json.loads(x)["custom_id"]: json.loads(x) for x in out}
        assert sorted(results) == ["r0", "r1", "r2", "r3"]
        body = results["r0"]["response"]["body"]
        assert body["choices"][0]["text"] == " w0 w1"
        listed = [x.id for x in client.batches.list(limit=100).data]
        assert b.id in listed
        # the job's lines count in the gateway's /metrics (from SQL), in the batch lane
        text = httpx.get(stack.url + "/metrics", headers=AUTH, timeout=10).text
        series = {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
                  if ln.startswith("laneserve:job_")}  # fmt: skip
        assert (
            series['laneserve:job_lines{lane="batch",model_name="smollm2",status="completed"}'] >= 4
        ), series
        assert series['laneserve:job_generation_tokens{lane="batch",model_name="smollm2"}'] >= 8, (
            series
        )
    finally:
        stack.stop_proc("jobs-runner")
        stack.stop_proc("worker-batchw")
