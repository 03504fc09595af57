"""SamplingParams: validation names the field, normalisation, strict wire round trip."""

from __future__ import annotations

import pickle

import msgpack
import pytest

from laneserve.gpu_worker.errors import InvalidRequestError, PromptTooLongError
from laneserve.gpu_worker.sampling_params import SamplingParams


def test_defaults_and_normalisation():
    p = SamplingParams()
    assert (p.n, p.max_tokens, p.min_tokens, p.temperature, p.top_p, p.top_k) == (
        1,
        16,
        0,
        1.0,
        1.0,
        0,
    )
    assert p.stop == [] and p.stop_token_ids == [] and p.logprobs is None and p.skip_special_tokens
    assert not p.greedy and not p.has_penalties

    q = SamplingParams(temperature=0, top_k=-1, stop="\n\n", stop_token_ids=(5, 7), top_p=1)
    assert q.greedy and q.top_k == 0 and q.stop == ["\n\n"] and q.stop_token_ids == [5, 7]
    assert isinstance(q.temperature, float) and isinstance(q.top_p, float)
    assert SamplingParams(stop=None, stop_token_ids=None).stop == []
    assert SamplingParams(temperature=1e-6).greedy  # below SAMPLING_EPS -> greedy
    assert SamplingParams(presence_penalty=0.5).has_penalties


BAD_VALUES = [
    ("n", 0),
    ("n", 1.5),
    ("max_tokens", 0),
    ("max_tokens", -3),
    ("max_tokens", "16"),
    ("max_tokens", True),
    ("min_tokens", -1),
    ("temperature", -0.1),
    ("temperature", float("nan")),
    ("temperature", float("inf")),
    ("temperature", "hot"),
    ("top_p", 0.0),
    ("top_p", 1.01),
    ("top_p", -0.5),
    ("top_k", -2),
    ("top_k", 2.5),
    ("seed", 1.0),
    ("seed", 2**64),
    ("seed", "7"),
    ("stop", [""]),
    ("stop", [1, 2]),
    ("stop", 5),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", ["a"]),
    ("stop_token_ids", 5),
    ("ignore_eos", 1),
    ("include_stop_str_in_output", "yes"),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("presence_penalty", 2.5),
    ("presence_penalty", -2.01),
    ("frequency_penalty", 3),
    ("frequency_penalty", -2.5),
    ("logprobs", -1),
    ("logprobs", 21),
    ("logprobs", 2.0),
    ("skip_special_tokens", None),
]


@pytest.mark.parametrize(("name", "value"), BAD_VALUES)
def test_bad_value_raises_value_error_naming_field(name, value):
    with pytest.raises(ValueError, match=name) as info:
        SamplingParams(**{name: value})
    assert isinstance(info.value, InvalidRequestError)
    with pytest.raises(InvalidRequestError, match=name):
        SamplingParams.from_dict({name: value})


def test_min_tokens_above_max_tokens_rejected():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    assert SamplingParams(max_tokens=4, min_tokens=4).min_tokens == 4


def test_edge_values_accepted():
    p = SamplingParams(
        temperature=0.0,
        top_p=1e-9,
        top_k=1,
        seed=2**64 - 1,
        presence_penalty=-2,
        frequency_penalty=2,
        logprobs=20,
        repetition_penalty=1e-3,
    )
    assert p.seed == 2**64 - 1 and p.logprobs == 20
    assert SamplingParams(seed=-(2**63), logprobs=0).logprobs == 0


def test_wire_round_trip_through_msgpack():
    p = SamplingParams(
        n=2,
        max_tokens=64,
        min_tokens=3,
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        seed=1234,
        stop=["\n", "END"],
        stop_token_ids=[2],
        ignore_eos=True,
        include_stop_str_in_output=True,
        repetition_penalty=1.1,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        logprobs=5,
        skip_special_tokens=False,
    )
    blob = msgpack.packb(p.to_dict())
    q = SamplingParams.from_dict(msgpack.unpackb(blob))
    assert q == p
    assert SamplingParams.from_dict({}) == SamplingParams()
    d = p.to_dict()
    d["stop"].append("x")
    assert p.stop == ["\n", "END"]  # to_dict copies lists


def test_from_dict_is_strict():
    with pytest.raises(InvalidRequestError, match="best_of"):
        SamplingParams.from_dict({"best_of": 2})
    with pytest.raises(InvalidRequestError, match="map"):
        SamplingParams.from_dict([("n", 1)])
    with pytest.raises(InvalidRequestError, match="temperature"):
        SamplingParams.from_dict({"temperature": [1.0]})


def test_prompt_too_long_error():
    err = PromptTooLongError(prompt_tokens=3000, max_model_len=2048)
    assert isinstance(err, InvalidRequestError) and isinstance(err, ValueError)
    assert (err.prompt_tokens, err.max_model_len) == (3000, 2048)
    assert "3000" in str(err) and "2048" in str(err)
    copy = pickle.loads(pickle.dumps(err))
    assert (copy.prompt_tokens, copy.max_model_len, str(copy)) == (3000, 2048, str(err))
