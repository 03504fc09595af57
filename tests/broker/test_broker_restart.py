"""BrokerClient across broker restarts, silences and absences (issue 24): what waits, what is
resubmitted, what ends with which error, and when.

Real broker and synthetic worker processes on ipc:// sockets (``tests.harness.Stack``). One test plays
the broker itself on a real ROUTER socket: an epoch change on a live connection (the DEALER
reconnected to a new broker by itself) and an answer racing in for the left connection cannot
be produced on demand with a real broker.
"""

from __future__ import annotations

import asyncio
import signal
import time

import pytest
import zmq
import zmq.asyncio

from laneserve.broker import protocol as p
from laneserve.broker.client import BrokerClient
from tests.harness import HB, run

pytestmark = pytest.mark.slow


async def _drain(stream) -> list:
    return [m async for m in stream]


def test_request_waits_for_a_broker_that_starts_later(stack) -> None:
    """Submitted before any broker runs: it waits, then runs once the broker and worker are up."""

    async def main():
        async with BrokerClient(stack.front, heartbeat_interval_s=HB) as c:
            t0 = time.monotonic()
            task = asyncio.create_task(
                _drain(
                    c.submit(
                        prompt="early",
                        stream=False,
                        sampling_params={"max_tokens": 5},
                        deadline=t0 + 30,
                    )
                )
            )
            await asyncio.sleep(0.5)
            assert not task.done() and not c.connected
            stack.start_broker()
            stack.start_worker("w1", "--synthetic-step-ms", "5")
            msgs = await task
            return msgs, time.monotonic() - t0, dict(c.counters)

    msgs, elapsed, counters = run(main())
    assert len(msgs) == 1 and type(msgs[0]) is p.Final, msgs
    assert len(msgs[0].token_ids) == 5 and msgs[0].finish_reason == "length"
    assert 0.5 < elapsed < 30 and counters["resubmitted"] == 0, (elapsed, counters)


def test_without_a_broker_requests_end_at_their_deadline(stack) -> None:
    """No broker at all: a request with a deadline ends with deadline_exceeded at that deadline;
    one without waits ``connect_timeout_s`` and ends with a retryable no_worker."""

    async def main():
        async with BrokerClient(stack.front, heartbeat_interval_s=HB, connect_timeout_s=1.5) as c:
            t0 = time.monotonic()

            async def timed(**kw):
                msgs = await _drain(c.submit(prompt="nobody", **kw))
                return msgs, time.monotonic() - t0

            return await asyncio.gather(timed(deadline=t0 + 1.0), timed(stream=False))

    (with_deadline, t_deadline), (without, t_without) = run(main())
    err = with_deadline[-1]
    assert len(with_deadline) == 1 and err.code == "deadline_exceeded", with_deadline
    assert 1.0 <= t_deadline < 1.6, t_deadline
    err = without[-1]
    assert len(without) == 1 and err.code == "no_worker" and err.retryable, without
    assert 1.5 <= t_without < 1.5 + 3 * HB + 0.5, t_without


def test_silent_broker_fails_started_streams_and_resends_the_rest(stack) -> None:
    """SIGSTOP the broker past the client's liveness, then SIGCONT: the stream that delivered
    tokens ends with a retryable worker_lost; the non-streaming request and the stream that
    waited (no token yet) are resent to the same broker, which follows them: both complete."""
    stack.start_broker("--liveness", "100")  # the broker and worker themselves wait it out
    stack.start_worker(
        "w1", "--synthetic-step-ms", "20", "--max-num-seqs", "2", "--liveness", "100"
    )
    stack.wait_workers({"w1"})

    async def main():
        async with BrokerClient(stack.front, heartbeat_interval_s=HB, liveness_s=1.0) as c:
            sp = {"max_tokens": 200}
            started = c.submit(request_id="started", prompt="a", sampling_params=sp)
            first = await anext(started)
            whole = asyncio.create_task(
                _drain(c.submit(request_id="whole", prompt="b", stream=False, sampling_params=sp))
            )
            waiting = asyncio.create_task(
                _drain(
                    c.submit(request_id="waiting", prompt="c", sampling_params={"max_tokens": 5})
                )
            )
            await asyncio.sleep(0.2)
            assert stack.broker is not None
            stack.broker.send_signal(signal.SIGSTOP)
            t_stop = time.monotonic()
            try:
                rest = await asyncio.wait_for(_drain(started), 10)
                lost_after = time.monotonic() - t_stop
                await asyncio.sleep(0.5)
            finally:
                stack.broker.send_signal(signal.SIGCONT)
            return first, rest, lost_after, await whole, await waiting, dict(c.counters)

    first, rest, lost_after, whole, waiting, counters = run(main())
    assert type(first) is p.Delta
    err = rest[-1]
    assert type(err) is p.Error and err.code == "worker_lost" and err.retryable, rest[-3:]
    # the client's silence clock starts at the broker's last frame, which came up to one
    # heartbeat before the SIGSTOP (0.998 s after it was once measured)
    assert "silent" in err.message and 1.0 - HB <= lost_after < 1.0 + 3 * HB + 0.5, (
        err, lost_after,
    )  # fmt: skip
    assert type(whole[-1]) is p.Final and len(whole[-1].token_ids) == 200, whole[-1]
    tokens = [t for m in waiting for t in m.token_ids]
    assert type(waiting[-1]) is p.Final and len(tokens) == 5, (waiting, stack.logs())
    assert counters["resubmitted"] >= 2 and counters["stream_lost"] == 1, counters


def test_epoch_change_on_a_live_connection_resends_and_drops_the_left_one(tmp_path) -> None:
    """A heartbeat with a new epoch on the same connection: the client closes it (a stream with
    content gets worker_lost naming both epochs), resends the non-streaming request under its id
    on a new connection, and an answer addressed to the left connection never reaches it."""
    addr = f"ipc://{tmp_path}/fake.sock"

    async def main():
        router = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        router.bind(addr)

        async def recv(kind, not_from: bytes = b""):
            for _ in range(100):  # skip the periodic hellos and old-connection leftovers
                ident, *frames = await asyncio.wait_for(router.recv_multipart(), 5)
                msg = p.decode(frames, p.CLIENT_TO_BROKER)
                if type(msg) is kind and ident != not_from:
                    return ident, msg
            raise AssertionError(f"no {kind.__name__}")

        async def send(ident: bytes, msg) -> None:
            await router.send_multipart([ident, *msg.to_frames()])

        try:
            async with BrokerClient(addr, heartbeat_interval_s=HB) as c:
                old, _ = await recv(p.Hello)
                await send(old, p.Heartbeat(epoch="A"))
                whole = c.submit(request_id="whole", prompt="x", stream=False)
                streamed = c.submit(request_id="streamed", prompt="y")
                sent = {(await recv(p.Submit))[1].request_id for _ in range(2)}
                await send(old, p.Delta(request_id="streamed", text="t", token_ids=[7]))
                first = await anext(streamed)
                await send(old, p.Heartbeat(epoch="B"))
                end = await asyncio.wait_for(anext(streamed), 5)
                new, _ = await recv(p.Hello, not_from=old)
                await send(new, p.Heartbeat(epoch="B"))
                _, resent = await recv(p.Submit, not_from=old)
                await send(old, p.Final(request_id="whole", finish_reason="stop", text="old"))
                await send(new, p.Final(request_id="whole", finish_reason="stop", text="new"))
                got = await asyncio.wait_for(_drain(whole), 5)
                return sent, first, end, resent, got, dict(c.counters)
        finally:
            router.close(linger=0)

    sent, first, end, resent, got, counters = run(main(), timeout_s=30)
    assert sent == {"whole", "streamed"} and type(first) is p.Delta
    assert type(end) is p.Error and end.code == "worker_lost" and end.retryable, end
    assert "epoch A -> B" in end.message, end.message
    assert resent.request_id == "whole" and resent.edge_ms > 0, resent
    assert [type(m) for m in got] == [p.Final] and got[0].text == "new", got
    assert counters["resubmitted"] == 1 and counters["connections"] == 2, counters


def test_restartable_stream_runs_again_after_its_worker_is_lost(stack) -> None:
    """A ``restartable`` stream (the gateway's non-streaming response) that had tokens when its
    worker was SIGKILLed: the client yields a Restart, then the whole output of a new run; a
    plain stream under way on the same worker ends with the retryable worker_lost. Both sample
    with a seed, which the broker does not resume on another worker (unseeded ones go on where
    they were: test_broker_processes)."""
    stack.start_broker()
    w1 = stack.start_worker("w1", "--synthetic-step-ms", "20")
    stack.wait_workers({"w1"})

    async def main():
        async with BrokerClient(stack.front, heartbeat_interval_s=HB) as c:
            sp = {"max_tokens": 100, "seed": 1, "temperature": 0.7}
            restartable = c.submit(request_id="r", prompt="a", sampling_params=sp, restartable=True)
            plain = c.submit(request_id="p", prompt="b", sampling_params=sp)
            head = [await anext(restartable), await anext(plain)]
            w1.send_signal(signal.SIGKILL)
            w1.wait()
            stack.start_worker("w2", "--synthetic-step-ms", "5")
            return head, *await asyncio.gather(_drain(restartable), _drain(plain))

    head, rest, plain_rest = run(main())
    assert all(type(m) is p.Delta for m in head), head
    kinds = [type(m).__name__ for m in rest]
    assert kinds.count("Restart") == 1, kinds
    after = rest[kinds.index("Restart") + 1 :]
    assert type(after[-1]) is p.Final and after[-1].worker_id == "w2", after[-1]
    assert sum(len(m.token_ids) for m in after) == 100, [type(m) for m in after][:5]
    err = plain_rest[-1]
    assert type(err) is p.Error and err.code == "worker_lost" and err.retryable, err


def test_a_request_the_wire_cannot_carry_fails_at_submit_and_a_restart_still_recovers(
    stack,
) -> None:
    """A sampling value msgpack cannot encode (an int past 64 bits) raises ProtocolError at
    submit, before the request is tracked. It used to be tracked first: every reconnect then
    sent it again from the reader task, whose TypeError killed the reader, so after a broker
    restart the client never heard the broker again (every request a 503)."""
    stack.start_broker()
    stack.start_worker("w1", "--synthetic-step-ms", "5")
    stack.wait_workers({"w1"})

    async def main():
        async with BrokerClient(stack.front, heartbeat_interval_s=HB, liveness_s=1.0) as c:
            with pytest.raises(p.ProtocolError, match="cannot be encoded"):
                c.submit(prompt="x", sampling_params={"max_tokens": 4, "top_k": 2**64})
            assert c.in_flight == 0
            before = await _drain(c.submit(prompt="a", sampling_params={"max_tokens": 3}))
            stack.kill("broker")
            stack.start_broker()
            t0 = time.monotonic()
            after = await _drain(
                c.submit(prompt="b", sampling_params={"max_tokens": 3}, deadline=t0 + 20)
            )
            return before, after, time.monotonic() - t0

    before, after, elapsed = run(main())
    assert type(before[-1]) is p.Final, before
    tokens = [t for m in after for t in m.token_ids]
    assert type(after[-1]) is p.Final and len(tokens) == 3, (after, stack.logs())
    assert elapsed < 20, elapsed
