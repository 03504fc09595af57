"""Structured outputs in bulk jobs on the real bundled model (broker + SmolLM2 worker + jobs
runner as processes): a json_schema batch where one line's schema is broken (that line goes to
the error file, the rest validate), and a job of the `extract` task shorthand. 16 lines each: more
than the worker's batch (8 sequences), so constrained rows join and leave running batches; whether
grammars stay apart inside one batch is tested on the engine (tests/engine/test_engine_structured.py)."""

from __future__ import annotations

import argparse
import json

import jsonschema
import pytest

from laneserve.commands import submit as submit_cmd
from laneserve.jobs.errors import InvalidRequestError
from tests.harness import Stack, chat_line, read_lines, submit, wait_job, write_jsonl

pytestmark = pytest.mark.slow

CITY = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome", "Berlin", "Madrid"]},
        "year": {"type": "integer", "minimum": 1000, "maximum": 2100},
    },
    "required": ["city", "year"],
    "additionalProperties": False,
}
DOCS = [
    "The treaty was signed in Rome in 1957 by six countries.",
    "Berlin hosted the Olympic Games in 1936.",
    "The Eiffel Tower in Paris opened in 1889.",
    "Madrid became the capital of Spain in 1561.",
]
LINES = 16


def schema_line(i: int, schema) -> dict:
    line = chat_line(f"c{i}", f"Which city and year? {DOCS[i % len(DOCS)]}", max_tokens=24)
    line["body"]["response_format"] = {
        "type": "json_schema",
        "json_schema": {"name": "city", "schema": schema, "strict": True},
    }
    return line


def test_json_schema_batch_and_extract_task(laneserve_home, db_url, engine, smollm2_dir):
    lines = [schema_line(i, CITY) for i in range(LINES)]
    lines[7] = schema_line(7, {"type": "object", "properties": {"x": {"type": "strng"}}})
    with pytest.raises(InvalidRequestError, match="Unimplemented keys"):  # job-level: refused
        submit(
            engine,
            write_jsonl(laneserve_home / "bad.jsonl", [{"id": "d", "text": "x"}]),
            task="extract",
            task_options={"schema": json.dumps({"not": {}})},
        )
    stack = Stack.for_jobs(laneserve_home, db_url)
    try:
        stack.start_broker()
        stack.start_worker("w1", "--max-num-seqs", "8", model=str(smollm2_dir))
        stack.start_jobs_runner(model=str(smollm2_dir))
        batch = submit(engine, write_jsonl(laneserve_home / "schema.jsonl", lines))
        docs = [
            {"id": f"d{i}", "text": f"{DOCS[i % len(DOCS)]} (record {i})"} for i in range(LINES)
        ]
        extract = submit(
            engine,
            write_jsonl(laneserve_home / "docs.jsonl", docs),
            task="extract",
            task_options={"schema": json.dumps(CITY), "max_tokens": 24},
        )
        for job, n_ok, n_bad in ((batch, LINES - 1, 1), (extract, LINES, 0)):
            job = wait_job(engine, job.id, ("completed", "failed"), stack, timeout_s=600)
            assert job.status == "completed", (job.errors, stack.logs())
            assert job.request_counts == {"total": n_ok + n_bad, "completed": n_ok, "failed": n_bad}
            for line in read_lines(engine, job.output_file_id):
                message = line["response"]["body"]["choices"][0]["message"]
                jsonschema.validate(json.loads(message["content"]), CITY)
                assert message["parsed"] == json.loads(message["content"])
            errors = read_lines(engine, job.error_file_id)
            assert [e["custom_id"] for e in errors] == (["c7"] if n_bad else [])
        (error,) = read_lines(engine, job_of(engine, batch.id).error_file_id)
        assert "strng" in error["error"]["message"]
    finally:
        stack.stop()


def job_of(engine, job_id):
    from laneserve.jobs import service

    return service.get_batch(engine, job_id)


def test_submit_extract_needs_a_readable_schema(tmp_path) -> None:
    docs = write_jsonl(tmp_path / "docs.jsonl", [{"id": "a", "text": "x"}])
    (tmp_path / "fields.json").write_text(json.dumps(CITY, indent=2))
    (tmp_path / "broken.json").write_text("{oops")

    def args(**kw) -> argparse.Namespace:
        base = dict(file=docs, task="extract", schema=tmp_path / "fields.json", target_lang=None,
                    source_lang=None, max_tokens=None, metadata=[], model=None, endpoint=None,
                    completion_window="24h")  # fmt: skip
        return argparse.Namespace(**{**base, **kw})

    assert submit_cmd._check_args(args()) is None
    body = submit_cmd._batch_body(args(), "file-1")
    assert body["task"] == "extract" and json.loads(body["task_options"]["schema"]) == CITY
    assert "go together" in submit_cmd._check_args(args(schema=None))
    assert "go together" in submit_cmd._check_args(args(task="summarize"))
    assert "broken.json" in submit_cmd._check_args(args(schema=tmp_path / "broken.json"))
