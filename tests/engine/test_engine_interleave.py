"""Interactive steps between the layers of a batch-only step (gpu_worker/interleave.py), on the
bundled model in float32: an interactive request that arrives while a batch step is in flight
gets its tokens before that step ends, every request's greedy tokens are the ones it gets
without interleaving, an abort of a request in flight waits for its step, and an interleaved
step never preempts the requests in flight nor reads KV blocks the step in flight is writing.

Interleaving paces streams by the SLO controller, so each engine here gets one (`_paced`): an
operator's TTFT target far off (batch-only steps take the whole budget, with or without
interleaving, so the reference runs cut the work alike) and a TPOT target that makes every
stream due at every layer."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from laneserve.broker import protocol as p
from laneserve.broker.client import BrokerClient
from laneserve.contracts.engine_io import EngineRequest
from laneserve.gpu_worker import SamplingParams
from laneserve.gpu_worker.slo import LaneSlo, SloTargets
from laneserve.gpu_worker.step_budget import BudgetController
from laneserve.gpu_worker.step_cost import StepCostModel
from tests.harness import in_process_broker

BATCH_PROMPTS = [
    "Summarize: the quick brown fox jumps over the lazy dog while the cat sleeps in the sun.",
    "Translate to French: where is the train station, and when does the next train leave?",
    "List three colours and say which one you like best, and why, in one sentence.",
]
CHAT = "Hi! What is two plus two?"
GREEDY = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}


@contextlib.contextmanager
def _paced(engine, tpot_ms: float = 0.001):
    """`engine` with an SLO controller for the test's length (module docstring)."""
    targets = SloTargets(LaneSlo(ttft_ms=600_000.0, tpot_ms=tpot_ms), LaneSlo(1e6, 1e6))
    max_tokens = engine.scheduler.config.max_num_batched_tokens
    ctl = BudgetController(
        targets, StepCostModel([4.0, 0.5, 0.3, 2.0, 0.6]), max_tokens, wall_clock=False,
        given_ttft=True,
    )  # fmt: skip
    engine.scheduler.step_budget = ctl
    try:
        yield ctl
    finally:
        engine.scheduler.step_budget = None


@pytest.fixture
def engine(base_llm):
    with _paced(base_llm.engine):
        yield base_llm.engine


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

    # the hook alone (`install` would also size batch-only steps for interleaving: the
    # reference runs here must cut the work as the interleaved ones do)
    engine.interleave.hook = None if hook is None else (lambda: hook(take))
    try:
        while engine.has_unfinished_requests() and step_no < max_steps:
            step_no += 1
            take(engine.step())
    finally:
        engine.interleave.hook = None
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


def test_an_arrival_is_served_between_layers_with_the_same_tokens(base_llm, engine):
    llm = base_llm
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


def test_an_interleaved_prompt_never_reads_blocks_the_step_in_flight_writes(base_llm, engine):
    """A chat sharing its first blocks with the batch prompt in flight: those blocks are in the
    prefix cache from their allocation, but their KV is written layer by layer by the step in
    flight, so the chat computes them itself -- its tokens are those it gets alone, and the
    cache it leaves serves the same tokens again."""
    llm = base_llm
    shared = "You are a careful assistant who answers in one short sentence. " * 6
    chat = EngineRequest("chat", _ids(llm, shared + "What is two plus two?"), GREEDY, "interactive")
    engine.add(chat)
    want, _, _ = _run(engine)
    engine.block_manager.reset_prefix_cache()
    added = []

    def hook(take):
        if len(added) < 1 and "b0" in engine.interleave.in_flight:
            added.append(1)
            engine.add(chat)
        _serve_due(engine, take)

    engine.add(EngineRequest("b0", _ids(llm, shared + "Summarize the sea."), GREEDY, "batch"))
    got, _, first_step = _run(engine, hook)
    assert first_step["chat"] == 1 and got["chat"] == want["chat"]
    engine.add(chat)  # now a real prefix-cache hit on blocks computed whole
    again, _, _ = _run(engine)
    assert again["chat"] == want["chat"]
    assert engine.block_manager.prefix_cache_hits > 0


def test_pieces_count_the_pauses_by_their_longest_segment(base_llm, engine):
    """SmolLM2's forward of a few rows pauses 3 x 30 times (before each layer but the first,
    twice inside it, before the LM head); a long step's gate/up runs in two halves with a pause
    between (`test_a_long_step_pauses_inside_its_gate_up_with_the_same_tokens`), so each of its
    four segments a layer holds a quarter of the weights: 120 pieces, 118 once the embedding and
    the tail are counted. A model mixing MoE and dense layers is counted by its largest segment
    anywhere."""
    import dataclasses

    from laneserve.gpu_worker.models.llama import pause_pieces

    calls = []
    _add_batch(base_llm, 1)
    _run(engine, lambda take: calls.append(engine.interleave.in_flight))
    c = engine.model_config
    assert pause_pieces(c) == 120.0 and engine.interleave.pieces == 118
    assert pause_pieces(c, split=False) == 60.0 and engine.interleave.pieces_short == 58
    assert len(calls) % (3 * c.num_hidden_layers) == 0 and calls  # every batch step's
    moe = dataclasses.replace(c, moe_layers=tuple(range(c.num_hidden_layers)), num_experts=8,
                              num_experts_per_tok=2, moe_intermediate_size=c.intermediate_size)  # fmt: skip
    assert c.num_hidden_layers < pause_pieces(moe) < 2 * c.num_hidden_layers
    mixed = dataclasses.replace(moe, moe_layers=tuple(range(0, c.num_hidden_layers, 2)))
    h = c.hidden_size
    attention = h * c.head_dim * (2 * c.num_attention_heads + 2 * c.num_key_value_heads)
    layers = [
        (attention, 3 * h * c.intermediate_size * 2 + h * 8) if i % 2 == 0
        else (attention, *[h * c.intermediate_size] * 3)
        for i in range(c.num_hidden_layers)
    ]  # fmt: skip
    longest = max(max(parts) for parts in layers)
    assert pause_pieces(mixed) == pytest.approx(sum(map(sum, layers)) / longest)
    # each layer by its own largest segment would promise more, shorter pieces than it leaves
    assert sum(sum(parts) / max(parts) for parts in layers) > 1.2 * pause_pieces(mixed)


def test_a_long_step_pauses_inside_its_gate_up_with_the_same_tokens(base_llm, engine):
    """A paused step of `SPLIT_ROWS` rows or more runs each gate/up in two row halves with a
    pause between (four pauses a layer, three in a shorter step). A chat served at the pause
    between the halves of the first layer's gate/up, and the long request, get the greedy
    tokens each gets alone."""
    from laneserve.gpu_worker.models.llama import SPLIT_ROWS

    ids = _ids(base_llm, " ".join(BATCH_PROMPTS * 8))
    assert SPLIT_ROWS <= len(ids) <= engine.scheduler.config.max_num_batched_tokens
    chat = EngineRequest("chat", _ids(base_llm, CHAT), GREEDY, "interactive")
    reference = {}
    for request in (EngineRequest("long", ids, GREEDY, "batch"), chat):
        engine.scheduler.block_manager.reset_prefix_cache()  # each prompt computed in full
        base_llm.engine.add(request)
        reference.update(_run(engine)[0])
    engine.scheduler.block_manager.reset_prefix_cache()
    base_llm.engine.add(EngineRequest("long", ids, GREEDY, "batch"))
    calls = []

    def hook(take) -> None:
        calls.append(1)
        if len(calls) == 2:  # layer 0: after its attention, then between its gate/up halves
            base_llm.engine.add(chat)
            _serve_due(engine, take)

    tokens, _, first_step = _run(engine, hook)
    assert tokens == reference and len(reference["long"]) == GREEDY["max_tokens"]
    assert first_step["chat"] == 1  # its first token came inside the long prompt's prefill
    layers = engine.model_config.num_hidden_layers
    # the prompt's prefill in one step (four pauses a layer), then steps of one or two rows
    # (three): the chat's remaining tokens come in interleaved steps or regular ones
    steps = len(calls) - 4 * layers
    assert steps > 0 and steps % (3 * layers) == 0


def test_a_stream_is_due_a_piece_before_it_would_be_late(base_llm):
    """A stream is due its next token at a pause when its gap, plus an interleaved step, would
    reach the TPOT target by the next pause (`piece_ms` of the step in flight away): served a
    piece later it would be late by up to that piece."""
    engine = base_llm.engine
    with _paced(engine, tpot_ms=50.0):
        engine.add(EngineRequest("s", _ids(base_llm, CHAT), GREEDY, "interactive"))
        engine.step()  # its prefill: a stream with one token
        stream = next(r for r in engine.scheduler.running if r.request_id == "s")
        il = engine.interleave
        il.step_ms, il.piece_ms = 10.0, 0.0
        stream.last_token_time = time.monotonic() - 0.020  # 20 + 10 ms: not due at 50
        assert not il.due()
        il.piece_ms = 25.0  # the next pause would come after the target
        assert il.due()
        engine.abort_request("s")
        il.piece_ms = 0.0
        assert _run(engine)[1] == {"s": "abort"}  # its output taken: the engine left clean


def test_an_abort_of_a_request_in_flight_waits_for_its_step(base_llm, engine):
    llm = base_llm
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
    engine.scheduler.step_budget = next(_paced(engine).gen)  # this engine's whole life
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


def test_interleaving_is_off_for_a_step_that_holds_an_interactive_request(base_llm, engine):
    llm = base_llm
    engine.add(EngineRequest("chat", _ids(llm, CHAT), GREEDY, "interactive"))
    _add_batch(llm, 1)  # b0 gets 6 tokens with the chat, then runs alone (interleavable)
    engine.add(EngineRequest("b1", _ids(llm, BATCH_PROMPTS[1]), {**GREEDY, "max_tokens": 12}))
    calls = []
    tokens, reasons, _ = _run(engine, lambda take: calls.append("chat" in engine.states))
    assert calls and not any(calls)  # called only once the chat was done
    assert reasons == {"chat": "length", "b0": "length", "b1": "length"}


def test_sampling_params_of_interleaved_steps_are_their_own(base_llm, engine):
    """A seeded sampled chat interleaved into greedy batch steps draws the tokens it draws alone."""
    llm = base_llm
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
    worker's engine runs one long batch prefill step gets its first token before that step
    ends (its steps ran at the step's pause points), and both requests complete."""

    llm = make_llm(max_model_len=2048, num_blocks=2048 // 16 + 16, max_num_batched_tokens=2048)
    engine = llm.engine
    engine.scheduler.step_budget = next(_paced(engine, tpot_ms=50.0).gen)  # as a worker's
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
    chat_first = events.index(("chat", "Delta"))
    batch_first = next(i for i, (rid, _) in enumerate(events) if rid == "batch")
    assert chat_first < batch_first, events  # its first token came inside the batch step
    assert ("chat", "Final") in events and ("batch", "Final") in events
    assert engine.interleave.num_steps >= 2  # its prefill and paced decodes, inside the step
    assert engine.stats()["num_interleaved_steps"] == engine.interleave.num_steps


def test_split_halves_stay_above_every_small_row_route():
    """Each half of a split gate/up (the smaller is `SPLIT_ROWS // 2` rows at least) takes the
    route the whole takes: no half falls under a threshold below which fewer rows change kernel
    (GEMVs, the tiles' start, K-quant GEMVs, the bf16 GEMVs, AMX's start)."""
    from laneserve.gpu_worker import kernel_routes as kr
    from laneserve.gpu_worker.models.llama import SPLIT_ROWS

    tops = [
        kr.DENSE_MIN_TOKENS, kr.DENSE_MIN_TOKENS_FP32, kr.DENSE_MIN_TOKENS_FP32_GGUF_ORDER,
        kr.GEMV_MAX_TOKENS + 1, kr.BF16_GEMV_MAX_TOKENS + 1, kr.BF16_DENSE_GEMV_MAX_TOKENS + 1,
        kr.AMX_MIN_TOKENS, *(n + 1 for n in kr.KQUANT_GEMV_MAX_TOKENS.values()),
        *(n + 1 for n in kr.KQUANT_Q8K_MAX_TOKENS.values()),
    ]  # fmt: skip
    assert SPLIT_ROWS // 2 >= max(tops), (SPLIT_ROWS, max(tops))
