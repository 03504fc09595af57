"""The gateway in front of the real engine (bundled SmolLM2-135M, float32 on CPU), driven by the
official `openai` client. Outputs are short: a CPU step takes tens of milliseconds."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from test_api_synthetic import kill_streaming_clients, wait_idle

from tests.harness import API_KEY, Stack

pytestmark = pytest.mark.slow

MODEL = "smollm2"
MSG = [{"role": "user", "content": "List three colors."}]
PROMPT = "The capital of France is"


@pytest.fixture
def client(real_stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=real_stack.url + "/v1", api_key=API_KEY, max_retries=0)


def chat_stream_text(client, **kw) -> tuple[str, str]:
    text, reason = "", None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            text += c.delta.content or ""
            reason = c.finish_reason or reason
    return text, reason


def completion_stream_text(client, **kw) -> tuple[str, str]:
    text, reason = "", None
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            text += c.text
            reason = c.finish_reason or reason
    return text, reason


def test_streamed_equals_non_streamed_at_temperature_0(client) -> None:
    kw = {"model": MODEL, "messages": MSG, "max_tokens": 12, "temperature": 0}
    whole = client.chat.completions.create(**kw)
    text = whole.choices[0].message.content
    assert text.strip() and whole.usage.completion_tokens > 0
    assert chat_stream_text(client, **kw) == (text, whole.choices[0].finish_reason)

    kw = {"model": MODEL, "prompt": PROMPT, "max_tokens": 10, "temperature": 0}
    whole = client.completions.create(**kw)
    assert whole.choices[0].text.strip()
    assert completion_stream_text(client, **kw) == (
        whole.choices[0].text,
        whole.choices[0].finish_reason,
    )


def test_streamed_logprobs_equal_non_streamed(client) -> None:
    """Legacy completion logprobs: streamed pieces join into the non-streamed ones (text_offset
    continues across chunks); chat logprobs stream one entry per token."""
    kw = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 2}
    whole = client.completions.create(**kw).choices[0].logprobs
    tokens, offsets, top = [], [], []
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
                offsets += c.logprobs.text_offset
                top += c.logprobs.top_logprobs
    assert tokens == whole.tokens and offsets == whole.text_offset
    assert len(top) == len(tokens) == 6 and all(len(t) >= 1 for t in top)

    kw = {"model": MODEL, "messages": MSG, "max_tokens": 5, "temperature": 0}
    streamed = [
        lp
        for chunk in client.chat.completions.create(
            stream=True, logprobs=True, top_logprobs=2, **kw
        )
        for c in chunk.choices
        if c.logprobs is not None
        for lp in c.logprobs.content
    ]
    whole = client.chat.completions.create(logprobs=True, top_logprobs=2, **kw)
    assert [t.token for t in streamed] == [t.token for t in whole.choices[0].logprobs.content]


def _stop_inside(text: str) -> tuple[str, str]:
    """A stop string that first occurs in the middle of `text`, and the text before it."""
    for k in range(len(text) // 3, len(text) - 3):
        stop = text[k : k + 3]
        if stop.strip() and text.find(stop) == k:
            return stop, text[:k]
    raise AssertionError(f"no usable stop string in {text!r}")


def test_stop_strings_streamed_and_not(client) -> None:
    kw = {"model": MODEL, "messages": MSG, "max_tokens": 16, "temperature": 0}
    free = client.chat.completions.create(**kw).choices[0].message.content
    stop, before = _stop_inside(free)
    r = client.chat.completions.create(stop=[stop], **kw)
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (before, "stop")
    assert chat_stream_text(client, stop=[stop], **kw) == (before, "stop")

    kw = {"model": MODEL, "prompt": PROMPT, "max_tokens": 16, "temperature": 0}
    free = client.completions.create(**kw).choices[0].text
    stop, before = _stop_inside(free)
    r = client.completions.create(stop=stop, **kw)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (before, "stop")
    assert completion_stream_text(client, stop=stop, **kw) == (before, "stop")


def test_logprobs_are_valid_json(client, real_stack) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=MSG, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        # greedy: the chosen token is the most likely one
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)
    r = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=3
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(len(t) == 3 for t in lp.top_logprobs)
    # the raw body parses as strict JSON (no NaN / Infinity)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "logprobs": 5, "temperature": 1.5}
    raw = httpx.post(
        real_stack.url + "/v1/completions",
        json=body,
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=60,
    ).text
    json.loads(raw, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))


def test_sixteen_killed_streaming_clients_return_kv_blocks(real_stack) -> None:
    baseline = wait_idle(real_stack, timeout_s=60)["num_free_blocks"]
    kill_streaming_clients(real_stack, 16, 0.5)
    deadline = time.monotonic() + 60
    load: dict = {}
    while time.monotonic() < deadline:
        st = real_stack.status()
        load = st["workers"][0]["load"]
        if st["queues"]["in_flight"] == 0 and load.get("num_free_blocks") == baseline:
            break
        time.sleep(0.2)
    assert load.get("num_free_blocks") == baseline and load.get("num_running") == 0, load


def test_slo_controller_runs_by_default_and_is_exported(client, real_stack) -> None:
    """A worker started with no SLO flags profiles itself, derives targets, sizes its steps and
    exports the figures; a `service_tier="flex"` call runs on the batch lane of the same worker."""
    r = client.chat.completions.create(
        model=MODEL, messages=MSG, max_tokens=4, temperature=0, service_tier="flex"
    )
    assert r.usage.completion_tokens == 4
    for _ in client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=4, stream=True):
        pass
    names = ("slo_interactive_tpot_target_ms", "slo_interactive_ttft_target_ms",
             "step_token_budget", "step_predicted_ms", "step_measured_ms")  # fmt: skip
    deadline, values = time.monotonic() + 30, {}
    while time.monotonic() < deadline and len(values) < len(names):
        text = httpx.get(
            real_stack.url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}
        ).text
        for line in text.splitlines():
            for name in names:
                if line.startswith(f"laneserve:{name}{{") and 'worker_id="real"' in line:
                    values[name] = float(line.split()[-1])
        time.sleep(0.5)
    assert set(values) == set(names), text
    assert 0 < values["slo_interactive_tpot_target_ms"] < values["slo_interactive_ttft_target_ms"]
    assert values["step_token_budget"] >= 1 and values["step_measured_ms"] > 0


def test_embeddings_shape_norm_batch_equality_base64_and_models(client, real_stack) -> None:
    """/v1/embeddings through the SDK: one unit vector of hidden_size per input, the same vector
    alone as in a batch (float32: batch composition must not change it), base64 equal to
    float, usage counting prompt tokens, the pooling named in /v1/models, bad fields a 400."""
    import base64

    import numpy as np

    texts = ["The cat sat on the mat.", "Paris is the capital of France.", "hi"]
    batch = client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    assert [d.index for d in batch.data] == [0, 1, 2]
    vecs = np.array([d.embedding for d in batch.data])
    assert vecs.shape == (3, 576)  # SmolLM2-135M's hidden_size
    assert np.allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-5)
    assert batch.usage.prompt_tokens == batch.usage.total_tokens > 3
    alone = client.embeddings.create(model=MODEL, input=texts[1]).data[0].embedding
    assert np.allclose(alone, vecs[1], atol=1e-5)
    assert not np.allclose(vecs[0], vecs[1], atol=1e-2)  # different texts, different vectors
    b64 = client.embeddings.create(model=MODEL, input=texts, encoding_format="base64")
    raw = [np.frombuffer(base64.b64decode(d.embedding), "<f4") for d in b64.data]
    assert np.array_equal(np.array(raw), vecs.astype(np.float32))
    default = client.embeddings.create(model=MODEL, input=texts)  # the SDK asks for base64
    assert np.allclose(np.array([d.embedding for d in default.data]), vecs, atol=1e-6)
    ids = client.embeddings.create(model=MODEL, input=[[504, 2295, 2717]]).data[0].embedding
    assert len(ids) == 576
    models = client.models.list().data
    assert models[0].model_extra["pooling"] == {"pooling_type": "LAST", "normalize": True}
    with pytest.raises(openai.BadRequestError) as exc:
        client.embeddings.create(model=MODEL, input="x", dimensions=64)
    assert exc.value.body["param"] == "dimensions"
    with pytest.raises(openai.BadRequestError) as exc:
        client.embeddings.create(model=MODEL, input=[])
    assert exc.value.body["param"] == "input"


def test_instructor_and_a_langchain_tool_agent_unmodified(client, real_stack) -> None:
    """Third-party clients as users run them: instructor's default mode (it sends the model as a
    forced tool) returns a validated pydantic object from the bundled model; LangChain's
    `ChatOpenAI.bind_tools` agent loop calls the tool, feeds its result back as a `tool`
    message and gets an answer."""
    import instructor
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel

    class City(BaseModel):
        name: str
        country: str

    ic = instructor.from_openai(client)
    city = ic.chat.completions.create(
        model=MODEL,
        response_model=City,
        max_tokens=64,
        max_retries=0,
        temperature=0,
        messages=[{"role": "user", "content": "Paris is a city in France."}],
    )
    # validated against the schema by instructor (what the 135M model writes in it is its own:
    # sampled, it once named the city "")
    assert isinstance(city, City) and isinstance(city.name, str) and isinstance(city.country, str)

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    llm = ChatOpenAI(
        model=MODEL, base_url=real_stack.url + "/v1", api_key=API_KEY, max_retries=0,
        temperature=0, max_tokens=48,
    )  # fmt: skip
    agent = llm.bind_tools([add], tool_choice="required")
    messages = [HumanMessage("What is 2 + 3? Use the add tool.")]
    reply = agent.invoke(messages)
    assert reply.tool_calls and reply.tool_calls[0]["name"] == "add"
    call = reply.tool_calls[0]
    result = add.invoke(call["args"])
    messages += [reply, ToolMessage(str(result), tool_call_id=call["id"])]
    final = llm.bind_tools([add]).invoke(messages)
    assert final.content or final.tool_calls  # the model answered after the tool's result
