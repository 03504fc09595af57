"""One chat request from the edge to the engine and back (issue 47's check), on a real broker and a
real worker serving the bundled model, in this process so every call can be counted: the prompt
is templated and tokenized once (at the edge, with the real tokenizer; the worker's front end and
the engine tokenize nothing), and every wire message on its path is encoded once by its sender
and decoded once by its receiver (client -> broker -> worker IO thread -> engine loop and back);
the engine loop decodes nothing."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import threading
from pathlib import Path

import pytest

from laneserve.broker import protocol as p
from laneserve.broker import worker_side
from laneserve.broker.client import BrokerClient
from laneserve.broker.protocol.base import Message
from laneserve.contracts.engine_io import EngineRequest
from laneserve.contracts.openai import Limits, ServedModel, parse
from laneserve.contracts.openai.requests import CHAT_ENDPOINT
from laneserve.contracts.tokens import PromptTokenizer, prompt_ids
from tests.harness import in_process_broker

MESSAGES = [{"role": "user", "content": "Name three colors."}]
PATH_KINDS = ("submit", "request", "step_outputs", "delta", "final")


class _CountingTokenizer(PromptTokenizer):
    """The real tokenizer, counting its template and tokenize calls under `where`."""

    calls: collections.Counter[str] = collections.Counter()

    def __init__(self, real: PromptTokenizer, where: str) -> None:
        super().__init__(**{f.name: getattr(real, f.name) for f in dataclasses.fields(real)})
        self.where = where

    def encode(self, text, *, add_special_tokens=False):
        self.calls[f"{self.where}.encode"] += 1
        return super().encode(text, add_special_tokens=add_special_tokens)

    def render_chat(self, messages):
        self.calls[f"{self.where}.render_chat"] += 1
        return super().render_chat(messages)


class _Wire:
    """Counts of wire encodes and decodes, by thread and message kind."""

    def __init__(self, monkeypatch) -> None:
        self.counts: collections.Counter[tuple[str, str, str]] = collections.Counter()
        real_decode, real_encode = p.decode, Message.to_frames

        def decode(frames, allowed=None):
            msg = real_decode(frames, allowed)
            self.counts["decode", threading.current_thread().name, msg.KIND] += 1
            return msg

        def to_frames(msg):
            self.counts["encode", threading.current_thread().name, msg.KIND] += 1
            return real_encode(msg)

        def encode_delta(*args):  # the broker's hot path for deltas, without a Delta object
            self.counts["encode", threading.current_thread().name, "delta"] += 1
            return real_delta(*args)

        real_delta = worker_side.encode_delta
        monkeypatch.setattr(p, "decode", decode)  # every receiver calls `p.decode`
        monkeypatch.setattr(Message, "to_frames", to_frames)
        monkeypatch.setattr(worker_side, "encode_delta", encode_delta)

    def by(self, op: str, kind: str) -> dict[str, int]:
        """{thread: count} of `op` ("encode" / "decode") for messages of `kind`."""
        return {t: n for (o, t, k), n in self.counts.items() if o == op and k == kind}


def _edge_request(smollm2_dir: Path) -> EngineRequest:
    """The gateway's front end: parse, count (template + tokenize once), build the request."""
    tok = _CountingTokenizer(PromptTokenizer.load(smollm2_dir), "edge")
    body = {"model": "smollm2", "messages": MESSAGES, "max_tokens": 4, "ignore_eos": True}
    req = parse(CHAT_ENDPOINT, body, Limits())
    ServedModel("smollm2", tok, 1024, 49152).check(req, Limits())
    (request,) = req.engine_requests("chat-1")
    return request


async def _send(front: str, request: EngineRequest) -> list[object]:
    async with BrokerClient(front) as client:
        return [msg async for msg in client.submit_request(request, stream=True)]


@pytest.mark.slow
def test_one_chat_is_tokenized_once_and_decoded_once_per_hop(make_llm, smollm2_dir, monkeypatch):
    llm = make_llm(num_blocks=64)
    engine = llm.engine
    calls = _CountingTokenizer.calls
    calls.clear()
    worker_tok = _CountingTokenizer(engine.prompts.prompt_tokenizer, "worker")
    monkeypatch.setattr(engine.prompts, "prompt_tokenizer", worker_tok)  # the front end's
    for name in ("encode", "apply_chat_template"):  # and the Hugging Face tokenizer's own
        real = getattr(engine.tokenizer, name)

        def counted(*args, _real=real, _key=f"worker.hf.{name}", **kwargs):
            calls[_key] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(engine.tokenizer, name, counted)
    request = _edge_request(smollm2_dir)
    assert calls == {"edge.render_chat": 1, "edge.encode": 1}  # templated, then tokenized
    assert type(request) is EngineRequest
    reference = prompt_ids(PromptTokenizer.load(smollm2_dir), messages=MESSAGES)
    assert request.prompt_token_ids == reference

    calls_wire = _Wire(monkeypatch)
    with in_process_broker(engine) as front:
        messages = asyncio.run(asyncio.wait_for(_send(front, request), 120))
    assert type(messages[-1]) is p.Final and messages[-1].finish_reason == "length", messages
    assert messages[-1].usage["prompt_tokens"] == len(request.prompt_token_ids)

    # tokenized once: nothing on the worker's side templated or tokenized the prompt again
    assert calls == {"edge.render_chat": 1, "edge.encode": 1}, calls
    assert engine.prompts.num_prompts_tokenized == 0
    # each message on the path: encoded once by one sender, decoded once by one receiver
    hops = {"submit": ("MainThread", "broker"), "request": ("broker", "worker-io"),
            "step_outputs": ("engine-loop", "broker"), "delta": ("broker", "MainThread"),
            "final": ("broker", "MainThread")}  # fmt: skip
    for kind, (sender, receiver) in hops.items():
        sent, received = calls_wire.by("encode", kind), calls_wire.by("decode", kind)
        assert list(sent) == [sender] and list(received) == [receiver], (kind, calls_wire.counts)
        assert sent[sender] == received[receiver], (kind, calls_wire.counts)
    assert calls_wire.by("decode", "submit")["broker"] == 1
    assert calls_wire.by("decode", "request")["worker-io"] == 1
    assert calls_wire.by("decode", "final")["MainThread"] == 1
    deltas = sum(type(m) is p.Delta for m in messages)
    assert calls_wire.by("decode", "delta")["MainThread"] == deltas >= 1
    assert not [key for key in calls_wire.counts if key[0] == "decode" and key[1] == "engine-loop"]
    assert set(PATH_KINDS) <= {k for _, _, k in calls_wire.counts}
