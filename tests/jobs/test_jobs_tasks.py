"""Task shorthand (summarize, translate) and map-reduce summarization on the real bundled model
(broker + SmolLM2 worker + jobs runner as processes; short outputs so the test stays fast)."""

from __future__ import annotations

import pytest

from laneserve.jobs.stats import batch_stats
from tests.harness import Stack, read_lines, submit, wait_job, write_jsonl

pytestmark = pytest.mark.slow

PARAGRAPHS = [
    "The Eiffel Tower was built for the 1889 World's Fair in Paris. Many artists criticised "
    "its design at first, but it became the most visited paid monument in the world and a "
    "symbol of France.",
    "Photosynthesis lets plants turn sunlight, water and carbon dioxide into sugar and oxygen. "
    "It happens in the chloroplasts, where the green pigment chlorophyll absorbs light.",
    "The printing press, developed by Johannes Gutenberg around 1440, made books cheaper and "
    "faster to produce, which helped spread literacy and new ideas across Europe.",
]


def test_summarize_translate_and_map_reduce(laneserve_home, db_url, engine, smollm2_dir):
    stack = Stack.for_jobs(laneserve_home, db_url)
    try:
        stack.start_broker()
        stack.start_worker("w1", "--max-num-seqs", "16", model=str(smollm2_dir))
        # A low context for the runner so a ~420-token document needs map-reduce.
        stack.start_jobs_runner("--max-model-len", "320", model=str(smollm2_dir))
        docs = [{"id": f"p{i}", "text": t} for i, t in enumerate(PARAGRAPHS)]
        summ = submit(
            engine,
            write_jsonl(laneserve_home / "docs.jsonl", docs),
            task="summarize",
            task_options={"max_tokens": 8},
        )
        trans = submit(
            engine,
            write_jsonl(laneserve_home / "docs_fr.jsonl", docs[:2]),
            task="translate",
            task_options={"target_lang": "fr", "source_lang": "en", "max_tokens": 8},
        )
        long_doc = " ".join(PARAGRAPHS * 3)  # ~420 tokens > 320: 2 pieces, then their reduce
        mr = submit(
            engine,
            write_jsonl(laneserve_home / "long.jsonl", [{"id": "long", "text": long_doc}]),
            task="summarize",
            task_options={"max_tokens": 8},
        )
        results = {}
        for name, job in (("summarize", summ), ("translate", trans), ("map_reduce", mr)):
            job = wait_job(engine, job.id, ("completed", "failed"), stack, timeout_s=400)
            assert job.status == "completed", (name, job.errors, stack.logs())
            assert job.request_counts["failed"] == 0, read_lines(engine, job.error_file_id)
            results[name] = read_lines(engine, job.output_file_id)
        for name in ("summarize", "translate"):
            for line in results[name]:
                text = line["response"]["body"]["choices"][0]["message"]["content"]
                assert text.strip(), (name, line)
        assert [x["custom_id"] for x in results["summarize"]] == ["p0", "p1", "p2"]
        (line,) = results["map_reduce"]
        body = line["response"]["body"]
        assert body["choices"][0]["message"]["content"].strip()
        info = body["laneserve"]["map_reduce"]
        assert info["pieces"] >= 2 and info["levels"] >= 2 and info["requests"] >= 3
        assert info["document_tokens"] > 320
        # the job's token counts include the map levels' requests, not only the final summary
        assert info["map_prompt_tokens"] > 320 and info["map_completion_tokens"] > 0
        usage = body["usage"]
        stats = batch_stats(engine, mr.id)
        assert stats.completion_tokens == usage["completion_tokens"] + info["map_completion_tokens"]
        assert stats.prompt_tokens == usage["prompt_tokens"] + info["map_prompt_tokens"]
    finally:
        stack.stop()
