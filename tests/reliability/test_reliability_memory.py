"""Memory that runs short (issue 52, item 3): a sequence no worker's KV pool can hold even alone is
refused at the edge, naming the figures.

Real processes on 127.0.0.1: broker, one synthetic worker whose pool is ``--num-blocks 4
--block-size 16`` (64 tokens; it announces that in its ``ready``), the gateway counting prompts
with the bundled model's tokenizer, and a jobs runner counting them too. Checked with the official
``openai`` client: a prompt over 64 tokens, or a short prompt with ``max_tokens`` past the pool, is
a 400 naming 64 tokens and 4 blocks x 16; a request that fits is answered. A batch job with such a
line gets an error line for it (same message) and results for the others.

Then a batch job whose lines together need far more than the pool: a real worker (a random
2-layer Llama, float32 on the CPU, `save_tiny_llama`) with 12 blocks of 16 tokens and 16 sequences
at once, 24 lines of ~80 tokens each (5 blocks): the scheduler preempts (the worker's heartbeat
counts them) and every line comes back exactly once with all its tokens (without the start-up
step profile, to keep the test short: tests/engine_props/test_engine_props_regressions.py runs the
profile on such a pool).
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import sqlalchemy as sa

from tests.engine_props.props_helpers import save_tiny_llama
from tests.harness import (
    API_KEY,
    MODEL_ALIAS,
    Stack,
    chat_line,
    check_exactly_once,
    read_lines,
    report,
    submit_job,
    wait_job_done,
)

pytestmark = pytest.mark.slow

POOL = ("--num-blocks", "4", "--block-size", "16")
LONG = " ".join(f"word{i}" for i in range(80))  # well over 64 tokens


@pytest.fixture(scope="module")
def small_pool(smollm2_gguf) -> Iterator[Stack]:
    tmp = Path(tempfile.mkdtemp(prefix="lsk", dir="/tmp"))
    stack = _stack(tmp)
    try:
        stack.start_broker()
        stack.start_worker("w1", *POOL)
        stack.start_api("--model", str(smollm2_gguf), "--served-model-name", MODEL_ALIAS)
        stack.start_jobs_runner(model=str(smollm2_gguf))
        stack.wait_workers({"w1"})
        stack.wait_api()
        yield stack
    finally:
        stack.stop()


def _stack(tmp: Path) -> Stack:
    """A stack that removes `tmp` when stopped; any exited child fails a wait."""
    return Stack(tmp, liveness=25, api_key=API_KEY, fail_fast=True, wait_s=120.0, own_tmp=True)


def _chat(client: openai.OpenAI, content: str, max_tokens: int):
    return client.chat.completions.create(
        model=MODEL_ALIAS, messages=[{"role": "user", "content": content}], max_tokens=max_tokens
    )


def test_sequence_over_the_kv_pool_is_a_400(small_pool: Stack) -> None:
    client = openai.OpenAI(base_url=small_pool.url + "/v1", api_key=small_pool.api_key)
    with pytest.raises(openai.BadRequestError) as long_prompt:
        _chat(client, LONG, 4)
    body = long_prompt.value.body
    assert body["code"] == "prompt_too_long" and body["param"] == "messages"
    assert "64 tokens" in body["message"] and "4 blocks x 16 tokens" in body["message"]
    with pytest.raises(openai.BadRequestError) as long_output:
        _chat(client, "hi", 100)
    body = long_output.value.body
    assert body["param"] == "max_tokens" and "4 blocks x 16 tokens" in body["message"]
    assert "max_tokens=100" in body["message"]
    ok = _chat(client, "hi", 8)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_batch_line_over_the_kv_pool_is_an_error_line(small_pool: Stack) -> None:
    engine = sa.create_engine(small_pool.db_url)
    tmp = small_pool.tmp
    lines = [chat_line("fits-0", "hi"), chat_line("too-long", LONG), chat_line("fits-1", "yo")]
    job = submit_job(engine, tmp, lines)
    started = time.monotonic()
    job = wait_job_done(engine, job.id, timeout_s=60, stack=small_pool)
    assert job.status == "completed", job
    out = {r["custom_id"]: r for r in read_lines(engine, job.output_file_id)}
    errors = {r["custom_id"]: r for r in read_lines(engine, job.error_file_id)}
    assert set(out) == {"fits-0", "fits-1"} and set(errors) == {"too-long"}
    error = errors["too-long"]["error"]
    assert error["code"] == "prompt_too_long" and "4 blocks x 16 tokens" in error["message"]
    assert time.monotonic() - started < 60
    engine.dispose()


def test_job_over_the_pool_in_total_runs_by_preemption(smollm2_dir, tmp_path_factory) -> None:
    model = save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), smollm2_dir)
    stack = _stack(Path(tempfile.mkdtemp(prefix="lsp", dir="/tmp")))
    try:
        stack.start_broker()
        stack.start_worker("tiny", *POOL[:1], "12", *POOL[2:], "--max-num-seqs", "16",
                           "--no-slo-control", model=str(model))  # fmt: skip
        stack.start_jobs_runner(model=str(model))
        stack.wait_workers({"tiny"})
        engine = sa.create_engine(stack.db_url)
        ids = [f"line-{i}" for i in range(24)]
        lines = [chat_line(c, f"story number {c}", max_tokens=40) for c in ids]
        for line in lines:
            line["body"]["ignore_eos"] = True  # every line takes its 40 tokens
        started = time.monotonic()
        job = wait_job_done(engine, submit_job(engine, stack.tmp, lines).id, 120, stack)
        elapsed = time.monotonic() - started
        assert job.status == "completed", job
        out, err = check_exactly_once(engine, job, ids)
        assert not err, err[:3]
        usage = [line["response"]["body"]["usage"]["completion_tokens"] for line in out]
        assert usage == [40] * len(ids)
        preemptions = stack.status()["workers"][0]["load"].get("preemptions")
        assert preemptions and preemptions > 0, stack.status()["workers"][0]
        report("kv_pool_preemption", lines=len(ids), preemptions=preemptions, seconds=elapsed)
        engine.dispose()
    finally:
        stack.stop()
