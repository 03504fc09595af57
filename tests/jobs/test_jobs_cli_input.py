"""`laneserve submit` input handling without a stack: .txt conversion, stack.json discovery."""

from __future__ import annotations

import json

from laneserve.commands import submit


def test_txt_is_one_document_per_line_or_per_file(tmp_path):
    txt = tmp_path / "notes.txt"
    txt.write_text("First paragraph.\n\nSecond paragraph.\n")
    per_line = [json.loads(x) for x in submit._txt_as_jsonl(txt, "line").splitlines()]
    assert per_line == [
        {"id": "notes-1", "text": "First paragraph."},
        {"id": "notes-3", "text": "Second paragraph."},
    ]
    (whole,) = [json.loads(x) for x in submit._txt_as_jsonl(txt, "file").splitlines()]
    assert whole == {"id": "notes", "text": txt.read_text()}


def test_database_found_through_stack_json(laneserve_home):
    assert submit.resolve_db(None) is None  # no stack: db.session's default resolution
    (laneserve_home / "stack.json").write_text(json.dumps({"db_url": "sqlite:////x/y.db"}))
    assert submit.resolve_db(None) == "sqlite:////x/y.db"
    assert submit.resolve_db("sqlite:////explicit.db") == "sqlite:////explicit.db"


def test_endpoint_comes_from_the_first_line(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text('\n{"custom_id": "a", "url": "/v1/completions"}\n')
    assert submit._endpoint_of(path) == "/v1/completions"
    path.write_text("not json\n")
    assert submit._endpoint_of(path) == "/v1/chat/completions"


def test_progress_bar_renders_counts_on_a_terminal(engine, laneserve_home):
    import io

    from rich.console import Console

    from db.models import Job
    from db.session import write_session
    from jobs import service

    f = service.create_file(engine, b"{}\n", "in.jsonl")
    job = service.create_batch(engine, f.id, "/v1/chat/completions")
    with write_session(engine) as s:
        row = s.get(Job, job.id)
        row.status, row.request_total, row.request_completed, row.request_failed = (
            "completed",
            10,
            7,
            3,
        )
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120)
    assert submit.follow(engine, job.id, console=console).status == "completed"
    text = out.getvalue()
    assert "10/10" in text and "failed 3" in text and "tok/s" in text and "completed" in text
