"""Scenarios that need real tokens and a real KV cache, on the bundled SmolLM2 model (one stack
per module: recorder + broker + one real worker + `laneserve api`; HTTP on 127.0.0.1):

- 3: an exception inside the engine's forward for one step (``LANESERVE_FAULT_STEP``, the
  engine's test-only hook): the requests of that step get an explicit error within 5 s, the worker
  recovers (same pid) and new requests succeed;
- 7: 16 streaming clients disconnected after 0.5 s, ``LANESERVE_KV_REPEATS`` times (default 5; the issue asks 20):
  the worker's free KV blocks return to their baseline every time;
- 12: ``LANESERVE_LOAD_CLIENTS`` streaming clients (default 8; the issue's full size is 64) for
  ``LANESERVE_LOAD_SECONDS`` (default 20; full size 60): no errors, stable memory in every
  process, and the TTFT/e2e medians the recorder stored in SQL match what the clients measured
  (within 20 %).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
import sqlalchemy as sa

from tests.harness import Stack, report, wait_for

pytestmark = pytest.mark.slow

MODEL = "smollm2"
FAULT = "FAULTY-STEP-MARKER"
KV_REPEATS = int(os.environ.get("LANESERVE_KV_REPEATS", "5"))
LOAD_CLIENTS = int(os.environ.get("LANESERVE_LOAD_CLIENTS", "8"))
LOAD_SECONDS = float(os.environ.get("LANESERVE_LOAD_SECONDS", "20"))


@pytest.fixture(scope="module")
def real(smollm2_gguf) -> Iterator[Stack]:
    tmp = Path(tempfile.mkdtemp(prefix="lsm", dir="/tmp"))
    stack = Stack(tmp, liveness=30)  # generous: a CPU busy with 64 streams is not dead
    try:
        stack.start_recorder()
        stack.start_broker("--recorder", stack.recorder_addr, "--max-interactive-queue", "512")
        env = dict(stack.env, LANESERVE_FAULT_STEP=FAULT)
        stack.start_worker(
            "real", "--model", str(smollm2_gguf), "--dtype", "float32", "--max-num-seqs", "64",
            "--kv-cache-memory", "512MiB", synthetic=False, env=env,
        )  # fmt: skip
        stack.start_api("--model", str(smollm2_gguf), "--served-model-name", MODEL)
        stack.wait_workers({"real"}, timeout_s=300)
        stack.wait_api(timeout_s=300)
        yield stack
    finally:
        stack.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def _body(content: str, max_tokens: int = 8, stream: bool = False) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    }


def _load(stack: Stack) -> dict:
    return stack.status()["workers"][0]["load"]


def _wait_idle(stack: Stack, timeout_s: float = 60.0) -> dict:
    def idle():
        st = stack.status()
        load = st["workers"][0]["load"]
        return st["queues"]["in_flight"] == 0 and load.get("num_running") == 0

    wait_for(idle, timeout_s, "an idle worker")
    time.sleep(0.6)  # one more stats report after the last step
    return _load(stack)


# ---------------------------------------------------------------------------------- 3


def test_engine_step_fault_explicit_error_then_recovery(real) -> None:
    pid = real.status()["workers"][0]["pid"]
    url = real.url + "/v1/chat/completions"
    results: dict[str, tuple[float, httpx.Response]] = {}

    def call(name: str, body: dict) -> None:
        t0 = time.monotonic()
        r = httpx.post(url, json=body, timeout=60)
        results[name] = (time.monotonic() - t0, r)

    threads = [
        threading.Thread(target=call, args=("fault", _body(FAULT, 16))),
        threading.Thread(target=call, args=("fault-stream", _body(FAULT, 16, stream=True))),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    elapsed, r = results["fault"]
    assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error", r.text
    assert elapsed < 5.0, elapsed
    s_elapsed, rs = results["fault-stream"]
    assert s_elapsed < 5.0
    if rs.status_code == 200:  # the error arrived after the stream started: an SSE error event
        assert '"error"' in rs.text and "engine" in rs.text, rs.text[-500:]
    else:
        assert rs.json()["error"]["code"] == "engine_error", rs.text
    t0 = time.monotonic()
    ok = httpx.post(url, json=_body("Say hello.", 8), timeout=60)
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"], ok.text
    recover_s = time.monotonic() - t0
    assert real.status()["workers"][0]["pid"] == pid  # recovered in place, not restarted
    load = _wait_idle(real)
    assert load["num_free_blocks"] == load["num_total_blocks"]  # the failed step freed its KV
    report(
        "3 engine forward raises in one step",
        error="engine_error (HTTP 500)",
        error_after_s=round(elapsed, 2),
        stream_error_after_s=round(s_elapsed, 2),
        next_request_ok_s=round(recover_s, 2),
        worker_restarted=False,
    )


# ---------------------------------------------------------------------------------- 7


async def _disconnecting_streams(url: str, n: int, after_s: float) -> int:
    """n streaming requests; each connection is dropped ``after_s`` after its first chunk."""

    async def one(client: httpx.AsyncClient, i: int) -> bool:
        body = _body(f"Write a long story about the number {i}.", 400, stream=True)
        async with client.stream("POST", url, json=body) as r:
            assert r.status_code == 200, await r.aread()
            async for _ in r.aiter_raw():
                break
            await asyncio.sleep(after_s)
            return True  # leaving the block closes the connection mid-stream

    limits = httpx.Limits(max_connections=n + 4)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        done = await asyncio.gather(*(one(client, i) for i in range(n)))
    return sum(done)


def test_disconnected_streams_return_kv_blocks_every_time(real) -> None:
    baseline = _wait_idle(real)["num_free_blocks"]
    url = real.url + "/v1/chat/completions"
    t0 = time.monotonic()
    settle = []
    for rep in range(KV_REPEATS):
        n = asyncio.run(asyncio.wait_for(_disconnecting_streams(url, 16, 0.5), 120))
        assert n == 16
        t1 = time.monotonic()

        def back(rep=rep):
            st = real.status()
            load = st["workers"][0]["load"]
            return st["queues"]["in_flight"] == 0 and load.get("num_free_blocks") == baseline

        wait_for(back, 30, f"free KV blocks back to {baseline} (repeat {rep})")
        settle.append(time.monotonic() - t1)
    assert _load(real)["num_running"] == 0
    report(
        "7 16 streaming clients disconnected after 0.5 s",
        repeats=KV_REPEATS,
        free_blocks_baseline=baseline,
        back_to_baseline_max_s=round(max(settle), 2),
        total_s=round(time.monotonic() - t0, 1),
    )


# ---------------------------------------------------------------------------------- 12


async def _load_client(url: str, k: int, until: float, out: list, errors: list) -> None:
    i = 0
    async with httpx.AsyncClient(timeout=120) as client:
        while time.monotonic() < until:
            body = _body(f"Client {k} question {i}: name a colour and say why.", 24, stream=True)
            body["stream_options"] = {"include_usage": True}
            i += 1
            t0 = time.monotonic()
            ttft = None
            rid = None
            try:
                async with client.stream("POST", url, json=body) as r:
                    if r.status_code != 200:
                        errors.append((r.status_code, (await r.aread())[:200]))
                        continue
                    async for line in r.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            errors.append(chunk["error"])
                            break
                        rid = chunk.get("id", rid)
                        choices = chunk.get("choices") or []
                        if ttft is None and choices and choices[0]["delta"].get("content"):
                            ttft = time.monotonic() - t0
            except httpx.HTTPError as exc:
                errors.append(repr(exc))
                continue
            out.append((rid, ttft, time.monotonic() - t0))


def test_load_streaming_clients_no_errors_stable_memory_sql_matches(real) -> None:
    _wait_idle(real)
    url = real.url + "/v1/chat/completions"
    pids = {name: proc.pid for name, proc in real.procs.items()}
    rss: dict[str, list[int]] = {name: [] for name in pids}
    out: list = []
    errors: list = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(1.0):
            for name, pid in pids.items():
                rss[name].append(psutil.Process(pid).memory_info().rss)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    until = time.monotonic() + LOAD_SECONDS

    async def main():
        await asyncio.gather(
            *(_load_client(url, k, until, out, errors) for k in range(LOAD_CLIENTS))
        )

    asyncio.run(asyncio.wait_for(main(), LOAD_SECONDS + 180))
    stop.set()
    sampler.join(5)
    assert errors == [], errors[:5]
    assert len(out) >= LOAD_CLIENTS and all(r[0] and r[1] for r in out), out[:3]
    for name, series in rss.items():
        assert all(psutil.pid_exists(pids[name]) for name in pids)
        # stable: the second half of the run grows by less than 10 % + 64 MiB over the first
        half = len(series) // 2
        if half >= 2:
            first, last = max(series[:half]), max(series[half:])
            assert last <= first * 1.10 + 64 * 2**20, (name, first, last)
    # the recorder's rows for these requests
    ids = [rid for rid, _, _ in out]
    engine = sa.create_engine(real.db_url)
    try:

        def rows():
            with engine.connect() as conn:
                q = sa.text("SELECT id, ttft_ms, e2e_ms FROM requests WHERE id IN :ids").bindparams(
                    sa.bindparam("ids", expanding=True)
                )
                found = conn.execute(q, {"ids": ids}).all()
            return found if len(found) == len(ids) else None

        found = wait_for(rows, 30, "the recorder's rows")
    finally:
        engine.dispose()
    by_id = {r[0]: r for r in found}
    client_ttft = statistics.median(t * 1000 for _, t, _ in out)
    client_e2e = statistics.median(e * 1000 for _, _, e in out)
    sql_ttft = statistics.median(by_id[rid][1] for rid in ids)
    sql_e2e = statistics.median(by_id[rid][2] for rid in ids)
    figures = {
        "clients": LOAD_CLIENTS,
        "seconds": LOAD_SECONDS,
        "requests": len(out),
        "errors": 0,
        "requests_per_s": round(len(out) / LOAD_SECONDS, 2),
        "ttft_p50_ms_client": round(client_ttft, 1),
        "ttft_p50_ms_sql": round(sql_ttft, 1),
        "e2e_p50_ms_client": round(client_e2e, 1),
        "e2e_p50_ms_sql": round(sql_e2e, 1),
        "rss_mb_first_last": {n: [s[0] // 2**20, s[-1] // 2**20] for n, s in rss.items() if s},
    }
    report("12 load: streaming clients on the bundled model", **figures)
    assert abs(sql_ttft - client_ttft) <= 0.2 * client_ttft, figures
    assert abs(sql_e2e - client_e2e) <= 0.2 * client_e2e, figures
