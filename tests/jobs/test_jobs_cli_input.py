"""`laneserve submit` input handling without a stack: .txt conversion, stack.json discovery;
`laneserve jobs list` at 80 columns and narrower."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from laneserve.commands import submit
from tests.harness import ROOT


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


def _jobs_in_every_shape(engine) -> list[str]:
    """Jobs with long statuses, kinds and counts; their ids, newest first."""
    from db.models import Job
    from db.session import write_session
    from jobs import service

    ids = []
    shapes = [
        ("in_progress", "/v1/completions", None, (52_000, 31_337, 12)),
        ("completed", "/v1/chat/completions", "summarize", (104, 100, 4)),
        ("cancelling", "/v1/chat/completions", "translate", (8, 3, 0)),
    ]
    for status, endpoint, task, (total, done, failed) in shapes:
        f = service.create_file(engine, b"{}\n", "in.jsonl")
        job = service.create_batch(engine, f.id, endpoint, task=task)
        with write_session(engine) as s:
            row = s.get(Job, job.id)
            row.status, row.request_total = status, total
            row.request_completed, row.request_failed = done - failed, failed
        ids.append(job.id)
    return ids[::-1]


@pytest.mark.slow
def test_jobs_list_fits_80_columns_with_full_ids(engine, laneserve_home):
    ids = _jobs_in_every_shape(engine)
    env = dict(os.environ, LANESERVE_HOME=str(laneserve_home), PYTHONPATH=str(ROOT))
    env.pop("LANESERVE_DB_URL", None)

    def jobs_list(columns: int) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "laneserve.cli", "jobs", "list"],
            env=env | {"COLUMNS": str(columns)}, capture_output=True, text=True, timeout=120,
        )  # fmt: skip

    narrow = jobs_list(80)
    assert narrow.returncode == 0, narrow.stderr
    assert "INFO alembic" not in narrow.stderr  # quiet start-up: no migration INFO lines
    lines = narrow.stdout.splitlines()
    assert max(len(x) for x in lines) <= 80, narrow.stdout
    assert "…" not in narrow.stdout  # no cell is cut
    for job_id, status, lines_cell in zip(
        ids, ("cancelling", "completed", "in_progress"), ("3/8", "100/104", "31337/52000"),
        strict=True,
    ):  # fmt: skip
        (row,) = [x for x in lines if job_id in x]  # the full id, on one line
        assert row.split()[:3] == [job_id, status, lines_cell]
    assert "hidden at 80 columns (--json has all)" in narrow.stdout

    wide = jobs_list(200).stdout
    assert "hidden" not in wide
    for needle in ("created", "kind", "failed", "completions", "summarize", "translate"):
        assert needle in wide
    (row,) = [x for x in wide.splitlines() if ids[2] in x]
    assert row.split()[:5] == [ids[2], "in_progress", "31337/52000", "12", "completions"]


def test_jobs_list_folds_but_never_cuts_ids_when_very_narrow(engine):
    import io

    from rich.console import Console

    from jobs import service
    from laneserve.commands.jobs import list_table

    ids = _jobs_in_every_shape(engine)
    out = io.StringIO()
    Console(file=out, width=50).print(list_table(service.list_batches(engine), 50))
    header, _, *body = out.getvalue().splitlines()
    assert header.split() == ["id", "status", "lines"]
    assert max(len(x) for x in body) <= 50 and "…" not in out.getvalue()
    first_column = "".join(x.split()[0] for x in body if x.strip() and "hidden" not in x)
    assert all(job_id in first_column for job_id in ids)  # folded onto two lines, not cut
