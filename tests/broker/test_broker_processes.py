"""Broker + synthetic workers as real processes on ipc:// sockets."""

from __future__ import annotations

import asyncio
import collections
import os
import signal
import subprocess
import sys
import time

import pytest

from laneserve.broker import protocol as p
from laneserve.broker.client import BrokerClient
from tests.harness import HB, run

pytestmark = pytest.mark.slow


async def collect(client: BrokerClient, **kw) -> tuple[list[p.Delta], p.Final | p.Error]:
    deltas = []
    async for msg in client.submit(**kw):
        if isinstance(msg, p.Delta):
            deltas.append(msg)
        else:
            return deltas, msg
    raise AssertionError("stream ended without a final or an error")


def test_stream_deltas_join_to_nonstream_text(stack) -> None:
    stack.start_broker()
    stack.start_worker("w1", "--synthetic-step-ms", "2")
    stack.wait_workers({"w1"})

    async def main():
        async with BrokerClient(stack.front) as c:
            sp = {"max_tokens": 12, "seed": 7}
            deltas, final = await collect(c, prompt="tell me", sampling_params=sp)
            _, whole = await collect(c, prompt="tell me", sampling_params=sp, stream=False)
            _, chat = await collect(
                c, messages=[{"role": "user", "content": "hi"}], sampling_params=sp, lane="batch"
            )
            return deltas, final, whole, chat

    deltas, final, whole, chat = run(main())
    assert isinstance(final, p.Final) and isinstance(whole, p.Final), (final, whole)
    assert len(deltas) == 12 and final.finish_reason == "length"
    assert "".join(d.text for d in deltas) == whole.text != ""
    assert [t for d in deltas for t in d.token_ids] == whole.token_ids
    assert final.usage["completion_tokens"] == 12 and final.worker_id == "w1"
    assert final.timings["ttft_ms"] > 0 and final.timings["e2e_ms"] >= final.timings["ttft_ms"]
    assert isinstance(chat, p.Final) and chat.finish_reason == "length"


def test_two_workers_share_load(stack) -> None:
    stack.start_broker()
    stack.start_worker("w1", "--synthetic-step-ms", "5")
    stack.start_worker("w2", "--synthetic-step-ms", "5")
    stack.wait_workers({"w1", "w2"})

    async def main():
        async with BrokerClient(stack.front) as c:
            jobs = [
                collect(
                    c,
                    prompt=f"p{i}",
                    lane="batch",
                    stream=False,
                    sampling_params={"max_tokens": 10},
                )
                for i in range(40)
            ]
            return await asyncio.gather(*jobs)

    results = run(main())
    finals = [r[1] for r in results]
    assert all(isinstance(f, p.Final) for f in finals), finals
    by_worker = collections.Counter(f.worker_id for f in finals)
    assert set(by_worker) == {"w1", "w2"} and min(by_worker.values()) >= 10, by_worker


def test_interactive_dispatched_first_and_batch_progresses(stack) -> None:
    stack.start_broker()
    # One worker with room for 4 requests: the broker's queues decide the order.
    stack.start_worker("w1", "--synthetic-step-ms", "10", "--max-num-seqs", "4", "--capacity", "4")
    stack.wait_workers({"w1"})

    async def main():
        async with BrokerClient(stack.front) as c:
            first_token: dict[str, float] = {}
            finished: dict[str, float] = {}

            async def one(lane: str, i: int, max_tokens: int):
                rid = f"{lane}{i}"
                it = c.submit(
                    request_id=rid,
                    prompt=rid,
                    lane=lane,
                    sampling_params={"max_tokens": max_tokens},
                )
                async for msg in it:
                    first_token.setdefault(rid, time.monotonic())
                    assert not isinstance(msg, p.Error), msg
                finished[rid] = time.monotonic()

            batch = [asyncio.create_task(one("batch", i, 20)) for i in range(24)]
            await asyncio.sleep(0.3)  # the batch queue is now long
            t_arrival = time.monotonic()
            inter = [asyncio.create_task(one("interactive", i, 5)) for i in range(30)]
            await asyncio.gather(*inter)
            t_inter_done = time.monotonic()
            await asyncio.gather(*batch)
            return first_token, finished, t_arrival, t_inter_done

    first_token, finished, t_arrival, t_inter_done = run(main())
    assert len(finished) == 54
    batch_started = [first_token[f"batch{i}"] for i in range(24)]
    during = sum(t_arrival < t < t_inter_done for t in batch_started)
    after = sum(t >= t_inter_done for t in batch_started)
    # Batch kept a minimum share while 30 interactive requests jumped its queue...
    assert during >= 1, (during, after)
    # ...but interactive went first: few batch starts in that window, the rest waited.
    assert during <= 12 and after >= 1, (during, after)


def test_abort_frees_the_request_on_the_worker(stack) -> None:
    stack.start_broker()
    stack.start_worker("w1", "--synthetic-step-ms", "5")
    st = stack.wait_workers({"w1"})
    base = stack.wait_status(lambda s: s["workers"][0]["load"].get("num_total_blocks"))
    total = base["workers"][0]["load"]["num_total_blocks"]

    async def main():
        async with BrokerClient(stack.front) as c:
            it = c.submit(prompt="long " * 200, sampling_params={"max_tokens": 2000})
            n = 0
            async for msg in it:
                assert isinstance(msg, p.Delta)
                n += 1
                if n == 5:
                    break
            await it.aclose()
            loaded = stack.status()["workers"][0]
            # a task cancelled mid-stream aborts too
            task = asyncio.create_task(
                collect(c, prompt="x " * 100, sampling_params={"max_tokens": 2000})
            )
            await asyncio.sleep(0.3)
            task.cancel()
            # dropping an unfinished stream aborts it as well
            dropped = c.submit(prompt="y", sampling_params={"max_tokens": 2000})
            assert isinstance(await anext(dropped), p.Delta)
            del dropped
            await asyncio.sleep(0.3)
            return loaded

    run(main())
    st = stack.wait_status(
        lambda s: (
            s["queues"]["in_flight"] == 0
            and s["workers"][0]["load"].get("active") == 0
            and s["workers"][0]["load"].get("num_free_blocks") == total
            and s["workers"][0]["load"].get("num_running") == 0
        )
    )
    assert st["counters"]["aborted"] == 3, st["counters"]
    assert st["workers"][0]["in_flight"] == 0


def test_sigkill_worker_mid_batch_finishes_everything_exactly_once(stack) -> None:
    stack.start_broker()
    w1 = stack.start_worker("w1", "--synthetic-step-ms", "10")
    stack.start_worker("w2", "--synthetic-step-ms", "10")
    stack.wait_workers({"w1", "w2"})
    n = 40

    async def main():
        async with BrokerClient(stack.front) as c:
            seen: collections.Counter[str] = collections.Counter()
            finals: dict[str, p.Final | p.Error] = {}

            async def one(i: int):
                rid = f"job-line-{i}"
                async for msg in c.submit(
                    request_id=rid,
                    prompt=f"line {i}",
                    lane="batch",
                    stream=False,
                    sampling_params={"max_tokens": 40},
                ):
                    seen[rid] += 1
                    finals[rid] = msg

            tasks = [asyncio.create_task(one(i)) for i in range(n)]
            await asyncio.sleep(0.25)  # both workers hold requests mid-decode
            w1.send_signal(signal.SIGKILL)
            await asyncio.gather(*tasks)
            return seen, finals

    seen, finals = run(main())
    assert len(finals) == n and set(seen.values()) == {1}, seen
    bad = {k: v for k, v in finals.items() if not isinstance(v, p.Final)}
    assert not bad, bad
    assert all(f.worker_id == "w2" for f in finals.values() if f.attempts == 2)
    assert sum(f.attempts == 2 for f in finals.values()) >= 1, "nothing was requeued"
    assert all(len(f.token_ids) == 40 for f in finals.values())
    st = stack.status()
    assert st["counters"]["workers_lost"] == 1 and [w["worker_id"] for w in st["workers"]] == ["w2"]


def test_interactive_worker_loss_requeue_or_retryable_error(stack) -> None:
    stack.start_broker("--max-attempts", "3")
    # max-num-seqs 1: the second interactive request waits inside the engine with no token yet.
    w1 = stack.start_worker(
        "w1", "--synthetic-step-ms", "20", "--max-num-seqs", "1", "--capacity", "4"
    )
    stack.wait_workers({"w1"})

    async def main():
        async with BrokerClient(stack.front) as c:
            # seeded sampling cannot be resumed elsewhere (a fresh generator draws other tokens)
            sp = {"max_tokens": 500, "seed": 3, "temperature": 0.7}
            streaming = c.submit(request_id="s", prompt="a", sampling_params=sp)
            first = await anext(streaming)
            assert isinstance(first, p.Delta)
            waiting = asyncio.create_task(
                collect(c, request_id="q", prompt="b", sampling_params={"max_tokens": 5})
            )
            await asyncio.sleep(0.3)
            w1.send_signal(signal.SIGKILL)
            tail = [m async for m in streaming]
            stack.start_worker("w2", "--synthetic-step-ms", "5")
            deltas, fin = await waiting
            return tail, deltas, fin

    tail, deltas, fin = run(main())
    err = tail[-1]
    assert isinstance(err, p.Error) and err.code == "worker_lost" and err.retryable, tail[-1]
    assert isinstance(fin, p.Final) and fin.worker_id == "w2" and fin.attempts == 2, fin
    assert len(deltas) == 5


def test_worker_loss_resumes_streams_and_batch_lines_where_they_were(stack) -> None:
    """A killed worker's unseeded requests go on on the next worker from the tokens they had:
    the stream's deltas and the batch line's final carry every token once, in order (the
    synthetic engine's tokens count up from 0, so a restart from the prompt would repeat them)."""
    stack.start_broker("--max-attempts", "3")
    w1 = stack.start_worker("w1", "--synthetic-step-ms", "20")
    stack.wait_workers({"w1"})
    n = 60

    async def main():
        async with BrokerClient(stack.front) as c:
            sp = {"max_tokens": n}
            line = asyncio.create_task(
                collect(c, request_id="b", prompt="x", lane="batch", stream=False,
                        sampling_params=sp | {"logprobs": 0})
            )  # fmt: skip
            streaming = c.submit(request_id="s", prompt="a", sampling_params=sp)
            deltas = [await anext(streaming) for _ in range(10)]
            w1.send_signal(signal.SIGKILL)
            stack.start_worker("w2", "--synthetic-step-ms", "5")
            tail = [m async for m in streaming]
            return deltas + tail[:-1], tail[-1], await line

    deltas, final, (_, line) = run(main())
    assert isinstance(final, p.Final) and final.attempts == 2, final
    assert final.worker_id == "w2" and final.finish_reason == "length"
    assert [t for d in deltas for t in d.token_ids] == list(range(n))
    assert "".join(d.text for d in deltas) == "".join(f" w{i}" for i in range(n))
    assert final.usage["completion_tokens"] == n and final.token_ids == []
    assert isinstance(line, p.Final) and line.attempts == 2 and line.worker_id == "w2", line
    assert line.token_ids == list(range(n)) and line.text == "".join(f" w{i}" for i in range(n))
    st = stack.status()
    assert st["counters"]["resumed"] == 2 and st["counters"]["requeued"] == 2, st["counters"]


def test_a_resumable_stream_out_of_attempts_ends_for_good(stack) -> None:
    """A stream that keeps losing its worker ends with a non-retryable worker_lost once its
    attempts are used, though it could be resumed: a request that crashes every worker it
    reaches must not be sent on by its client either."""
    stack.start_broker("--max-attempts", "1")
    w1 = stack.start_worker("w1", "--synthetic-step-ms", "20")
    stack.wait_workers({"w1"})

    async def main():
        async with BrokerClient(stack.front) as c:
            streaming = c.submit(request_id="s", prompt="a", sampling_params={"max_tokens": 500})
            assert isinstance(await anext(streaming), p.Delta)
            w1.send_signal(signal.SIGKILL)
            return [m async for m in streaming]

    err = run(main())[-1]
    assert isinstance(err, p.Error) and err.code == "worker_lost" and not err.retryable, err


def test_batch_worker_lost_after_max_attempts_is_final(stack) -> None:
    stack.start_broker("--max-attempts", "1")
    w1 = stack.start_worker("w1", "--synthetic-step-ms", "20")
    stack.wait_workers({"w1"})

    async def main():
        async with BrokerClient(stack.front) as c:
            task = asyncio.create_task(
                collect(
                    c, prompt="a", lane="batch", stream=False, sampling_params={"max_tokens": 500}
                )
            )
            await asyncio.sleep(0.3)
            w1.send_signal(signal.SIGKILL)
            return await task

    _, err = run(main())
    assert isinstance(err, p.Error) and err.code == "worker_lost", err
    assert not err.retryable and err.attempts == 1


def test_overloaded_and_no_worker(stack) -> None:
    stack.start_broker("--max-interactive-queue", "2", "--no-worker-timeout", "0.5")
    stack.start_worker("b1", lanes="batch")
    stack.wait_workers({"b1"})

    async def main():
        async with BrokerClient(stack.front) as c:
            tasks = [
                asyncio.create_task(collect(c, prompt=f"{i}", sampling_params={"max_tokens": 1}))
                for i in range(3)
            ]
            return [await t for t in tasks]

    results = run(main())
    codes = sorted(r[1].code for r in results)
    assert codes == ["no_worker", "no_worker", "overloaded"], results


def test_malformed_traffic_leaves_broker_serving(stack) -> None:
    import zmq

    stack.start_broker("--client-sndhwm", "50")
    stack.start_worker("w1", "--synthetic-step-ms", "1")
    stack.wait_workers({"w1"})
    ctx = zmq.Context()
    socks = []
    try:
        for addr in (stack.front, stack.back):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(addr)
            socks.append(s)
            rnd = os.urandom
            for frames in (
                [rnd(50)],
                [rnd(1), rnd(2), rnd(3), rnd(4), rnd(5)],
                [p.VERSION_TAG, b"launch_missiles", b"\x80"],
                [p.VERSION_TAG, b"submit", rnd(100)],
                [p.VERSION_TAG, b"step_outputs", b"\x81\xa1x\x01"],
                [b""],
                [p.VERSION_TAG, b"submit", b"\x00" * (p.MAX_MESSAGE_BYTES + 10)],
            ):
                s.send_multipart(frames)
        # a client that submits many streams and never reads
        lazy = ctx.socket(zmq.DEALER)
        lazy.setsockopt(zmq.LINGER, 0)
        lazy.setsockopt(zmq.RCVHWM, 10)
        lazy.setsockopt(zmq.RCVBUF, 4096)
        lazy.connect(stack.front)
        socks.append(lazy)
        for i in range(20):
            lazy.send_multipart(
                p.Submit(
                    request_id=f"lazy{i}",
                    lane="interactive",
                    prompt="x " * 2000,
                    sampling_params={"max_tokens": 3000},
                ).to_frames()
            )
        time.sleep(1.0)

        async def main():
            async with BrokerClient(stack.front) as c:
                return await collect(c, prompt="still there?", sampling_params={"max_tokens": 4})

        deltas, fin = run(main())
        assert isinstance(fin, p.Final) and len(deltas) == 4
        st = stack.wait_status(lambda s: s["queues"]["in_flight"] == 0, timeout_s=20)
        assert st["counters"]["invalid_messages"] >= 8, st["counters"]
        assert st["counters"].get("client_send_full", 0) >= 1, st["counters"]
        assert stack.broker.poll() is None
    finally:
        for s in socks:
            s.close()
        ctx.term()


def test_sigterm_drains_worker(stack) -> None:
    stack.start_broker()
    w1 = stack.start_worker("w1", "--synthetic-step-ms", "10")
    stack.wait_workers({"w1"})

    async def main():
        async with BrokerClient(stack.front) as c:
            task = asyncio.create_task(collect(c, prompt="a", sampling_params={"max_tokens": 60}))
            await asyncio.sleep(0.2)
            w1.send_signal(signal.SIGTERM)
            return await task

    deltas, fin = run(main())
    assert isinstance(fin, p.Final) and len(deltas) == 60
    assert w1.wait(timeout=10) == 0


def test_worker_exits_when_parent_dies(stack) -> None:
    stack.start_broker()
    parent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        w = stack.start_worker("w1", "--parent-pid", str(parent.pid))
        stack.wait_workers({"w1"})
        parent.kill()
        parent.wait()
        assert w.wait(timeout=10) == 0
    finally:
        parent.kill()


def test_broker_restart_client_and_worker_recover(stack) -> None:
    stack.start_broker()
    stack.start_worker("w1", "--synthetic-step-ms", "20")
    stack.wait_workers({"w1"})

    async def main():
        async with BrokerClient(stack.front, heartbeat_interval_s=HB, liveness_s=5.0) as c:
            task = asyncio.create_task(collect(c, prompt="a", sampling_params={"max_tokens": 1000}))
            await asyncio.sleep(0.5)
            stack.broker.kill()
            stack.broker.wait()
            stack.start_broker()
            _, err = await task
            await asyncio.to_thread(stack.wait_workers, {"w1"})
            deltas, fin = await collect(c, prompt="again", sampling_params={"max_tokens": 3})
            return err, deltas, fin

    err, deltas, fin = run(main())
    assert isinstance(err, p.Error) and err.code == "worker_lost" and err.retryable, err
    assert isinstance(fin, p.Final) and len(deltas) == 3
    # the worker dropped the orphaned request when it saw the new broker
    st = stack.wait_status(lambda s: s["workers"] and s["workers"][0]["load"].get("active") == 0)
    assert st["workers"][0]["load"]["num_running"] == 0
    # the worker re-announced itself to the new broker once, not once per queued message
    assert st["counters"].get("workers_lost", 0) == 0, st["counters"]
