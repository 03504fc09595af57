"""API-key middleware and body limit on a real ASGI stack (httpx ASGITransport, no network)."""

from __future__ import annotations

import asyncio

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from laneserve.api.auth import ApiKeyMiddleware, read_json
from laneserve.api.errors import ApiError, response_for

KEY = "s3cret-key"


async def echo(request: Request) -> JSONResponse:
    try:
        body = await read_json(request, 64)
    except ApiError as exc:
        return response_for(exc)
    return JSONResponse({"body": body})


async def ok(request: Request) -> JSONResponse:
    return JSONResponse({"ok": True})


def make_app() -> ApiKeyMiddleware:
    app = Starlette(routes=[Route("/health", ok), Route("/echo", echo, methods=["POST"])])
    return ApiKeyMiddleware(app, KEY)


def call(method: str, path: str, **kw) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=make_app())
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return await c.request(method, path, **kw)

    return asyncio.run(go())


def test_key_required_except_health() -> None:
    assert call("GET", "/health").status_code == 200
    for headers in (
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": f"Basic {KEY}"},
        {"Authorization": KEY},
        {"Authorization": f"Bearer {KEY}x"},
        {"Authorization": f"Bearer {KEY[:-1]}"},
    ):
        r = call("POST", "/echo", json={"a": 1}, headers=headers)
        assert r.status_code == 401, headers
        assert r.json()["error"]["code"] == "unauthorized"
    # unknown paths answer 401 too, so routes cannot be enumerated without the key
    assert call("GET", "/nope").status_code == 401
    good = {"Authorization": f"Bearer {KEY}"}
    assert call("POST", "/echo", json={"a": 1}, headers=good).json() == {"body": {"a": 1}}
    assert call("POST", "/echo", json={"a": 1}, headers={"authorization": f"bearer {KEY}"}).json()
    assert call("GET", "/nope", headers=good).status_code == 404


def test_body_limit_and_bad_json() -> None:
    good = {"Authorization": f"Bearer {KEY}"}
    r = call("POST", "/echo", content=b'{"a": "' + b"x" * 100 + b'"}', headers=good)
    assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"

    async def chunks():  # no Content-Length: counted while reading
        for _ in range(10):
            yield b"x" * 10

    r = call("POST", "/echo", content=chunks(), headers=good)
    assert r.status_code == 413
    r = call("POST", "/echo", content=b"{not json", headers=good)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"
    # JSON with an unpaired UTF-16 surrogate parses, but has no UTF-8 form: a 400 naming it
    r = call("POST", "/echo", content=b'{"m": ["ok", "x\\ud800"]}', headers=good)
    assert r.status_code == 400 and "m[1]" in r.json()["error"]["message"], r.text
    r = call("POST", "/echo", content=b'{"m": "\\ud83d\\ude00"}', headers=good)  # a pair
    assert r.status_code == 200 and r.json() == {"body": {"m": "\U0001f600"}}
