"""Bulk-job lines use the API's request surface on the real bundled model: `ignore_eos`,
`logprobs`/`top_logprobs`, `stop_token_ids` run and come back in the output line (logprobs in
the endpoint's form); an unknown model and an over-limit `max_tokens` are error lines worded as
the API's 404 and 400 (broker + SmolLM2 worker + jobs runner as processes)."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from tests.harness import Stack, read_lines, submit, wait_job, write_jsonl

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"  # the runner's --model-name in Stack
MSG = [{"role": "user", "content": "Name a color."}]


def line(custom_id: str, url: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": {"model": MODEL, **body}}


@pytest.fixture
def stack(laneserve_home, db_url, smollm2_dir):
    s = Stack.for_jobs(laneserve_home, db_url)
    s.start_broker()
    s.start_worker("w1", "--max-num-seqs", "8", model=str(smollm2_dir))
    s.start_jobs_runner(model=str(smollm2_dir))
    yield s
    s.stop()


def _run(engine, stack, path, endpoint) -> tuple[dict, dict]:
    job = submit(engine, path, endpoint=endpoint)
    stack.wait_workers(1)
    job = wait_job(engine, job.id, ("completed", "failed"), stack, timeout_s=240)
    assert job.status == "completed", (job.errors, stack.logs())
    out = {x["custom_id"]: x for x in read_lines(engine, job.output_file_id)}
    err = {x["custom_id"]: x["error"] for x in read_lines(engine, job.error_file_id)}
    return out, err


def test_chat_lines_with_logprobs_ignore_eos_and_api_errors(stack, engine, laneserve_home):
    chat = "/v1/chat/completions"
    lines = [
        line("lp", chat, messages=MSG, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2),
        line("eos", chat, messages=MSG, max_tokens=12, temperature=0, ignore_eos=True),
        line("plain", chat, messages=MSG, max_tokens=3, stop_token_ids=[2], seed=1),
        line("n2", chat, messages=MSG, max_tokens=3, n=2, seed=7, temperature=1.0),
        line("gpt", chat, messages=MSG, max_tokens=3, **{"model": "gpt-4o"}),
        line("huge", chat, messages=MSG, max_tokens=100000),
    ]
    out, err = _run(engine, stack, write_jsonl(laneserve_home / "chat.jsonl", lines), chat)
    assert sorted(out) == ["eos", "lp", "n2", "plain"] and sorted(err) == ["gpt", "huge"]
    gpt = err["gpt"]
    assert (gpt["code"], gpt["param"]) == ("not_found", "body.model"), gpt
    assert gpt["message"].startswith("the model 'gpt-4o' does not exist; this server serves '")
    assert err["huge"] == {
        "code": "invalid_request",
        "message": "'max_tokens' must be <= 4096, got 100000",
        "param": "body.max_tokens",
    }

    body = out["lp"]["response"]["body"]
    choice = body["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == body["usage"]["completion_tokens"] > 0
    assert "".join(e["token"] for e in content) == choice["message"]["content"]
    for entry in content:
        assert entry["logprob"] <= 0 and len(entry["top_logprobs"]) == 2
        assert entry["bytes"] == list(entry["token"].encode())
        # greedy: the chosen token is the most likely one
        assert entry["top_logprobs"][0]["logprob"] == pytest.approx(entry["logprob"], abs=1e-4)

    eos = out["eos"]["response"]["body"]
    assert eos["choices"][0]["logprobs"] is None
    # ignore_eos: the line runs to max_tokens whatever the model would have ended with
    assert eos["choices"][0]["finish_reason"] == "length"
    assert eos["usage"]["completion_tokens"] == 12
    assert out["plain"]["response"]["body"]["choices"][0]["logprobs"] is None
    # n = 2 fans out as in the API: two choices, prompt tokens counted once
    n2, plain = out["n2"]["response"]["body"], out["plain"]["response"]["body"]
    assert [c["index"] for c in n2["choices"]] == [0, 1]
    assert all(c["message"]["content"] and c["finish_reason"] for c in n2["choices"])
    assert n2["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]
    assert 2 <= n2["usage"]["completion_tokens"] <= 6


def test_completion_line_with_legacy_logprobs(stack, engine, laneserve_home):
    """... in a file that mixes endpoints: chat, embeddings and responses lines run as their
    own url would (a responses line cannot continue a stored conversation)."""
    url = "/v1/completions"
    emb = "/v1/embeddings"
    lines = [
        line("chat", "/v1/chat/completions", messages=MSG, max_tokens=2, temperature=0),
        line("emb", emb, input=["The capital of France is", [504, 3575, 282]]),
        line("emb64", emb, input="The capital of France is", encoding_format="base64"),
        line("dims", emb, input="x", dimensions=8),
        line("resp", "/v1/responses", input="Name a color.", max_output_tokens=4, temperature=0),
        line("prev", "/v1/responses", input="And?", previous_response_id="resp_1"),
        line("lp", url, prompt="The capital of France is", max_tokens=4, temperature=0, logprobs=3),
        line("ids", url, prompt=[504, 3575, 282], max_tokens=4, ignore_eos=True),
        line("two", url, prompt=[[504, 3575], [282]], max_tokens=2, ignore_eos=True),
    ]
    out, err = _run(engine, stack, write_jsonl(laneserve_home / "text.jsonl", lines), url)
    assert sorted(err) == ["dims", "prev"] and err["dims"]["param"] == "body.dimensions", err
    assert err["prev"]["param"] == "body.previous_response_id", err
    assert sorted(out) == ["chat", "emb", "emb64", "ids", "lp", "resp", "two"]
    resp = out["resp"]["response"]["body"]
    assert resp["object"] == "response" and resp["status"] in ("completed", "incomplete")
    assert resp["output"][0]["content"][0]["text"] and resp["usage"]["output_tokens"] >= 1
    assert out["chat"]["response"]["body"]["object"] == "chat.completion"
    vecs = out["emb"]["response"]["body"]
    assert vecs["object"] == "list" and [d["index"] for d in vecs["data"]] == [0, 1]
    first = np.array(vecs["data"][0]["embedding"])
    assert first.shape == (576,) and abs(np.linalg.norm(first) - 1.0) < 1e-5
    assert vecs["usage"]["prompt_tokens"] == vecs["usage"]["total_tokens"] > 3
    raw = base64.b64decode(out["emb64"]["response"]["body"]["data"][0]["embedding"])
    assert np.allclose(np.frombuffer(raw, "<f4"), first, atol=2e-3)  # alone = in a pair
    body = out["lp"]["response"]["body"]
    lp = body["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == body["usage"]["completion_tokens"]
    assert all(len(top) == 3 for top in lp["top_logprobs"])
    assert "".join(lp["tokens"]) == body["choices"][0]["text"]
    assert lp["text_offset"][0] == 0
    ids = out["ids"]["response"]["body"]
    assert ids["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 4,
        "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert ids["choices"][0]["finish_reason"] == "length"
    two = out["two"]["response"]["body"]
    assert [c["index"] for c in two["choices"]] == [0, 1]
    assert two["usage"]["prompt_tokens"] == 3 and two["usage"]["completion_tokens"] == 4
