"""Evaluation-harness extras of `/v1/completions` through the real stack (broker, a real SmolLM2
worker in float32 with `quantization="none"`, gateway, jobs runner), driven by the official
`openai` client: `echo` + `logprobs` (log-likelihoods) against the offline engine's
`prompt_logprobs`, `prompt_logprobs`, `min_p`, `logit_bias`, `/tokenize`, `/detokenize`,
`/v1/models/{id}`, and a batch line with `echo`."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest

from laneserve.gpu_worker import LLM, SamplingParams
from tests.harness import API_KEY, TERMINAL, Stack, real_model_stack, wait_for

pytestmark = pytest.mark.slow

MODEL = "smollm2"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
CONTEXT = "The capital of France is"
CONTINUATIONS = [" Paris", " London", " a city in Europe", " banana bread", " the"]


@pytest.fixture(scope="module")
def stack(smollm2_gguf, smollm2_dir) -> Iterator[Stack]:
    with real_model_stack(smollm2_gguf, "--quantization", "none") as st:
        yield st


@pytest.fixture(scope="module")
def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url + "/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def llm(smollm2_gguf) -> LLM:
    """The offline engine in the same exactness mode as the worker."""
    return LLM(
        model=str(smollm2_gguf),
        dtype="float32",
        quantization="none",
        num_blocks=64,
        max_model_len=512,
    )


def engine_prompt_logprobs(llm: LLM, text: str) -> tuple[list[int], list[float | None]]:
    out = llm.generate([text], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1))[0]
    ids = out.prompt_token_ids
    values = [None] + [out.prompt_logprobs[p][ids[p]].logprob for p in range(1, len(ids))]
    return ids, values


def test_echo_logprobs_max_tokens_0_equal_the_engine(client, llm) -> None:
    text = CONTEXT + " Paris, and the capital of Italy is Rome."
    ids, expect = engine_prompt_logprobs(llm, text)
    got = client.completions.create(
        model=MODEL, prompt=text, echo=True, logprobs=1, max_tokens=0, temperature=0
    )
    choice = got.choices[0]
    assert choice.text == text  # max_tokens=0: the prompt only
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # OpenAI's first token
    assert len(lp.token_logprobs) == len(ids)
    assert lp.tokens == [llm.tokenizer.decode([t]) for t in ids]
    assert lp.token_logprobs[1:] == pytest.approx(expect[1:], abs=1e-5)
    assert all(len(top) >= 1 for top in lp.top_logprobs[1:])
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert got.usage.prompt_tokens == len(ids) and got.usage.completion_tokens == 0


def test_loglikelihood_ranking_matches_the_offline_engine(client, llm) -> None:
    """lm-eval's `local-completions` recipe: score context + continuation with echo, sum the
    continuation tokens' logprobs (those at or after the context's end)."""
    n_ctx = len(llm.tokenizer(CONTEXT)["input_ids"])
    api_scores, engine_scores = [], []
    for cont in CONTINUATIONS:
        got = client.completions.create(
            model=MODEL, prompt=CONTEXT + cont, echo=True, logprobs=1, max_tokens=0
        ).choices[0]
        lp = got.logprobs
        api_scores.append(
            sum(v for v, o in zip(lp.token_logprobs, lp.text_offset, strict=True)
                if o >= len(CONTEXT))
        )  # fmt: skip
        _, values = engine_prompt_logprobs(llm, CONTEXT + cont)
        engine_scores.append(sum(values[n_ctx:]))
    assert api_scores == pytest.approx(engine_scores, abs=1e-4)
    order = sorted(range(5), key=lambda i: -api_scores[i])
    assert order == sorted(range(5), key=lambda i: -engine_scores[i])
    assert order[0] == 0  # " Paris" is the likeliest


def test_echo_with_generation_and_prompt_logprobs_field(client, stack, llm) -> None:
    plain = client.completions.create(model=MODEL, prompt=CONTEXT, max_tokens=4, temperature=0)
    echoed = client.completions.create(
        model=MODEL, prompt=CONTEXT, max_tokens=4, temperature=0, echo=True, logprobs=0
    ).choices[0]
    assert echoed.text == CONTEXT + plain.choices[0].text
    assert len(echoed.logprobs.tokens) == len(llm.tokenizer(CONTEXT)["input_ids"]) + 4
    # vLLM's prompt_logprobs field: per position null or {token_id: {logprob, rank, decoded_token}}
    body = {"model": MODEL, "prompt": CONTEXT, "max_tokens": 1, "prompt_logprobs": 2}
    r = httpx.post(stack.url + "/v1/completions", json=body, headers=AUTH, timeout=60).json()
    plp = r["choices"][0]["prompt_logprobs"]
    ids, expect = engine_prompt_logprobs(llm, CONTEXT)
    assert plp[0] is None and len(plp) == len(ids)
    for p in range(1, len(ids)):
        entry = plp[p][str(ids[p])]
        assert entry["logprob"] == pytest.approx(expect[p], abs=1e-5)
        assert entry["decoded_token"] == llm.tokenizer.decode([ids[p]])
        assert {e["rank"] for e in plp[p].values()} >= {1, 2}
    with pytest.raises(openai.BadRequestError, match="echo"):
        client.completions.create(model=MODEL, prompt=CONTEXT, echo=True, stream=True)


def test_logit_bias_forces_and_bans(client, llm) -> None:
    kw = {"model": MODEL, "prompt": CONTEXT, "max_tokens": 3, "temperature": 0}
    forced_id = 1000
    forced = client.completions.create(**kw, logit_bias={str(forced_id): 100})
    assert forced.choices[0].text == llm.tokenizer.decode([forced_id] * 3)
    greedy = client.completions.create(**kw, logprobs=0).choices[0].logprobs.tokens
    first_id = llm.tokenizer(CONTEXT + greedy[0])["input_ids"][-1]
    banned = client.completions.create(**kw, logprobs=0, logit_bias={str(first_id): -100})
    assert banned.choices[0].logprobs.tokens[0] != greedy[0]
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        client.completions.create(**kw, logit_bias={str(forced_id): 101})
    with pytest.raises(openai.BadRequestError, match="vocabulary"):
        client.completions.create(**kw, logit_bias={"99999999": 5})


def test_min_p_has_an_effect(client) -> None:
    kw = {"model": MODEL, "prompt": CONTEXT, "max_tokens": 6}
    greedy = client.completions.create(**kw, temperature=0).choices[0].text
    # min_p=1: only the most likely token survives, so a hot temperature samples greedily
    strict = [
        client.completions.create(**kw, temperature=1.5, seed=s, extra_body={"min_p": 1.0})
        .choices[0]
        .text
        for s in range(3)
    ]
    assert strict == [greedy] * 3
    loose = [
        client.completions.create(**kw, temperature=1.5, seed=s).choices[0].text for s in range(3)
    ]
    assert any(t != greedy for t in loose)


def test_tokenize_detokenize_and_model_by_id(client, stack, llm) -> None:
    text = "Tokenizers split text into pieces."
    r = httpx.post(
        stack.url + "/tokenize",
        json={"model": MODEL, "prompt": text, "return_token_strs": True},
        headers=AUTH,
        timeout=10,
    )
    assert r.status_code == 200, r.text
    tok = r.json()
    ids = llm.tokenizer(text)["input_ids"]
    assert tok["tokens"] == ids and tok["count"] == len(ids)
    assert tok["max_model_len"] > 0 and len(tok["token_strs"]) == len(ids)
    back = httpx.post(
        stack.url + "/detokenize", json={"tokens": tok["tokens"]}, headers=AUTH, timeout=10
    )
    assert back.status_code == 200 and back.json() == {"prompt": text}
    msgs = [{"role": "user", "content": "Hello"}]
    chat = httpx.post(stack.url + "/tokenize", json={"messages": msgs}, headers=AUTH, timeout=10)
    assert chat.json()["tokens"] == llm.engine.apply_chat_template(msgs)
    bad = httpx.post(stack.url + "/detokenize", json={"tokens": [-1]}, headers=AUTH, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert httpx.post(stack.url + "/tokenize", json={"prompt": "x"}, timeout=10).status_code == 401
    # GET /v1/models/{id}
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_batch_line_with_echo_and_logprobs(client, stack, smollm2_gguf, llm) -> None:
    text = CONTEXT + " Paris."
    line = {
        "custom_id": "ll-1",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": MODEL, "prompt": text, "echo": True, "logprobs": 1, "max_tokens": 0},
    }
    stack.start_jobs_runner("--model", str(smollm2_gguf), "--model-name", MODEL)
    try:
        f = client.files.create(
            file=("ll.jsonl", (json.dumps(line) + "\n").encode()), purpose="batch"
        )
        b = client.batches.create(
            input_file_id=f.id, endpoint="/v1/completions", completion_window="24h"
        )
        b = wait_for(
            lambda: (x := client.batches.retrieve(b.id)).status in TERMINAL and x, 120, "the batch"
        )
        assert b.status == "completed" and b.request_counts.completed == 1, (b, stack.logs())
        out = json.loads(client.files.content(b.output_file_id).content.decode().splitlines()[0])
    finally:
        stack.stop_proc("jobs-runner")
    body = out["response"]["body"]
    choice = body["choices"][0]
    assert choice["text"] == text and body["usage"]["completion_tokens"] == 0
    _, expect = engine_prompt_logprobs(llm, text)
    lp = choice["logprobs"]["token_logprobs"]
    assert lp[0] is None and lp[1:] == pytest.approx(expect[1:], abs=1e-5)
