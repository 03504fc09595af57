"""The real engine (gpu_worker.engine.LLMEngine) behind the broker: a chat streams end to end."""

from __future__ import annotations

import pytest

from laneserve.broker import protocol as p
from laneserve.broker.client import BrokerClient
from tests.harness import run

pytestmark = pytest.mark.slow


def test_chat_streams_through_broker_and_real_worker(stack, smollm2_gguf) -> None:
    stack.start_broker("--liveness", "30")  # CPU steps are slow; heartbeats still flow
    stack.start_worker(
        "real",
        "--model", str(smollm2_gguf), "--dtype", "float32", "--max-num-seqs", "4",
        "--kv-cache-memory", "64MiB",
        heartbeat_s=1.0, liveness=30, synthetic=False,
    )  # fmt: skip
    stack.wait_workers({"real"}, timeout_s=180)
    chat = [{"role": "user", "content": "Name three colors."}]
    sp = {"max_tokens": 24, "temperature": 0.0}

    async def main():
        async with BrokerClient(stack.front) as c:
            deltas, parts = [], []
            async for msg in c.submit(messages=chat, sampling_params=sp):
                if isinstance(msg, p.Delta):
                    deltas.append(msg)
                else:
                    final = msg
            async for msg in c.submit(
                messages=chat, sampling_params=sp, stream=False, lane="batch"
            ):
                parts.append(msg)
            return deltas, final, parts[-1]

    deltas, final, whole = run(main(), timeout_s=240)
    assert isinstance(final, p.Final) and isinstance(whole, p.Final), (final, whole)
    streamed = "".join(d.text for d in deltas)
    assert streamed == whole.text and streamed.strip()
    assert [t for d in deltas for t in d.token_ids] == whole.token_ids
    assert final.usage["completion_tokens"] == len(whole.token_ids) > 0
    assert final.usage["prompt_tokens"] > 5 and final.timings["ttft_ms"] > 0
    st = stack.wait_status(lambda s: s["workers"][0]["load"].get("num_running") == 0)
    assert st["workers"][0]["model"]
