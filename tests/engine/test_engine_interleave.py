"""Interactive steps between the layers of a batch-only step (gpu_worker/interleave.py), on the
bundled model in float32: an interactive request that arrives while a batch step is in flight
gets its tokens before that step ends, every request's greedy tokens are the ones it gets
without interleaving, an abort of a request in flight waits for its step, and an interleaved
step never preempts the requests in flight."""

from __future__ import annotations

import asyncio
import time

from laneserve.broker import protocol as p
from laneserve.broker.client import BrokerClient
from laneserve.contracts.engine_io import EngineRequest
from laneserve.gpu_worker import SamplingParams
from tests.harness import in_process_broker

BATCH_PROMPTS = [
    "Summarize: the quick brown fox jumps over the lazy dog while the cat sleeps in the sun.",
    "Translate to French: where is the train station, and when does the next train leave?",
    "List three colours and say which one you like best, and why, in one sentence.",
]
CHAT = "Hi! What is two plus two?"
GREEDY = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}


def _ids(llm, text: str) -> list[int]:
    return llm.engine.prompts.encode(text)


def _run(engine, hook=None, max_steps: int = 500) -> tuple[dict[str, list[int]], dict, list]:
    """Step `engine` to the end with `hook` installed; tokens per request id, finish reasons,
    and the step (1-based) in which each request's first token came, the hook's outputs
    counting in the step in flight."""
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    first_step: dict[str, int] = {}
    step_no = 0

    def take(outputs) -> None:
        for o in outputs:
            if o.new_token_ids and o.request_id not in first_step:
                first_step[o.request_id] = step_no
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                reasons[o.request_id] = o.finish_reason

    engine.interleave.install(None if hook is None else (lambda: hook(take)))
    try:
        while engine.has_unfinished_requests() and step_no < max_steps:
            step_no += 1
            take(engine.step())
    finally:
        engine.interleave.install(None)
    return tokens, reasons, first_step


def _serve_due(engine, take) -> None:
    """What the worker's hook does once arrivals are in: interleaved steps while one is due."""
    while engine.interleave.due():
        out = engine.interleave.run_step()
        if not out:
            break
        take(out)


def _add_batch(llm, n: int = len(BATCH_PROMPTS)) -> None:
    for i, text in enumerate(BATCH_PROMPTS[:n]):
        llm.engine.add(EngineRequest(f"b{i}", _ids(llm, text), GREEDY, "batch"))


def test_an_arrival_is_served_between_layers_with_the_same_tokens(base_llm):
    llm, engine = base_llm, base_llm.engine
    # reference: the chat arrives at the same point but runs only after the step in flight
    _add_batch(llm)
    arrived = []

    def arrive_only(take):
        if not arrived:
            arrived.append(1)
            engine.add(EngineRequest("chat", _ids(llm, CHAT), GREEDY, "interactive"))

    want, want_reasons, want_first = _run(engine, arrive_only)
    assert want_first["chat"] == 2
    llm.engine.block_manager.reset_prefix_cache()

    calls = []
    steps_before = engine.interleave.num_steps

    def hook(take):
        calls.append(engine.interleave.in_flight)
        if len(calls) == 3:  # mid-forward of the first batch step
            engine.add(EngineRequest("chat", _ids(llm, CHAT), GREEDY, "interactive"))
        _serve_due(engine, take)

    _add_batch(llm)
    got, reasons, first_step = _run(engine, hook)
    assert calls and calls[0] == frozenset(f"b{i}" for i in range(len(BATCH_PROMPTS)))
    assert got == want and reasons == want_reasons
    assert first_step["chat"] == 1  # before the batch step it arrived in had ended
    assert engine.interleave.num_steps - steps_before >= len(want["chat"])  # all interleaved
    assert engine.scheduler.num_preemptions == 0
    # every hook call was inside a batch-only step: never one that held the chat
    assert all("chat" not in ids for ids in calls)


def test_an_abort_of_a_request_in_flight_waits_for_its_step(base_llm):
    llm, engine = base_llm, base_llm.engine
    _add_batch(llm, 2)
    free_before = None

    def hook(take):
        nonlocal free_before
        if "b0" in engine.interleave.in_flight and free_before is None:
            free_before = engine.block_manager.num_free_blocks
            engine.abort_request("b0")
            # deferred: its blocks still belong to the step writing them
            assert engine.block_manager.num_free_blocks == free_before
            assert "b0" in engine.scheduler.requests

    tokens, reasons, _ = _run(engine, hook)
    assert free_before is not None
    assert reasons == {"b0": "abort", "b1": "length"}
    assert len(tokens["b1"]) == GREEDY["max_tokens"]
    assert engine.interleave.in_flight == frozenset()


def test_an_interleaved_step_never_preempts_the_step_in_flight(make_llm):
    # a pool the batch requests nearly fill: the chat cannot get its blocks mid-step and
    # waits for the step in flight to end (then the scheduler may preempt, as always)
    llm = make_llm(num_blocks=12, block_size=16, max_model_len=160)
    engine = llm.engine
    for i, words in enumerate(["the river runs to the sea ", "a cloud drifts over a hill "]):
        text = "Summarize this text in detail: " + words * 12  # ~80 tokens, 6 blocks each
        engine.add(EngineRequest(f"b{i}", _ids(llm, text), GREEDY, "batch"))
    seen = {"runs": 0, "empty": 0}

    def hook(take):
        if not seen["runs"]:
            chat = "Tell me a story about " + "a mountain and a lake " * 12  # no prefix hit
            engine.add(EngineRequest("chat", _ids(llm, chat), GREEDY, "interactive"))
        if engine.interleave.in_flight and engine.interleave.due():
            preempted = engine.scheduler.num_preemptions
            out = engine.interleave.run_step()
            seen["runs"] += 1
            seen["empty"] += not out
            assert engine.scheduler.num_preemptions == preempted
            take(out)

    tokens, reasons, _ = _run(engine, hook)
    assert seen["empty"] >= 1  # it waited at least once for want of blocks
    assert reasons == {"b0": "length", "b1": "length", "chat": "length"}
    engine.check_integrity()


def test_interleaving_is_off_for_a_step_that_holds_an_interactive_request(base_llm):
    llm, engine = base_llm, base_llm.engine
    engine.add(EngineRequest("chat", _ids(llm, CHAT), GREEDY, "interactive"))
    _add_batch(llm, 1)
    calls = []
    tokens, reasons, _ = _run(engine, lambda take: calls.append(1))
    assert not calls and reasons == {"chat": "length", "b0": "length"}


def test_sampling_params_of_interleaved_steps_are_their_own(base_llm):
    """A seeded sampled chat interleaved into greedy batch steps draws the tokens it draws alone."""
    llm, engine = base_llm, base_llm.engine
    sampled = SamplingParams(max_tokens=5, temperature=1.0, seed=7, ignore_eos=True)
    engine.add(EngineRequest("chat", _ids(llm, CHAT), sampled, "interactive"))
    want, _, _ = _run(engine)
    added = []

    def hook(take):
        if not added and "b0" in engine.interleave.in_flight:
            added.append(1)
            engine.add(EngineRequest("chat", _ids(llm, CHAT), sampled, "interactive"))
        _serve_due(engine, take)

    _add_batch(llm, 1)
    got, _, _ = _run(engine, hook)
    assert got["chat"] == want["chat"]


def test_a_worker_answers_a_chat_inside_a_long_batch_step(make_llm):
    """A real broker and worker (threads of this process, ipc sockets): a chat sent while the
    worker's engine runs one long batch prefill step gets its whole answer before that step
    ends -- its steps ran between the step's layers, and the batch request's first token comes
    after the chat's last."""

    llm = make_llm(max_model_len=2048, num_blocks=2048 // 16 + 16, max_num_batched_tokens=2048)
    engine = llm.engine
    long_prompt = _ids(llm, "Summarize: " + "the tide comes in and the tide goes out; " * 130)
    assert 1200 < len(long_prompt) < 2000  # one prefill step of ~1,500 tokens
    events: list[tuple[str, str]] = []

    async def collect(client, request) -> None:
        async for msg in client.submit_request(request, stream=True):
            if type(msg) in (p.Delta, p.Final):
                events.append((request.request_id, type(msg).__name__))

    async def main(front: str) -> None:
        async with BrokerClient(front) as client:
            batch = EngineRequest("batch", long_prompt, GREEDY, "batch")
            job = asyncio.create_task(collect(client, batch))
            deadline = time.monotonic() + 60
            while not engine.interleave.in_flight:  # the long step has started
                assert time.monotonic() < deadline, "the batch step never started"
                await asyncio.sleep(0.002)
            chat = EngineRequest("chat", _ids(llm, CHAT), GREEDY, "interactive")
            await collect(client, chat)
            await job

    with in_process_broker(engine) as front:
        asyncio.run(asyncio.wait_for(main(front), 300))
    chat_final = events.index(("chat", "Final"))
    batch_first = next(i for i, (rid, _) in enumerate(events) if rid == "batch")
    assert chat_final < batch_first, events
    assert engine.interleave.num_steps >= GREEDY["max_tokens"]  # prefill + decodes, between layers
    assert engine.stats()["num_interleaved_steps"] == engine.interleave.num_steps
