"""Hostile HTTP at the gateway (issue 11, items 10 and 11) and loopback-only listening sockets.

Stack: broker + recorder + one synthetic worker (interactive lane) + `laneserve api` with an API
key and the real SmolLM2 tokenizer (so over-length prompts are counted at the edge), started
with the gateway's default host. The synthetic worker is enough: these tests are about what the
edge accepts, not about real tokens.

- item 10: ``LANESERVE_HTTP_FUZZ_N`` (default 600) random requests — bad JSON, wrong types,
  huge headers and bodies, negative and enormous numbers, unknown routes and methods — plus
  hand-made raw HTTP. Every answer is 2xx for a valid request and 4xx otherwise; never a 5xx,
  and the gateway and the worker stay up and keep serving.
- item 11: over-length and empty prompts, ``max_tokens`` 0, ``n`` over the limit, impossible
  logprobs and token ids -> the documented 4xx (OpenAI error JSON with laneserve's code) or a
  valid output.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from tests.harness import Stack

pytestmark = pytest.mark.slow

API_KEY = "reliability-key-0123456789"
HTTP_FUZZ_N = int(os.environ.get("LANESERVE_HTTP_FUZZ_N", "600"))
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MODEL = "smollm2"


@pytest.fixture(scope="module")
def api(smollm2_gguf) -> Iterator[Stack]:
    tmp = Path(tempfile.mkdtemp(prefix="lsh", dir="/tmp"))
    stack = Stack(tmp, liveness=25)
    try:
        stack.start_recorder()
        stack.start_broker("--recorder", stack.recorder_addr)
        stack.start_worker(
            "synth", "--synthetic-step-ms", "2", "--capacity", "32", lanes="interactive"
        )
        stack.start_api(
            "--api-key", API_KEY, "--model", str(smollm2_gguf), "--served-model-name", MODEL
        )
        stack.wait_workers({"synth"})
        stack.wait_api()
        yield stack
    finally:
        stack.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def _chat(client: httpx.Client, body: dict, **kw) -> httpx.Response:
    return client.post("/v1/chat/completions", json=body, headers=AUTH, **kw)


def _valid_chat() -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def _assert_serving(stack: Stack) -> None:
    for name in ("api", "broker", "worker-synth", "recorder"):
        assert stack.alive(name), f"{name} died:\n{stack.logs()}"
    with httpx.Client(base_url=stack.url, timeout=20) as c:
        r = _chat(c, _valid_chat())
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"]


def _error_code(r: httpx.Response) -> str | None:
    try:
        return r.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


# ---------------------------------------------------------------------------------- binding


def test_every_stack_process_listens_on_loopback_only(api) -> None:
    listening = {}
    for name, proc in api.procs.items():
        conns = psutil.Process(proc.pid).net_connections(kind="inet")
        listening[name] = [c.laddr.ip for c in conns if c.status == psutil.CONN_LISTEN]
    assert listening["api"] == ["127.0.0.1"], listening  # the gateway's default host
    others = [ip for name, ips in listening.items() if name != "api" for ip in ips]
    assert others == [], listening  # broker, recorder and worker use ipc:// only


# ---------------------------------------------------------------------------------- item 11


EDGE_CASES = [
    # (name, route, body, allowed statuses, expected error code when 4xx)
    ("empty prompt", "/v1/completions", {"prompt": ""}, {400}, "invalid_request"),
    ("empty prompt list", "/v1/completions", {"prompt": []}, {400}, "invalid_request"),
    ("empty token list", "/v1/completions", {"prompt": [[]]}, {400}, "invalid_request"),
    ("empty messages", "/v1/chat/completions", {"messages": []}, {400}, "invalid_request"),
    (
        "empty message content",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": ""}], "max_tokens": 3},
        {200, 400},
        "invalid_request",
    ),
    (
        "over-length prompt",
        "/v1/completions",
        {"prompt": "hello " * 9000},
        {400},
        "prompt_too_long",
    ),
    (
        "over-length chat",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "word " * 9000}]},
        {400},
        "prompt_too_long",
    ),
    (
        "prompt + max_tokens over max_model_len",
        "/v1/completions",
        {"prompt": "hi", "max_tokens": 4096 * 4},
        {400},
        None,
    ),
    (
        "max_tokens 0",
        "/v1/completions",
        {"prompt": "hi", "max_tokens": 0},
        {400},
        "invalid_request",
    ),
    ("max_tokens -1", "/v1/completions", {"prompt": "hi", "max_tokens": -1}, {400}, None),
    ("max_tokens 1e30", "/v1/completions", {"prompt": "hi", "max_tokens": 10**30}, {400}, None),
    ("max_tokens float", "/v1/completions", {"prompt": "hi", "max_tokens": 2.5}, {400}, None),
    ("n over the limit", "/v1/completions", {"prompt": "hi", "n": 17}, {400}, "invalid_request"),
    ("n 0", "/v1/completions", {"prompt": "hi", "n": 0}, {400}, "invalid_request"),
    ("n 10**9", "/v1/completions", {"prompt": "hi", "n": 10**9}, {400}, "invalid_request"),
    ("n at the limit", "/v1/completions", {"prompt": "hi", "n": 16, "max_tokens": 2}, {200}, None),
    ("logprobs 6 (legacy)", "/v1/completions", {"prompt": "hi", "logprobs": 6}, {400}, None),
    ("logprobs -1", "/v1/completions", {"prompt": "hi", "logprobs": -1}, {400}, None),
    ("logprobs true (legacy)", "/v1/completions", {"prompt": "hi", "logprobs": True}, {400}, None),
    (
        "top_logprobs 21",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
        {400},
        "invalid_request",
    ),
    (
        "top_logprobs without logprobs",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3},
        {400},
        "invalid_request",
    ),
    (
        "logprobs as string",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "logprobs": "yes"},
        {400},
        "invalid_request",
    ),
    (
        "token id outside the vocabulary",
        "/v1/completions",
        {"prompt": [5, 10**9]},
        {400},
        "invalid_request",
    ),
    ("negative token id", "/v1/completions", {"prompt": [5, -3]}, {400}, "invalid_request"),
    (
        "logprobs 5 (valid)",
        "/v1/completions",
        {"prompt": "hi", "logprobs": 5, "max_tokens": 2},
        {200},
        None,
    ),
    ("temperature -1", "/v1/completions", {"prompt": "hi", "temperature": -1}, {400}, None),
    ("top_p 7", "/v1/completions", {"prompt": "hi", "top_p": 7}, {400}, None),
    ("stop 100 strings", "/v1/completions", {"prompt": "hi", "stop": ["x"] * 100}, {400}, None),
    (
        "seed 2**80",
        "/v1/completions",
        {"prompt": "hi", "seed": 2**80, "max_tokens": 2},
        {400},
        None,
    ),
]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_edge_inputs_get_documented_4xx_or_valid_output(api, stream) -> None:
    failures = []
    with httpx.Client(base_url=api.url, timeout=30) as c:
        for name, route, body, allowed, code in EDGE_CASES:
            r = c.post(route, json={"model": MODEL, "stream": stream, **body}, headers=AUTH)
            if r.status_code not in allowed:
                failures.append((name, r.status_code, r.text[:300]))
                continue
            if r.status_code >= 400:
                got = _error_code(r)
                err = r.json()["error"]
                if (code and got != code) or not err.get("message"):
                    failures.append((name, r.status_code, r.text[:300]))
            elif stream:
                assert r.headers["content-type"].startswith("text/event-stream"), name
                assert r.text.rstrip().endswith("data: [DONE]"), (name, r.text[-300:])
            else:
                choices = r.json()["choices"]
                n = body.get("n", 1)
                assert len(choices) == n and {ch["index"] for ch in choices} == set(range(n))
                if body.get("logprobs") == 5:
                    assert choices[0]["logprobs"] is not None, r.text[:500]
    assert failures == [], "\n".join(map(str, failures))
    _assert_serving(api)


# ---------------------------------------------------------------------------------- item 10

_ROUTES = [
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("GET", "/v1/models"),
    ("GET", "/v1/batches"),
    ("POST", "/v1/batches"),
    ("GET", "/v1/batches/batch_nope"),
    ("POST", "/v1/batches/batch_nope/cancel"),
    ("POST", "/v1/files"),
    ("GET", "/v1/files/file-nope/content"),
    ("GET", "/v1/files"),
    ("GET", "/v1/files/file-nope"),
    ("DELETE", "/v1/files/file-nope"),
    ("GET", "/v1/batches/batch_nope/stats"),
    ("GET", "/status"),
    ("GET", "/metrics"),
    ("GET", "/v1/models/smollm2"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
]
_ODD_PATHS = [
    "/",
    "/v2/chat/completions",
    "/v1/chat/completions/x",
    "/v1/../../etc/passwd",
    "/%00",
    "/v1/files/" + "a" * 5000,
    "/v1/batches/%ff%fe",
    "/health/..",
    "/admin",
]
_NUMBERS = [-1, 0, -(10**30), 10**30, 10**400, 1e308, -1e308, 0.5, -0.0]
_ODD = [None, True, "x", "", [], {}, [1, "a", None], {"a": {"b": {}}}, "\u0000\ud7ff\ufffd"]
_FIELDS = [
    "max_tokens",
    "n",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "logprobs",
    "top_logprobs",
    "stop",
    "stream",
    "messages",
    "prompt",
    "model",
    "lane",
    "priority",
    "presence_penalty",
    "stream_options",
    "max_completion_tokens",
    "user",
    "frequency_penalty",
    "echo",
    "prompt_logprobs",
    "min_p",
    "logit_bias",
    "tokens",
]


def _fuzz_request(rng: random.Random) -> dict:
    """One hostile request as httpx.Client.request keyword arguments."""
    r = rng.random()
    headers = dict(AUTH) if rng.random() < 0.9 else {}
    if r < 0.1:
        method = rng.choice(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"])
        path = rng.choice(_ODD_PATHS)
        return {"method": method, "url": path, "headers": headers, "content": b"{}"}
    method, path = rng.choice(_ROUTES)
    if rng.random() < 0.1:
        method = rng.choice(["PUT", "DELETE", "PATCH"])
    r = rng.random()
    if r < 0.2:  # not JSON, truncated JSON, wrong top-level types, absurd nesting
        content = rng.choice(
            [
                rng.randbytes(rng.randint(0, 400)),
                b'{"model": "smollm2", "messages": [',
                b"[]",
                b"null",
                b'"text"',
                b"NaN",
                b'{"a": NaN, "b": Infinity}',
                b"[" * 5000 + b"]" * 5000,
                b'{"messages": ' + b"[" * 3000 + b"]" * 3000 + b"}",
                b"\xff\xfe{\x00",
                b'{"model": "smollm2", "model": 1}',
            ]
        )
        headers["Content-Type"] = rng.choice(["application/json", "text/plain", "x/y"])
        return {"method": method, "url": path, "headers": headers, "content": content}
    if r < 0.27:  # huge headers
        if rng.random() < 0.5:
            headers["X-Junk"] = "h" * rng.choice([8_000, 70_000, 300_000])
        else:
            headers.update({f"X-H{i}": "v" * 50 for i in range(rng.choice([200, 2000]))})
        return {"method": method, "url": path, "headers": headers, "json": _valid_chat()}
    if r < 0.32:  # huge bodies (the limit is 4 MiB)
        size = rng.choice([3 * 2**20, 5 * 2**20, 12 * 2**20])
        body = {"model": MODEL, "prompt": "z" * size}
        return {"method": method, "url": path, "headers": headers, "json": body}
    body = (
        _valid_chat() if "chat" in path or rng.random() < 0.5 else {"model": MODEL, "prompt": "x"}
    )
    for _ in range(rng.randint(1, 3)):
        field = rng.choice(_FIELDS)
        body[field] = rng.choice(_NUMBERS + _ODD) if rng.random() < 0.8 else rng.random() * 1e6
    if rng.random() < 0.1:
        body[rng.choice(["tools", "response_format", "bogus_field", ""])] = {"x": 1}
    if body.get("stream") is not True and rng.random() < 0.2:
        body["stream"] = True
    content = json.dumps(body, allow_nan=True).encode()
    headers["Content-Type"] = "application/json"
    return {"method": method, "url": path, "headers": headers, "content": content}


def _raw_http(port: int, data: bytes, timeout_s: float = 10.0) -> int | None:
    """Send raw bytes; the status code of the answer, or None when the server just closed."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        buf = b""
        try:
            while b"\r\n" not in buf:
                chunk = s.recv(4096)
                if not chunk:
                    break
                buf += chunk
        except (TimeoutError, ConnectionResetError):
            return None
    if not buf.startswith(b"HTTP/1."):
        return None
    return int(buf.split(b" ", 2)[1])


_RAW = [
    b"GARBAGE\r\n\r\n",
    b"GET / HTTP/9.9\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n{}",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999999999999\r\n\r\n{}",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 7\r\n\r\n{}",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"prompt":',
    b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header Without Colon\r\n\r\n",
    b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(200),  # a TLS ClientHello
]


def test_http_fuzz_only_4xx_and_the_stack_keeps_serving(api) -> None:
    rng = random.Random(11)
    statuses: Counter[int] = Counter()
    server_errors = []
    t0 = time.monotonic()
    with httpx.Client(base_url=api.url, timeout=30) as c:
        for i in range(HTTP_FUZZ_N):
            assert time.monotonic() - t0 < 240, "HTTP fuzz over its time bound"
            kw = _fuzz_request(rng)
            try:
                r = c.request(**kw)
            except httpx.RemoteProtocolError:
                statuses[0] += 1  # the server closed the connection (h11 refused it): fine
                continue
            statuses[r.status_code] += 1
            if r.status_code >= 500 or r.status_code < 200:
                server_errors.append((i, kw["method"], kw["url"][:80], r.status_code, r.text[:200]))
            elif r.status_code >= 400:
                assert "error" in r.json() or r.status_code in (405, 431), r.text[:200]
            if i % 100 == 99:
                assert api.alive("api") and api.alive("worker-synth"), api.logs()
    raw = {i: _raw_http(api.port, data) for i, data in enumerate(_RAW)}
    bad_raw = {i: s for i, s in raw.items() if s is not None and not 400 <= s < 500}
    assert server_errors == [], server_errors[:10]
    assert bad_raw == {}, raw
    assert statuses[200] > 0 and sum(v for k, v in statuses.items() if 400 <= k < 500) > 0
    _assert_serving(api)
    st = api.status()
    assert [w["worker_id"] for w in st["workers"]] == ["synth"]
    print({"http_fuzz_requests": HTTP_FUZZ_N, "statuses": dict(statuses), "raw": raw})
