"""The additive wire fields behind `echo` / `prompt_logprobs`: `StepOutput`'s optional ninth item
and `Final.prompt_logprobs`, validated like the rest; the OpenAI parsing of the new fields."""

from __future__ import annotations

import msgpack
import pytest

from laneserve.broker import protocol as p
from laneserve.contracts.openai import Limits, OpenAIError, parse
from laneserve.contracts.openai import responses as fmt
from laneserve.gpu_worker.sampling_params import SamplingParams

ENTRIES = [
    {"token_id": 7, "logprob": None, "rank": None, "top": []},
    {"token_id": 9, "logprob": -1.25, "rank": 2, "top": [[3, -0.5], [9, -1.25]]},
]


def _step_frames(outputs: list) -> list[bytes]:
    payload = {"worker_id": "w", "outputs": outputs, "step_ms": 1.0}
    return [p.VERSION_TAG, b"step_outputs", msgpack.packb(payload, use_bin_type=True)]


def test_step_output_carries_prompt_logprobs_and_old_outputs_still_decode() -> None:
    new = p.StepOutputs("w", [p.StepOutput("r1", "a", [1], False, None, None, None, None, ENTRIES)])
    back = p.decode(new.to_frames(), p.WORKER_TO_BROKER)
    assert back.outputs[0].prompt_logprobs == ENTRIES
    old = p.decode(_step_frames([["r1", "a", [1], False, None, None, None, None]]))
    assert old.outputs[0].prompt_logprobs is None  # an eight-item output (older worker)
    with pytest.raises(p.ProtocolError):
        p.decode(_step_frames([["r1", "a", [1], False, None, None, None, None, "nope"]]))
    # the optional 10th item is an embed request's vector (bytes); an 11th is refused
    vec = p.decode(_step_frames([["r1", "", [], True, "stop", None, None, None, None, b"\0" * 8]]))
    assert vec.outputs[0].embedding == b"\0" * 8
    with pytest.raises(p.ProtocolError):
        p.decode(_step_frames([["r1", "", [], True, "stop", None, None, None, None, "nope"]]))
    with pytest.raises(p.ProtocolError):
        p.decode(_step_frames([["r1", "a", [1], False, None, None, None, None, None, None, None]]))


def test_final_carries_prompt_logprobs() -> None:
    final = p.Final("r1", "length", prompt_logprobs=ENTRIES)
    assert p.decode(final.to_frames(), p.BROKER_TO_CLIENT).prompt_logprobs == ENTRIES
    assert p.decode(p.Final("r2", "stop").to_frames()).prompt_logprobs is None


def test_parse_echo_prompt_logprobs_min_p_logit_bias() -> None:
    body = {"model": "m", "prompt": "hi", "echo": True, "logprobs": 1, "max_tokens": 0}
    req = parse("/v1/completions", body, Limits())
    assert req.echo and req.echo_only and req.max_tokens == 1
    assert req.sampling["prompt_logprobs"] == 1 and req.sampling["logprobs"] == 1
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "min_p": 0.2,
            "logit_bias": {"5": -100, "6": 2.5}}  # fmt: skip
    req = parse("/v1/chat/completions", body, Limits())
    assert req.sampling["min_p"] == 0.2 and req.sampling["logit_bias"] == [[5, -100.0], [6, 2.5]]
    assert SamplingParams.from_dict(req.sampling).logit_bias == {5: -100.0, 6: 2.5}
    for bad in ({"max_tokens": 0}, {"echo": True, "stream": True}, {"prompt_logprobs": 21},
                {"min_p": 1.5}, {"logit_bias": {"a": 1}}, {"logit_bias": {"1": 100.5}}):  # fmt: skip
        with pytest.raises(OpenAIError) as info:
            parse("/v1/completions", {"model": "m", "prompt": "hi", **bad}, Limits())
        assert info.value.status == 400


def test_echo_choice_legacy_and_vllm_forms() -> None:
    req = parse(
        "/v1/completions",
        {"model": "m", "prompt": "ab", "echo": True, "logprobs": 1, "prompt_logprobs": 1},
        Limits(),
    )
    gen = fmt.completion_logprobs([{"token_id": 4, "logprob": -0.1, "top": [[4, -0.1]]}], str)
    one = fmt.echo_choice(fmt.choice("completion", 0, "4", "length", gen), req, "79", ENTRIES, str)
    assert one["text"] == "794"
    lp = one["logprobs"]
    assert lp["tokens"] == ["7", "9", "4"] and lp["token_logprobs"] == [None, -1.25, -0.1]
    assert lp["top_logprobs"][0] is None and lp["text_offset"] == [0, 1, 2]
    assert one["prompt_logprobs"][0] is None
    assert one["prompt_logprobs"][1]["9"] == {"logprob": -1.25, "rank": 2, "decoded_token": "9"}
    assert one["prompt_logprobs"][1]["3"]["rank"] == 1
