"""The demo's corpus and its verdict on the lanes (fast); `scripts/demo --quick` end to end on
the bundled model in a fresh virtual environment with the runtime dependencies only (the
README's first command, run once: it asserts what the demo must show); the demo failing loudly against stacks whose interactive or batch lane
serves nothing (slow); a synthetic stack whose supervisor is SIGKILLed leaves no process behind
(slow)."""

from __future__ import annotations

import copy
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest

from laneserve.demo_corpus import build_corpus, write_jsonl
from laneserve.demo_report import (
    LANES,
    PHASES,
    cpu_kernel_state,
    kernel_note,
    lane_failures,
    print_report,
)
from tests.harness import ROOT, UpProcess, laneserve, link_model, processes_mentioning


def test_corpus_is_real_varied_and_deterministic(tmp_path):
    corpus = build_corpus(40, 64)
    assert len(corpus.documents) == 40 and len(corpus.sentences) == 64
    assert corpus == build_corpus(40, 64)
    doc_ids = [i for i, _ in corpus.documents]
    assert len(set(doc_ids)) == 40
    assert len({i.split(".")[0] for i in doc_ids}) >= 20  # many stdlib modules, not one
    assert "json" in doc_ids
    for _, text in corpus.documents:
        assert 300 <= len(text) <= 800 and "``" not in text and "\n" not in text
    texts = [t for _, t in corpus.sentences]
    assert len(set(texts)) == 64
    for text in texts:
        assert 8 <= len(text.split()) <= 30 and text[0].isupper() and text.endswith(".")
        assert not any(ch in text for ch in "_=(){}[]`>")
    path = write_jsonl(tmp_path / "d.jsonl", corpus.sentences)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert lines[0] == {"id": "s0001", "text": texts[0]}
    with pytest.raises(ValueError, match="asked for"):
        build_corpus(100_000, 1)


def _healthy_report() -> dict:
    """A summary.json as a healthy full demo writes it (40 chats, 40 + 64 lines)."""
    lane = {"requests": 52, "errors": 0, "prompt_tokens": 900, "cached_tokens": 0,
            "completion_tokens": 1200}  # fmt: skip
    lane |= {phase: {"p50": 12.0, "p99": 30.0} for phase in PHASES}
    return {
        "wall_s": 60.0,
        "jobs": {
            "summarize": {
                "id": "batch_a",
                "status": "completed",
                "total": 40,
                "completed": 40,
                "failed": 0,
            },
            "translate": {
                "id": "batch_b",
                "status": "completed",
                "total": 64,
                "completed": 64,
                "failed": 0,
            },
        },  # fmt: skip
        "chats": {
            "done": 40,
            "errors": 0,
            "first_error": None,
            "fatal": None,
            "client_ttft_ms_p50": 20.0,
            "client_ttft_ms_p99": 40.0,
            "client_tpot_ms_p50": 9.0,
        },  # fmt: skip
        "lanes": {"interactive": copy.deepcopy(lane), "batch": copy.deepcopy(lane)},
        "throughput_tokens_per_s": {"interactive": 20.0, "batch": 20.0},
        "files": {},
        "dashboard_url": None,
        "stack_stops_after_demo": True,
    }


def test_lane_failures_name_each_broken_lane():
    assert lane_failures(_healthy_report()) == []

    r = _healthy_report()  # the first-run bug: the chat loop died, 0 answered
    r["chats"] |= {"done": 0, "fatal": "ModuleNotFoundError: No module named 'openai'"}
    del r["lanes"]["interactive"]
    reasons = lane_failures(r)
    assert any("ModuleNotFoundError" in x for x in reasons)
    assert any("no chat answered (0 sent)" in x for x in reasons)

    r = _healthy_report()  # 4 of 40 failed is within the 10 % tolerance, 5 is not
    r["chats"] |= {"done": 36, "errors": 4, "first_error": "APITimeoutError: timed out"}
    assert lane_failures(r) == []
    r["chats"] |= {"done": 35, "errors": 5}
    assert lane_failures(r) == [
        "interactive lane: 5 of 40 chats failed; first error: APITimeoutError: timed out"
    ]

    r = _healthy_report()
    r["jobs"]["translate"] |= {"status": "failed", "completed": 0, "failed": 64}
    r["jobs"]["summarize"] |= {"completed": 35, "failed": 5}  # over int(0.1 * 40) = 4
    assert lane_failures(r) == [
        "summarize job: 5 of 40 lines failed",
        "translate job batch_b ended failed",
    ]

    r = _healthy_report()  # answered, but the recorder has no timed row of the lane
    r["lanes"]["batch"]["ttft_ms"] = {"p50": None, "p99": None}
    assert lane_failures(r) == ["batch lane: answered, but SQL has no request with a TTFT"]


def test_report_always_has_both_lanes_columns():
    r = _healthy_report()
    del r["lanes"]["interactive"], r["throughput_tokens_per_s"]["interactive"]
    from rich.console import Console

    from laneserve.demo_chats import ChatStats

    buf = io.StringIO()
    print_report(r, {}, {}, ChatStats(), ROOT, Console(file=buf, width=100))
    text = buf.getvalue()
    for lane in LANES:
        assert f"{lane} P50" in text and f"{lane} P99" in text
    assert "interactive lane: no request recorded in SQL" in text


def test_report_shows_a_whole_answer_and_counts_the_cut_ones(tmp_path):
    """The example under a job's output file is its first answer that finished on its own, not
    one cut mid-word at max tokens; the cut ones are counted beside it."""
    from rich.console import Console

    from laneserve.demo_chats import ChatStats
    from laneserve.demo_report import cut_answers

    def line(text: str, reason: str) -> str:
        choice = {"message": {"content": text}, "finish_reason": reason}
        return json.dumps({"response": {"body": {"choices": [choice]}}})

    out = tmp_path / "summarize.jsonl"
    out.write_text("\n".join([line("json is a mod", "length"), line("json reads JSON.", "stop")]))
    r = _healthy_report()
    r["jobs"]["summarize"] |= {"cut_at_max_tokens": cut_answers(out), "completed": 2}
    buf = io.StringIO()
    files = {"summarize_output": str(out)}
    # a narrow terminal folds the line itself: the path and the note are never broken by rich
    print_report(r, {}, files, ChatStats(), ROOT, Console(file=buf, width=40))
    text = buf.getvalue()
    assert "e.g. json reads JSON." in text and "json is a mod" not in text
    said = f"summarize_output: {out} (1 of 2 answers cut at their max tokens: --summary-tokens"
    assert said + " raises it)" in text
    # the bundled model's "translations" are not shown as if they were ones; another model's are
    out.rename(tmp_path / "translate.jsonl")
    files = {"translate_output": str(tmp_path / "translate.jsonl")}
    r["jobs"]["translate"] |= {"cut_at_max_tokens": 0}
    for model, shown in (("smollm2-135m", False), ("/models/qwen3-8b", True)):
        buf = io.StringIO()
        print_report(
            r | {"model": model}, {}, files, ChatStats(), ROOT, Console(file=buf, width=400)
        )
        assert ("e.g. json reads JSON." in buf.getvalue()) == shown, model
        assert ("does not translate" in buf.getvalue()) != shown, model


def test_report_says_when_the_figures_are_the_slow_paths(monkeypatch):
    """A run that started before the C++ kernels were built served (partly) on the PyTorch path:
    the report says so under the latency table; a run on built kernels says nothing."""
    from rich.console import Console

    from laneserve.demo_chats import ChatStats

    monkeypatch.setenv("LANESERVE_CPU_KERNELS", "0")
    off = cpu_kernel_state()
    assert off in ("off", "gpu")  # a CUDA device serves instead of the CPU kernels
    assert kernel_note("built", "built") is None and kernel_note("gpu", "gpu") is None
    printed = {}
    for start, end in (("not built", "built"), ("not built", "not built"), ("off", "off")):
        r = _healthy_report() | {"cpu_kernels": {"note": kernel_note(start, end)}}
        buf = io.StringIO()
        print_report(r, {}, {}, ChatStats(), ROOT, Console(file=buf, width=400))
        printed[start, end] = buf.getvalue()
    assert "still building for part of this run" in printed["not built", "built"]
    assert "not built in this run" in printed["not built", "not built"]
    assert all("PyTorch path" in text for text in printed.values())


def _assert_both_lanes_answered(summary: dict, lines: int) -> None:
    assert summary["ok"] is True and summary["failures"] == [], summary["failures"]
    assert summary["jobs"]["summarize"]["status"] == "completed"
    assert summary["jobs"]["translate"]["status"] == "completed"
    assert summary["jobs"]["summarize"]["total"] + summary["jobs"]["translate"]["total"] == lines
    assert summary["lanes"]["batch"]["requests"] >= lines
    assert summary["lanes"]["batch"]["ttft_ms"]["p50"] > 0
    assert summary["chats"]["done"] >= 1 and summary["chats"]["errors"] == 0
    assert summary["lanes"]["interactive"]["requests"] >= 1
    assert summary["lanes"]["interactive"]["ttft_ms"]["p50"] > 0


def _assert_quick_demo_summary(summary: dict, stdout: str) -> None:
    """What `demo --quick` must leave: both lanes answered, both jobs completed with their 12
    lines, the summaries written and the ones cut at max tokens counted and said."""
    _assert_both_lanes_answered(summary, 12)
    for needle in ("TTFT", "TPOT", "queue", "prefill", "decode", "interactive", "batch"):
        assert needle in stdout, needle
    assert summary["jobs"]["summarize"]["status"] == "completed"
    assert summary["jobs"]["translate"]["status"] == "completed"
    assert summary["jobs"]["summarize"]["total"] + summary["jobs"]["translate"]["total"] == 12
    assert summary["lanes"]["batch"]["requests"] >= 12
    outputs = [json.loads(x) for x in open(summary["files"]["summarize_output"])]
    assert len(outputs) == 4
    assert all(o["response"]["body"]["choices"][0]["message"]["content"] for o in outputs)
    # answers cut at their max tokens are counted and said (they were shown as if whole)
    cut = [o["response"]["body"]["choices"][0]["finish_reason"] == "length" for o in outputs]
    assert summary["jobs"]["summarize"]["cut_at_max_tokens"] == sum(cut)
    said = f"({sum(cut)} of 4 answers cut at their max tokens: --summary-tokens raises it)"
    assert (said in stdout) == (sum(cut) > 0), stdout


def _fresh_env(home, **extra: str) -> dict[str, str]:
    """This environment without anything that points Python at this checkout or at this
    environment's packages; `home` as LANESERVE_HOME."""
    drop = ("PYTHONPATH", "PYTHONHOME", "PYTHONUSERBASE", "VIRTUAL_ENV", "TRITON_INTERPRET",
            "LANESERVE_DB_URL", "LANESERVE_API_KEY")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in drop}
    return env | {"LANESERVE_HOME": str(home), "PIP_NO_INPUT": "1", **extra}


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_readme_demo_in_a_fresh_venv_with_runtime_dependencies_only(
    tmp_path, smollm2_gguf, smollm2_dir
):
    """The README's first command as a new user runs it: `scripts/demo --quick` with a plain
    virtual environment's python (it installs torch and `pip install -e .`, no dev extra)."""
    home, venv = tmp_path / "home", tmp_path / "venv"
    link_model(home, smollm2_gguf, smollm2_dir)  # the one thing not downloaded again
    py = venv / "bin" / "python"
    env = _fresh_env(home, PYTHON=str(py))
    try:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
        # the premise: this venv sees none of this environment's packages (dev extra included)
        probe = subprocess.run([py, "-c", "import pytest"], env=env, capture_output=True)
        assert probe.returncode != 0, "the fresh venv sees pytest"
        t0 = time.monotonic()
        res = subprocess.run(
            [str(ROOT / "scripts" / "demo"), "--quick"],
            env=env, cwd=tmp_path, capture_output=True, text=True, timeout=1800,
        )  # fmt: skip
        wall = time.monotonic() - t0
        assert res.returncode == 0, f"{wall:.0f} s\n{res.stdout[-4000:]}\n{res.stderr[-6000:]}"
        listed = subprocess.run(
            [py, "-m", "pip", "list", "--format=json"], env=env, capture_output=True, text=True,
            timeout=120, check=True,
        )  # fmt: skip
        names = {p["name"].lower() for p in json.loads(listed.stdout)}
        assert {"laneserve", "openai", "torch"} <= names
        assert not names & {"pytest", "ruff", "psycopg", "accelerate"}  # runtime deps only
        assert "INFO alembic" not in res.stderr and "Traceback" not in res.stderr
        stages = [line for line in res.stderr.splitlines() if line.startswith("== [")]
        assert [s.split("] ", 1)[1][:3] for s in stages] == ["1/4", "2/4", "3/4", "4/4"], stages
        assert "Installing collected packages" in res.stderr  # pip's progress, not -q
        assert "build C++ CPU kernels" in res.stderr  # `model pull`'s stages, with their times
        (summary_path,) = (home / "demo").glob("*/summary.json")
        _assert_quick_demo_summary(json.loads(summary_path.read_text()), res.stdout)
        assert not (home / "stack.json").exists()  # the demo stopped the stack it started
        assert processes_mentioning(str(home)) == []
    finally:
        shutil.rmtree(venv, ignore_errors=True)  # 2-3 GB


def _demo_against(home, *up_args: str, demo_args: tuple[str, ...] = ()):
    """`laneserve demo --quick` against a synthetic stack started with `up_args`; returns
    (the demo's CompletedProcess, its summary.json)."""
    home.mkdir()
    up = UpProcess(home, "--synthetic", "--api-port", "0", "--no-dashboard", *up_args)
    try:
        up.wait_ready(timeout_s=120)
        res = laneserve(home, "demo", "--quick", *demo_args, timeout=400)
    finally:
        assert up.stop() == 0, up.logs()
    (summary_path,) = (home / "demo").glob("*/summary.json")
    return res, json.loads(summary_path.read_text())


@pytest.mark.slow
def test_demo_fails_loudly_when_no_worker_serves_the_interactive_lane(tmp_path):
    res, summary = _demo_against(tmp_path / "h", "--lanes", "batch")
    assert res.returncode == 1, res.stdout + res.stderr[-3000:]
    assert "laneserve demo failed" in res.stderr
    assert "interactive lane: no chat answered" in res.stderr
    assert "no worker serves the interactive lane" in res.stderr  # the API's reason, passed on
    for lane in LANES:  # the table keeps the lane that produced nothing, and says so
        assert f"{lane} P50" in res.stdout
    assert "interactive lane: no request recorded in SQL" in res.stdout
    assert summary["ok"] is False and summary["chats"]["done"] == 0
    assert summary["chats"]["errors"] >= 2  # the first round of chats is always sent
    assert [j["status"] for j in summary["jobs"].values()] == ["completed", "completed"]
    assert all("interactive" in reason for reason in summary["failures"])


@pytest.mark.slow
def test_demo_fails_when_its_jobs_cannot_finish(tmp_path):
    res, summary = _demo_against(
        tmp_path / "h", "--lanes", "interactive", demo_args=("--timeout", "15")
    )
    assert res.returncode == 1, res.stdout + res.stderr[-3000:]
    assert "summarize and translate not done after 15 s; cancelled" in res.stderr
    assert summary["ok"] is False and summary["chats"]["done"] >= 1
    assert {j["status"] for j in summary["jobs"].values()} <= {"cancelling", "cancelled"}
    assert "summarize job " in " ".join(summary["failures"])


@pytest.mark.slow
def test_children_exit_when_the_supervisor_is_killed(tmp_path):
    home = tmp_path / "h"
    home.mkdir()
    up = UpProcess(home, "--synthetic", "--api-port", "0", "--no-dashboard")
    info = up.wait_ready(timeout_s=120)
    res = laneserve(home, "status", "--json")
    assert json.loads(res.stdout)["workers"][0]["pid"] == info["children"]["worker-0"]
    second = laneserve(home, "up", "--synthetic", "--api-port", "0", "--no-dashboard", timeout=60)
    assert second.returncode == 1 and "already running" in second.stderr
    children = [psutil.Process(pid) for pid in info["children"].values()]
    up.proc.send_signal(signal.SIGKILL)
    up.proc.wait()
    t0 = time.monotonic()
    gone, alive = psutil.wait_procs(children, timeout=60)
    assert not alive, f"still running after 60 s: {alive}\n{up.logs()}"
    assert time.monotonic() - t0 < 60
    assert processes_mentioning(str(home)) == []
    # stack.json is stale now: commands see no stack.
    assert laneserve(home, "status", "--json").returncode == 1
    assert laneserve(home, "chat", "hi").returncode == 2
    # A new `up` in the same home starts over the stale stack.json and ipc sockets.
    again = UpProcess(home, "--synthetic", "--api-port", "0", "--no-dashboard")
    try:
        info2 = again.wait_ready(timeout_s=120)
        assert info2["supervisor_pid"] == again.proc.pid
        assert laneserve(home, "status", "--json").returncode == 0
    finally:
        assert again.stop() == 0


@pytest.mark.slow
def test_up_fails_fast_when_a_child_keeps_crashing(tmp_path):
    home = tmp_path / "h"
    home.mkdir()
    bad = tmp_path / "bad-model"
    bad.mkdir()
    (bad / "config.json").write_text("{}")  # passes the path check; every loader rejects it
    t0 = time.monotonic()
    res = laneserve(home, "up", "--model", str(bad), "--api-port", "0", "--no-dashboard",
                    timeout=240)  # fmt: skip
    assert res.returncode == 1, res.stderr[-3000:]
    assert "keeps exiting while starting" in res.stderr
    assert time.monotonic() - t0 < 240
    assert not (home / "stack.json").exists()
    assert processes_mentioning(str(home)) == []
