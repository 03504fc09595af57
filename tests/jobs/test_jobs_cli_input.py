"""The CLI without a running stack: `submit`'s .txt conversion, where the CLI finds the API
(`--url`, `$LANESERVE_URL`, stack.json), a job's figures from SQL (`jobs.stats`) and the
`jobs show` summary made of them, `jobs list` at 80 columns (against a bare gateway) and
narrower."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time

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


def test_api_found_from_url_then_env_then_stack_json(laneserve_home, monkeypatch):
    from laneserve.http_client import StackError, resolve_target

    monkeypatch.delenv("LANESERVE_URL", raising=False)
    monkeypatch.delenv("LANESERVE_API_KEY", raising=False)
    with pytest.raises(StackError) as err:  # no stack, no URL: exit code 2, says what to do
        resolve_target()
    assert err.value.exit_code == 2 and "--url" in str(err.value)
    stack = {"state": "ready", "supervisor_pid": os.getpid(), "api_url": "http://127.0.0.1:9"}
    (laneserve_home / "stack.json").write_text(json.dumps(stack))
    local = resolve_target()
    assert (local.base_url, local.api_key, local.local) == ("http://127.0.0.1:9", None, True)
    monkeypatch.setenv("LANESERVE_URL", "http://10.1.2.3:8000/v1/")
    monkeypatch.setenv("LANESERVE_API_KEY", "k-env")
    remote = resolve_target()
    assert (remote.base_url, remote.api_key, remote.local) == (
        "http://10.1.2.3:8000",
        "k-env",
        False,
    )
    given = resolve_target("gpu-box:8000", "k-flag")  # the flags win; a bare host gets http://
    assert (given.base_url, given.api_key) == ("http://gpu-box:8000", "k-flag")


def test_endpoint_comes_from_the_first_line(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text('\n{"custom_id": "a", "url": "/v1/completions"}\n')
    assert submit._endpoint_of(path) == "/v1/completions"
    path.write_text("not json\n")
    assert submit._endpoint_of(path) == "/v1/chat/completions"


def _finished_job(engine, lines: list[dict]) -> str:
    """A completed job whose `requests` rows carry `lines` (token counts and latencies)."""
    from laneserve.db.models import Job, Request
    from laneserve.db.session import write_session
    from laneserve.jobs import service

    f = service.create_file(engine, b"{}\n" * len(lines), "in.jsonl")
    job = service.create_batch(engine, f.id, "/v1/chat/completions", model="m")
    with write_session(engine) as s:
        row = s.get(Job, job.id)
        row.status, row.request_total, row.request_completed = "completed", len(lines), len(lines)
        row.in_progress_at, row.completed_at = 1000.0, 1010.0  # ran 10 s
        for i, line in enumerate(lines, 1):
            s.add(Request(id=f"{job.id}-{i}", job_id=job.id, custom_id=f"c{i}", line_no=i,
                          lane="batch", response={"ok": True}, **line))  # fmt: skip
    return job.id


def test_batch_stats_from_sql(engine):
    import numpy as np

    from laneserve.jobs import stats

    rng = np.random.default_rng(7)
    ttft, e2e = rng.uniform(1, 500, 40), rng.uniform(500, 9000, 40)
    lines = [
        {"prompt_tokens": 10 + i, "completion_tokens": 20 + i, "cached_tokens": i % 3,
         "ttft_ms": float(ttft[i]), "e2e_ms": float(e2e[i])}
        for i in range(40)
    ]  # fmt: skip
    lines[0]["ttft_ms"] = None  # a line without the figure is left out of its percentiles
    job_id = _finished_job(engine, lines)
    got = stats.batch_stats(engine, job_id).to_dict()
    assert got["object"] == "batch.stats" and got["status"] == "completed"
    assert got["finished_lines"] == 40
    assert got["prompt_tokens"] == sum(10 + i for i in range(40))
    assert got["completion_tokens"] == sum(20 + i for i in range(40))
    assert got["cached_tokens"] == sum(i % 3 for i in range(40))
    assert got["elapsed_s"] == 10.0 and got["eta_s"] is None  # ended: no ETA
    assert got["output_tokens_per_s"] == got["completion_tokens"] / 10.0
    assert got["lines_per_s"] == 4.0
    for name, values in (("ttft_ms", ttft[1:]), ("e2e_ms", e2e)):
        summary = got["latency_ms"][name]
        assert summary["count"] == len(values)
        for q in (50, 90, 99):  # numpy's default (linear) percentile, to 0.001 ms
            assert summary[f"p{q}"] == pytest.approx(np.percentile(values, q), abs=1e-3)
    assert got["files"]["input"]["filename"] == "in.jsonl" and got["files"]["output"] is None
    cheap = stats.batch_stats(engine, job_id, latency=False)  # what a progress bar polls
    assert cheap.completion_tokens == got["completion_tokens"]
    assert cheap.latency_ms["e2e_ms"] == {"count": 0, "p50": None, "p90": None, "p99": None}


def test_batch_stats_eta_while_running_and_unknown_batch(engine):
    from laneserve.db.models import Job
    from laneserve.db.session import write_session
    from laneserve.jobs import stats
    from laneserve.jobs.errors import NotFoundError

    job_id = _finished_job(
        engine, [{"completion_tokens": 5, "finished_at": t} for t in (1001.0, 1002.0)]
    )
    with write_session(engine) as s:
        row = s.get(Job, job_id)
        row.status, row.completed_at, row.request_total = "in_progress", None, 10
    running = stats.batch_stats(engine, job_id, now=1004.0)  # 2 of 10 lines in 4 s
    assert running.elapsed_s == 4.0 and running.lines_per_s == 0.5
    assert running.eta_s == 6.0  # 8 lines left, one a second, the last one 2 s ago
    assert running.latency_ms["ttft_ms"] == {"count": 0, "p50": None, "p90": None, "p99": None}
    with pytest.raises(NotFoundError):
        stats.batch_stats(engine, "batch_nope")


def test_eta_smooths_and_never_rises_in_a_slow_tail():
    from laneserve.jobs.stats import smoothed_eta

    # 90 lines one a second, then 10 left with few in flight: no completion for 30 s
    finished = [1000.0 + i for i in range(1, 91)]
    etas = [smoothed_eta(finished[-128:], 1000.0, 90, 100, now) for now in range(1090, 1121, 5)]
    assert etas[0] == pytest.approx(10.0)
    assert all(b <= a for a, b in zip(etas, etas[1:], strict=False)) and etas[-1] == 0.0
    # a burst (the lines of one engine step finish together) moves it by a fraction only
    burst = [*finished, *[1091.0] * 4]
    assert 0 < smoothed_eta(burst, 1000.0, 94, 100, 1091.0) < 6.0
    assert smoothed_eta([], 1000.0, 0, 100, 1005.0) is None


def test_show_summary_names_every_figure(engine):
    from laneserve.commands.jobs import summary_lines
    from laneserve.jobs import service, stats

    job_id = _finished_job(engine, [{"prompt_tokens": 7, "completion_tokens": 30,
                                     "ttft_ms": 12.5, "e2e_ms": 250.0}] * 3)  # fmt: skip
    batch = service.batch_object(service.get_batch(engine, job_id))
    text = "\n".join(summary_lines(batch, stats.batch_stats(engine, job_id).to_dict()))
    assert "completed  (3/3 lines: 3 completed, 0 failed)" in text
    assert "prompt 21, completion 90" in text and "9.0 output tok/s" in text
    assert "TTFT ms     p50 12.5  p90 12.5  p99 12.5  (3 lines)" in text
    assert "e2e ms      p50 250.0" in text and "ran         0:00:10" in text  # ended:
    assert "ETA" not in text  # no ETA
    assert "in.jsonl" in text and batch["input_file_id"] in text
    bare = "\n".join(summary_lines(batch, None))  # a stack without the stats route
    assert "3/3 lines" in bare and batch["input_file_id"] in bare and "TTFT" not in bare


def test_a_cancelled_jobs_figures_leave_out_the_lines_the_cancellation_ended(any_engine):
    """Lines the cancellation ended go to the error file (`batch_cancelled`) whatever they had
    computed: their tokens and latencies are not the job's output, so the figures leave them
    out (they counted 1,768 completion tokens of a job whose output file held 156), and `jobs
    show` says how many failed lines the cancellation ended."""
    from laneserve.commands.jobs import summary_lines
    from laneserve.db.models import Job, Request
    from laneserve.db.session import write_session
    from laneserve.jobs import results, service, stats

    engine = any_engine
    ran = {"prompt_tokens": 7, "completion_tokens": 30, "ttft_ms": 12.5, "e2e_ms": 250.0}
    cut = {"prompt_tokens": 7, "completion_tokens": 400, "ttft_ms": 50.0, "e2e_ms": 6000.0}
    job_id = _finished_job(engine, [ran, ran, cut, cut, {"prompt_tokens": 7}])
    ended = results.error_response("batch_cancelled", "the batch was cancelled")
    with write_session(engine) as s:
        row = s.get(Job, job_id)
        row.status, row.completed_at, row.cancelled_at = "cancelled", None, 1010.0
        row.request_completed, row.request_failed = 2, 3
        # the status is the recorder's or the runner's, whichever wrote last: it does not
        # tell (line 2 finished with an output, its status is the broker's "aborted")
        for i, status, response in ((1, "completed", None), (2, "aborted", None),
                                    (3, "aborted", ended), (4, "completed", ended),
                                    (5, "cancelled", ended)):  # fmt: skip
            line = s.get(Request, f"{job_id}-{i}")
            line.status, line.response = status, response or line.response
    got = stats.batch_stats(engine, job_id)
    assert got.finished_lines == 5 and got.cancelled_lines == 3
    assert got.prompt_tokens == 14 and got.completion_tokens == 60
    assert got.output_tokens_per_s == 6.0
    assert got.latency_ms["e2e_ms"] == {"count": 2, "p50": 250.0, "p90": 250.0, "p99": 250.0}
    batch = service.batch_object(service.get_batch(engine, job_id))
    text = "\n".join(summary_lines(batch, got.to_dict()))
    assert "cancelled  (5/5 lines: 2 completed, 3 failed, 3 of them ended by the cancellation)" in (
        text
    ), text


def test_plain_progress_line():
    from laneserve.commands.jobs import plain_progress

    line = plain_progress(
        "batch_x", {"status": "in_progress", "done": 7, "total": 20, "failed": 1, "tps": 41.25,
                    "eta": 75.0},
    )  # fmt: skip
    assert line == "batch_x: in_progress 7/20, 1 failed, 41.2 tok/s, ETA 0:01:15"


def _jobs_in_every_shape(engine) -> list[str]:
    """Jobs with long statuses, kinds and counts; their ids, newest first."""
    from laneserve.db.models import Job
    from laneserve.db.session import write_session
    from laneserve.jobs import service

    ids = []
    shapes = [
        ("in_progress", "/v1/completions", None, (52_000, 31_337, 12)),
        ("completed", "/v1/chat/completions", "summarize", (104, 100, 4)),
        ("cancelling", "/v1/chat/completions", "translate", (8, 3, 0)),
    ]
    for status, endpoint, task, (total, done, failed) in shapes:
        f = service.create_file(engine, b"{}\n", "in.jsonl")
        options = {"target_lang": "fr"} if task == "translate" else None
        job = service.create_batch(engine, f.id, endpoint, task=task, task_options=options)
        with write_session(engine) as s:
            row = s.get(Job, job.id)
            row.status, row.request_total = status, total
            row.request_completed, row.request_failed = done - failed, failed
        ids.append(job.id)
    return ids[::-1]


@contextlib.contextmanager
def bare_gateway(db_url: str, home):
    """`laneserve api` alone on `db_url` (no broker, workers or runner: jobs stay as written);
    yields its URL."""
    import httpx

    from laneserve.commands.up_host import free_port

    port = free_port()
    env = dict(os.environ, LANESERVE_HOME=str(home), PYTHONPATH=str(ROOT))
    log = open(home / "api.log", "ab")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, "-m", "laneserve.commands.api", "--port", str(port), "--db", db_url,
         "--broker", f"ipc://{home}/no-broker.sock"],
        env=env, stdout=log, stderr=log,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, (
                home / "api.log"
            ).read_text()
            try:
                if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


@pytest.mark.slow
def test_jobs_list_fits_80_columns_with_full_ids(engine, db_url, laneserve_home, tmp_path):
    ids = _jobs_in_every_shape(engine)
    empty = tmp_path / "cli-home"  # the CLI reads nothing of the stack's home
    empty.mkdir()
    env = dict(os.environ, LANESERVE_HOME=str(empty), PYTHONPATH=str(ROOT))
    env.pop("LANESERVE_DB_URL", None)
    with bare_gateway(db_url, laneserve_home) as url:

        def jobs_list(columns: int) -> subprocess.CompletedProcess:
            return subprocess.run(
                [sys.executable, "-m", "laneserve.cli", "jobs", "list", "--url", url],
                env=env | {"COLUMNS": str(columns)}, capture_output=True, text=True, timeout=120,
            )  # fmt: skip

        narrow, wide = jobs_list(80), jobs_list(200).stdout

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

    assert "hidden" not in wide
    for needle in ("created", "kind", "failed", "completions", "summarize", "translate"):
        assert needle in wide
    (row,) = [x for x in wide.splitlines() if ids[2] in x]
    assert row.split()[:5] == [ids[2], "in_progress", "31337/52000", "12", "completions"]


def test_jobs_list_folds_but_never_cuts_ids_when_very_narrow(engine):
    import io

    from rich.console import Console

    from laneserve.commands.jobs import list_table
    from laneserve.jobs import service

    ids = _jobs_in_every_shape(engine)
    out = io.StringIO()
    batches = [service.batch_object(j) for j in service.list_batches(engine)]
    Console(file=out, width=50).print(list_table(batches, 50))
    header, _, *body = out.getvalue().splitlines()
    assert header.split() == ["id", "status", "lines"]
    assert max(len(x) for x in body) <= 50 and "…" not in out.getvalue()
    first_column = "".join(x.split()[0] for x in body if x.strip() and "hidden" not in x)
    assert all(job_id in first_column for job_id in ids)  # folded onto two lines, not cut
