"""Hostile input at the broker's sockets (issue 11, item 9): random, truncated, wrong-kind,
type-confused and oversize messages at the front and back sockets. The broker must stay up,
drop each bad message (counted), and keep serving valid requests throughout.

Uses the synthetic worker: the scenario needs a serving worker, not real tokens.
``LANESERVE_FUZZ_N`` (default 10000) sets the number of hostile messages, split evenly between
the two sockets; the whole run is bounded to ``FUZZ_TIME_S``.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path

import msgpack
import psutil
import pytest
import zmq

from laneserve.broker import protocol as p
from laneserve.broker.client import BrokerClient
from tests.harness import Stack, run

pytestmark = pytest.mark.slow

FUZZ_N = int(os.environ.get("LANESERVE_FUZZ_N", "10000"))
FUZZ_TIME_S = 120.0
PROBE_EVERY = 1000  # a valid request after this many hostile messages

_HOSTILE_VALUES = [
    None,
    -1,
    0,
    2**64 - 1,
    -(2**63),
    1e308,
    float("nan"),
    float("-inf"),
    "",
    "x" * 5000,
    "\udcff".encode("utf-8", "surrogatepass").decode("latin-1"),
    [],
    [None] * 300,
    list(range(2000)),
    {},
    {"k": 1},
    {str(i): i for i in range(300)},
    True,
    b"\x00\x01",
]


def _nested(depth: int):
    v: object = 1
    for _ in range(depth):
        v = {"a": [v]}
    return v


def _templates() -> dict[str, list[p.Message]]:
    """Valid messages of each direction (the fuzzer mutates or misroutes them)."""
    client = [
        p.Submit(
            request_id="fz", lane="interactive", prompt="hi", sampling_params={"max_tokens": 2}
        ),
        p.Submit(request_id="fz2", lane="batch", messages=[{"role": "user", "content": "x"}]),
        p.Abort(request_id="nope"),
        p.StatusRequest(request_id="s"),
        p.Hello(),
    ]
    worker = [
        p.WorkerHeartbeat(worker_id="ghost", stats={"running": 1}),
        p.StepOutputs(worker_id="ghost", outputs=[p.StepOutput("nope", "t", [5], False, None)]),
        p.WorkerError(worker_id="ghost", code="engine_error", message="boom"),
    ]
    ready = [p.Ready(worker_id="ghost", pid=1, lanes=["batch"], capacity=4)]
    outbound = [
        p.Delta(request_id="d", text="x", token_ids=[1], logprobs=None),
        p.Final(request_id="d", finish_reason="stop"),
        p.WorkRequest(request_id="w", lane="batch", prompt="x"),
        p.Disconnect(reason="x"),
        p.RecordBatch(seq=1, records=[{"id": "x"}]),
        p.RecordAck(seq=1),
    ]
    return {"front": client, "back": worker, "ready": ready, "outbound": outbound}


class Fuzzer:
    """Builds hostile multipart messages for one side ("front" or "back")."""

    def __init__(self, side: str, seed: int) -> None:
        self.side = side
        self.rng = random.Random(seed)
        t = _templates()
        self.own = t[side]
        other = "back" if side == "front" else "front"
        self.wrong = t[other] + t["outbound"]  # valid messages of the wrong direction
        # Ready is mutated only into invalid forms (truncation): a valid fake worker that never
        # answers would legitimately take dispatched requests until its liveness expires.
        self.truncatable = self.own + (t["ready"] if side == "back" else [])
        self.kinds = Counter()

    def _rand_bytes(self, n: int) -> bytes:
        return self.rng.randbytes(n)

    def message(self) -> list[bytes]:
        r = self.rng.random()
        if r < 0.2:
            self.kinds["random"] += 1
            return [
                self._rand_bytes(self.rng.randint(0, 300)) for _ in range(self.rng.randint(0, 6))
            ]
        if r < 0.4:
            self.kinds["truncated"] += 1
            frames = self.rng.choice(self.truncatable).to_frames()
            how = self.rng.randint(0, 2)
            if how == 0:
                return frames[: self.rng.randint(0, 2)]
            if how == 1:
                return [frames[0], frames[1], frames[2][: self.rng.randint(0, len(frames[2]) - 1)]]
            return [frames[0], frames[1], frames[2] + self._rand_bytes(self.rng.randint(1, 20))]
        if r < 0.55:
            self.kinds["wrong_kind"] += 1
            frames = self.rng.choice(self.wrong).to_frames()
            how = self.rng.randint(0, 3)
            if how == 1:
                frames[0] = b"LS9"  # unknown protocol version
            elif how == 2:
                frames[1] = self.rng.choice([b"", b"launch", b"submit\x00", b"x" * 5000])
            elif how == 3:
                frames = [*frames, b"extra"]
            return frames
        if r < 0.9:
            self.kinds["type_confused"] += 1
            return self._type_confused()
        if r < 0.998:
            self.kinds["large"] += 1
            return self._large()
        self.kinds["oversize"] += 1
        return [p.VERSION_TAG, b"submit", b"\x00" * (p.MAX_MESSAGE_BYTES + 1)]

    def _type_confused(self) -> list[bytes]:
        msg = self.rng.choice(self.own)
        payload = msg.payload()
        how = self.rng.randint(0, 4)
        keys = list(payload)
        if how == 0 and keys:
            payload[self.rng.choice(keys)] = self.rng.choice(_HOSTILE_VALUES)
        elif how == 1 and keys:
            del payload[self.rng.choice(keys)]
        elif how == 2:
            payload[self.rng.choice(["zz", "", "request_id\x00"])] = 1
        elif how == 3 and keys:
            payload[self.rng.choice(keys)] = _nested(self.rng.randint(9, 60))
        else:
            payload = self.rng.choice([[], "str", 7, None, [payload]])
        try:
            body = msgpack.packb(payload, use_bin_type=True)
        except (ValueError, OverflowError, TypeError):
            body = self._rand_bytes(50)
        return [p.VERSION_TAG, msg.KIND.encode(), body]

    def _large(self) -> list[bytes]:
        how = self.rng.randint(0, 2)
        if how == 0:  # under the size limit but junk
            return [p.VERSION_TAG, b"submit", self._rand_bytes(self.rng.randint(2**16, 2**20))]
        if how == 1:  # a prompt just over MAX_TEXT_CHARS
            body = msgpack.packb(
                {"request_id": "big", "lane": "batch", "prompt": "y" * (p.MAX_TEXT_CHARS + 1)}
            )
            return [p.VERSION_TAG, b"submit", body]
        return [b"f"] * self.rng.randint(50, 500)  # many frames


def _dealer(ctx: zmq.Context, addr: str) -> zmq.Socket:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDHWM, 2000)
    s.setsockopt(zmq.RECONNECT_IVL, 50)
    s.connect(addr)
    return s


async def _probe(client: BrokerClient, i: int) -> tuple[int, float, object]:
    t0 = time.monotonic()
    n = 0
    async for msg in client.submit(prompt=f"probe {i}", sampling_params={"max_tokens": 4}):
        if isinstance(msg, p.Delta):
            n += 1
        else:
            return n, time.monotonic() - t0, msg
    raise AssertionError("stream ended without a final")


def test_zmq_fuzz_broker_survives_and_keeps_serving() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="lsz", dir="/tmp"))
    stack = Stack(tmp)
    ctx = zmq.Context()
    socks: list[zmq.Socket] = []
    try:
        broker = stack.start_broker()
        stack.start_worker("w1", "--synthetic-step-ms", "1")
        stack.wait_workers({"w1"})
        rss0 = psutil.Process(broker.pid).memory_info().rss
        fuzzers = {"front": Fuzzer("front", 1), "back": Fuzzer("back", 2)}
        socks = [_dealer(ctx, stack.front), _dealer(ctx, stack.back)]
        sides = list(zip(("front", "back"), socks, strict=True))
        probes = []
        sent = dropped = 0
        t_start = time.monotonic()

        async def main():
            nonlocal sent, dropped
            async with BrokerClient(stack.front, heartbeat_interval_s=0.5) as client:
                for i in range(FUZZ_N):
                    assert time.monotonic() - t_start < FUZZ_TIME_S, f"fuzz over {FUZZ_TIME_S}s"
                    side, sock = sides[i % 2]
                    frames = fuzzers[side].message() or [b""]
                    try:
                        sock.send_multipart(frames, zmq.NOBLOCK)
                        sent += 1
                    except zmq.Again:  # the broker reads slower than we write: let it catch up
                        dropped += 1
                        await asyncio.sleep(0.01)
                    if i % 200 == 199:
                        await asyncio.sleep(0)  # let the client's reader run
                    if i % PROBE_EVERY == PROBE_EVERY - 1:
                        probes.append(await asyncio.wait_for(_probe(client, i), 15))
                probes.append(await asyncio.wait_for(_probe(client, FUZZ_N), 15))

        run(main(), timeout_s=FUZZ_TIME_S + 30)
        fuzz_s = time.monotonic() - t_start
        for s in socks:
            s.close()
        socks = []
        assert broker.poll() is None, stack.logs()
        assert stack.alive("worker-w1"), stack.logs()
        bad = [(n, r) for n, _, r in probes if not (isinstance(r, p.Final) and n == 4)]
        assert not bad, bad
        assert len(probes) == FUZZ_N // PROBE_EVERY + 1
        # whatever the fuzzer managed to submit is cleaned up once it is gone
        st = None
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            st = stack.status()
            if st["queues"]["in_flight"] == 0 and not st["queues"]["interactive"]:
                break
            time.sleep(0.2)
        assert st and st["queues"]["in_flight"] == 0, st
        invalid = st["counters"].get("invalid_messages", 0)
        assert invalid >= 0.5 * sent, (invalid, sent, st["counters"])
        rss1 = psutil.Process(broker.pid).memory_info().rss
        assert rss1 - rss0 < 512 * 2**20, (rss0, rss1)
        assert stack.wait_workers({"w1"})
        print(
            {
                "hostile_sent": sent,
                "send_full_retries": dropped,
                "kinds": dict(fuzzers["front"].kinds + fuzzers["back"].kinds),
                "invalid_counted": invalid,
                "probe_max_s": round(max(t for _, t, _ in probes), 3),
                "fuzz_s": round(fuzz_s, 1),
                "broker_rss_mb": [rss0 // 2**20, rss1 // 2**20],
            }
        )
    finally:
        for s in socks:
            s.close()
        ctx.term()
        stack.stop()
        shutil.rmtree(tmp, ignore_errors=True)
