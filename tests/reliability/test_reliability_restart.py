"""Broker and worker restarts seen by the edge (issue 24; DESIGN.md "Scale beyond one machine"):
only a stream that already delivered tokens gets a retryable ``worker_lost``; requests sent after
a restart, non-streaming requests and streams without a token yet succeed, each token once.

Real processes on ipc:// sockets with the production liveness settings (heartbeat 1 s, 3 missed
beats): a broker and one synthetic worker (``gpu_worker/synthetic.py``, 20 ms per engine step,
8 sequences at a time); the HTTP scenario adds ``laneserve api`` and the official ``openai``
client (no client-side retries). The test plays the supervisor: it SIGKILLs a process and starts it again at once. Each
scenario reports its figures (``tests.harness.report``; docs/reliability.md).
"""

from __future__ import annotations

import asyncio
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import openai
import pytest

from laneserve.broker import protocol as p
from laneserve.broker.client import BrokerClient
from tests.harness import Stack, report, run

pytestmark = pytest.mark.slow

DEADLINE_S = 30.0  # every request's deadline (s after its submit); nothing may pass it
WORKER_ARGS = ("--synthetic-step-ms", "20", "--capacity", "32", "--max-num-seqs", "8")
WAVE_TOKENS = 100  # max_tokens of the requests in flight at a kill (~2 s each)
AFTER_TOKENS = 8  # max_tokens of the requests sent after a kill


@pytest.fixture
def stack() -> Iterator[Stack]:
    tmp = Path(tempfile.mkdtemp(prefix="lsr", dir="/tmp"))
    s = Stack(tmp, hb=1.0, liveness=3)
    try:
        yield s
    finally:
        s.stop()
        shutil.rmtree(tmp, ignore_errors=True)


@dataclass
class Outcome:
    """What one caller saw: the content deltas, the last message, when it ended."""

    name: str
    stream: bool
    max_tokens: int
    deltas: list[p.Delta] = field(default_factory=list)
    end: p.Final | p.Error | None = None
    elapsed_s: float = 0.0
    ended_at: float = 0.0  # time.monotonic() s

    @property
    def complete(self) -> bool:
        """A Final carrying every requested token exactly once."""
        end = self.end
        if type(end) is not p.Final or end.finish_reason != "length":
            return False
        got = [t for d in self.deltas for t in d.token_ids] + list(end.token_ids)
        return len(got) == self.max_tokens

    @property
    def retryable_lost(self) -> bool:
        end = self.end
        return type(end) is p.Error and end.code == "worker_lost" and end.retryable


async def call(
    client: BrokerClient, name: str, stream: bool, max_tokens: int, seen: dict[str, int]
) -> Outcome:
    """One request to its end, bounded by its deadline; ``seen[name]``: content deltas so far."""
    out = Outcome(name, stream, max_tokens)
    seen[name] = 0
    t0 = time.monotonic()
    submitted = client.submit(
        request_id=name,
        prompt=f"prompt {name}",
        stream=stream,
        sampling_params={"max_tokens": max_tokens},
        deadline=t0 + DEADLINE_S,
    )
    async for msg in submitted:
        if type(msg) is p.Delta:
            if msg.text or msg.token_ids:
                out.deltas.append(msg)
                seen[name] += 1
        else:
            out.end = msg
    out.ended_at = time.monotonic()
    out.elapsed_s = out.ended_at - t0
    return out


def _start(stack: Stack) -> None:
    stack.start_broker()
    stack.start_worker("w1", *WORKER_ARGS)
    stack.wait_workers({"w1"})


def kill_broker(stack: Stack) -> None:
    """SIGKILL the broker and start a new one at once, as the supervisor does."""
    stack.kill("broker")
    stack.start_broker()


def kill_worker(stack: Stack) -> None:
    """SIGKILL the worker and start it again under the same id, as the supervisor does."""
    stack.kill("worker-w1")
    stack.start_worker("w1", *WORKER_ARGS)


KILLS = {"broker": kill_broker, "worker": kill_worker}


# ------------------------------------------------------------------------- requests after


def _after_kill(stack: Stack, kill: Callable[[Stack], None]) -> dict:
    """Kill, then 20 requests (every other one streaming) spread over the next 5 s."""
    _start(stack)
    seen: dict[str, int] = {}

    async def main() -> tuple[list[Outcome], list[Outcome], dict]:
        async with BrokerClient(stack.front) as c:
            base = [await call(c, f"base-{i}", i % 2 == 0, AFTER_TOKENS, seen) for i in range(4)]
            t_kill = time.monotonic()
            kill(stack)
            tasks = []
            for i in range(20):
                await asyncio.sleep(max(0.0, t_kill + 0.25 * i - time.monotonic()))
                req = call(c, f"after-{i}", i % 2 == 0, AFTER_TOKENS, seen)
                tasks.append(asyncio.create_task(req))
            return base, list(await asyncio.gather(*tasks)), dict(c.counters)

    base, after, counters = run(main(), timeout_s=DEADLINE_S + 30)
    assert all(o.complete for o in base), [(o.name, o.end) for o in base]
    bad = [(o.name, o.end) for o in after if not o.complete]
    assert not bad, f"{bad}\n{stack.logs()}"
    assert all(o.elapsed_s < DEADLINE_S for o in after)
    base_s = statistics.median(o.elapsed_s for o in base)
    return {
        "requests": len(after),
        "succeeded": sum(o.complete for o in after),
        "retryable_errors": sum(o.retryable_lost for o in after),
        "e2e_before_s": round(base_s, 3),
        "e2e_after_median_s": round(statistics.median(o.elapsed_s for o in after), 3),
        "added_latency_max_s": round(max(o.elapsed_s for o in after) - base_s, 3),
        "client_resubmitted": counters["resubmitted"],
    }


@pytest.mark.parametrize("victim", ["broker", "worker"])
def test_requests_after_a_sigkill_all_succeed(stack, victim) -> None:
    figures = _after_kill(stack, KILLS[victim])
    report(f"{victim} SIGKILL + restart, then 20 requests over 5 s", **figures)


# ------------------------------------------------------------------------- requests under way

# Submit order: the engine runs 8 sequences and admits in order, so s0-s3 and n0-n3 run while
# s4-s7 and n4-n7 wait inside it without a token for ~2 s.
ORDER = [
    *(f"s{i}" for i in range(4)),
    *(f"n{i}" for i in range(4)),
    *(f"s{i}" for i in range(4, 8)),
    *(f"n{i}" for i in range(4, 8)),
]


async def _wave(c: BrokerClient, tag: str, seen: dict[str, int]) -> dict[str, asyncio.Task]:
    tasks = {}
    for name in ORDER:
        req = call(c, f"{tag}-{name}", name.startswith("s"), WAVE_TOKENS, seen)
        tasks[name] = asyncio.create_task(req)
        await asyncio.sleep(0.01)  # keep the submit order
    return tasks


def _kill_under_way(stack: Stack, kill: Callable[[Stack], None], resumed: bool) -> dict:
    """8 streaming and 8 non-streaming requests in flight, then the kill. ``resumed``: the
    broker outlives it (a worker's kill), so the streams under way go on where they were on the
    restarted worker; after a broker's kill they end with the retryable worker_lost."""
    _start(stack)
    seen: dict[str, int] = {}

    async def main():
        async with BrokerClient(stack.front) as c:
            base_tasks = await _wave(c, "base", seen)  # the same wave without a kill
            base = {n: await t for n, t in base_tasks.items()}
            tasks = await _wave(c, "kill", seen)
            for _ in range(200):  # until the first four streams are under way (at most 10 s)
                if sum(seen[f"kill-s{i}"] > 0 for i in range(4)) == 4:
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.2)  # a few tokens each
            started = {n: seen[f"kill-{n}"] for n in ORDER if n.startswith("s")}
            t_kill = time.monotonic()
            kill(stack)
            outs = {n: await t for n, t in tasks.items()}
            return base, outs, started, t_kill

    base, outs, started, t_kill = run(main(), timeout_s=3 * DEADLINE_S)
    assert all(o.complete for o in base.values()), [(o.name, o.end) for o in base.values()]
    under_way = {n for n, k in started.items() if k}
    assert len(under_way) >= 4, started
    assert len(under_way) < 8, f"every stream had started; nothing was resubmitted: {started}"
    for name, o in outs.items():
        assert o.elapsed_s < DEADLINE_S, (name, o.elapsed_s)
        if name in under_way and not resumed:
            assert o.retryable_lost, (name, o.end, stack.logs())
            assert 0 < len(o.deltas) < WAVE_TOKENS, (name, len(o.deltas))
        else:
            assert o.complete, (name, o.end and len(o.end.token_ids), len(o.deltas), stack.logs())
        if name in under_way and resumed:  # every token once: the synthetic ids count up
            ids = [t for d in o.deltas for t in d.token_ids]
            assert ids == [t for d in base[name].deltas for t in d.token_ids], name
    added = [o.elapsed_s - base[n].elapsed_s for n, o in outs.items() if n not in under_way]
    lost = "resumed_streams_done_after_kill_max_s" if resumed else "worker_lost_after_kill_max_s"
    return {
        "requests": len(outs),
        "succeeded": sum(o.complete for o in outs.values()),
        "retryable_errors": sum(o.retryable_lost for o in outs.values()),
        "streams_under_way": len(under_way),
        lost: round(max(outs[n].ended_at - t_kill for n in under_way), 3),
        "e2e_without_kill_median_s": round(
            statistics.median(o.elapsed_s for o in base.values()), 3
        ),
        "added_latency_median_s": round(statistics.median(added), 3),
        "added_latency_max_s": round(max(added), 3),
    }


@pytest.mark.parametrize("victim", ["broker", "worker"])
def test_sigkill_under_way_started_streams_fail_or_resume(stack, victim) -> None:
    figures = _kill_under_way(stack, KILLS[victim], resumed=victim == "worker")
    report(f"{victim} SIGKILL + restart with 8+8 requests in flight", **figures)


# ------------------------------------------------------------------------- through HTTP

MODEL = "smollm2"


async def _chat(api: openai.AsyncOpenAI, i: int, stream: bool, max_tokens: int) -> tuple:
    """One chat completion: ("ok", text, seconds) or ("error", status/message, seconds)."""
    t0 = time.monotonic()
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"question {i}"}],
        "max_tokens": max_tokens,
    }
    try:
        if stream:
            parts = []
            async for chunk in await api.chat.completions.create(**body, stream=True):
                if chunk.choices and chunk.choices[0].delta.content:
                    parts.append(chunk.choices[0].delta.content)
            text = "".join(parts)
        else:
            text = (await api.chat.completions.create(**body)).choices[0].message.content
    except openai.APIError as exc:
        return "error", f"{getattr(exc, 'status_code', '')} {exc}", time.monotonic() - t0
    return ("ok" if text else "empty"), text, time.monotonic() - t0


def test_broker_sigkill_through_the_gateway_no_503(stack, smollm2_gguf) -> None:
    """The issue's report: `laneserve api` in front of the broker. (1) The gateway idle, SIGKILL
    the broker and start it again; one plain chat 2 s later (the request that got 503
    ``worker_lost``), others over the next 5 s. (2) SIGKILL it again while two long non-streaming
    chats run. Every answer is a 200 with content."""
    _start(stack)
    stack.start_api("--model", str(smollm2_gguf), "--served-model-name", MODEL)
    stack.wait_api()

    async def main():
        api = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)
        async with api:
            warm = [await _chat(api, i, i % 2 == 0, AFTER_TOKENS) for i in range(4)]
            t_kill = time.monotonic()
            kill_broker(stack)
            await asyncio.sleep(max(0.0, t_kill + 2.0 - time.monotonic()))
            issue = await _chat(api, 0, False, AFTER_TOKENS)
            tasks = []
            for i in range(1, 11):
                await asyncio.sleep(max(0.0, t_kill + 2.0 + 0.3 * i - time.monotonic()))
                tasks.append(asyncio.create_task(_chat(api, i, i % 2 == 1, AFTER_TOKENS)))
            after = await asyncio.gather(*tasks)
            long = [asyncio.create_task(_chat(api, 100 + i, False, WAVE_TOKENS)) for i in (0, 1)]
            await asyncio.sleep(0.5)  # both are producing tokens
            kill_broker(stack)
            return warm, issue, after, await asyncio.gather(*long)

    warm, issue, after, in_flight = run(main(), timeout_s=DEADLINE_S + 60)
    assert all(r[0] == "ok" for r in warm), warm
    assert issue[0] == "ok", f"{issue}\n{stack.logs()}"
    bad = [r for r in [*after, *in_flight] if r[0] != "ok"]
    assert not bad, f"{bad}\n{stack.logs()}"
    assert all(r[2] < DEADLINE_S for r in in_flight), in_flight
    base_s = statistics.median(r[2] for r in warm)
    report(
        "broker SIGKILL + restart through the HTTP gateway",
        requests=1 + len(after) + len(in_flight),
        succeeded=1 + sum(r[0] == "ok" for r in [*after, *in_flight]),
        http_errors=len(bad),
        chat_2s_after_kill_s=round(issue[2], 3),
        e2e_before_s=round(base_s, 3),
        added_latency_after_max_s=round(max(r[2] for r in after) - base_s, 3),
        in_flight_non_streaming_e2e_s=[round(r[2], 3) for r in in_flight],
    )
