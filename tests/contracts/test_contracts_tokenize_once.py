"""A prompt is templated and tokenized once, where it is counted (the gateway's or the jobs
runner's `ServedModel.check`): what goes on to the engine is those ids (`Prompt.wire`), for a
chat, a completion and a batch line (the bundled model's real tokenizer, its calls counted)."""

from __future__ import annotations

import dataclasses
import json

from laneserve.contracts.engine_io import EngineRequest, TextRequest
from laneserve.contracts.openai import Limits, ServedModel, parse
from laneserve.contracts.openai.requests import CHAT_ENDPOINT, COMPLETIONS_ENDPOINT
from laneserve.contracts.tokens import PromptTokenizer, prompt_ids
from laneserve.jobs.results import choice_requests
from laneserve.jobs.validate import Validator

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


class CountingTokenizer(PromptTokenizer):
    """The real tokenizer, counting its `encode` and `render_chat` calls."""

    calls = 0

    def encode(self, text, *, add_special_tokens=False):
        type(self).calls += 1
        return super().encode(text, add_special_tokens=add_special_tokens)

    def render_chat(self, messages):
        type(self).calls += 1
        return super().render_chat(messages)


def _tokenizer(smollm2_dir) -> CountingTokenizer:
    tok = PromptTokenizer.load(smollm2_dir)
    CountingTokenizer.calls = 0
    return CountingTokenizer(**{f.name: getattr(tok, f.name) for f in dataclasses.fields(tok)})


def test_the_edge_sends_the_ids_it_counted(smollm2_dir) -> None:
    tok = _tokenizer(smollm2_dir)
    model = ServedModel("smollm2", tok, 2048, 49152)
    reference = prompt_ids(PromptTokenizer.load(smollm2_dir), messages=MESSAGES)
    cases = [
        (CHAT_ENDPOINT, {"model": "smollm2", "messages": MESSAGES}, 2, reference),
        (COMPLETIONS_ENDPOINT, {"model": "smollm2", "prompt": "Paris is"}, 1, None),
    ]
    for endpoint, body, calls, ids in cases:
        CountingTokenizer.calls = 0
        req = parse(endpoint, body, Limits())
        model.check(req, Limits())
        (prompt,) = req.prompts
        assert CountingTokenizer.calls == calls  # render + encode for chat, encode for text
        wire = prompt.wire()
        assert list(wire) == ["prompt_token_ids"] and len(wire["prompt_token_ids"]) > 0
        assert wire["prompt_token_ids"] == (ids or prompt.encoded)
        assert prompt.num_tokens == len(wire["prompt_token_ids"])


def test_without_a_tokenizer_the_engine_gets_the_prompt_as_given() -> None:
    req = parse(CHAT_ENDPOINT, {"model": "m", "messages": MESSAGES}, Limits())
    ServedModel("m").check(req, Limits())
    assert req.prompts[0].wire() == {"messages": MESSAGES}
    (request,) = req.engine_requests("r1")  # sent as text: the worker's front end tokenizes it
    assert request == TextRequest("r1", messages=MESSAGES, sampling_params=req.sampling_for(0),
                                  lane=req.lane, priority=req.priority)  # fmt: skip
    assert request.prompt_fields() == {"messages": MESSAGES}


def test_a_batch_line_is_tokenized_once_by_its_validator(smollm2_dir, tmp_path) -> None:
    """A chat line (n=2) and a summarize task line: the validator tokenizes each once, the
    runner's dispatch sends those ids (every choice) and tokenizes nothing again."""
    tok = _tokenizer(smollm2_dir)
    model = ServedModel("smollm2", tok, 2048, 49152)
    line = {"custom_id": "a", "method": "POST", "url": CHAT_ENDPOINT,
            "body": {"model": "smollm2", "messages": MESSAGES, "n": 2}}  # fmt: skip
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps(line) + "\n")
    (result,) = Validator(CHAT_ENDPOINT, model).lines(path)
    assert result.error is None, result.error
    assert CountingTokenizer.calls == 2  # render + encode
    reference = prompt_ids(PromptTokenizer.load(smollm2_dir), messages=MESSAGES)
    _, requests = choice_requests("r1", result.request)
    assert CountingTokenizer.calls == 2  # dispatch tokenizes nothing again
    assert [r.request_id for r in requests] == ["r1", "r1-1"]
    assert all(type(r) is EngineRequest and r.prompt_token_ids == reference
               and r.lane == "batch" for r in requests)  # fmt: skip

    path.write_text(json.dumps({"id": "d1", "text": "A long day at the lake. " * 20}) + "\n")
    CountingTokenizer.calls = 0
    (result,) = Validator(CHAT_ENDPOINT, model, task="summarize").lines(path)
    assert result.error is None, result.error
    assert CountingTokenizer.calls == 2  # counted for the context check, not again
    _, (request,) = choice_requests("d1", result.request)
    assert len(request.prompt_token_ids) == result.prompt_tokens
