"""The demo's corpus (fast) and `laneserve demo --quick` end to end on the bundled model (slow);
a synthetic stack whose supervisor is SIGKILLed leaves no process behind (slow)."""

from __future__ import annotations

import json
import signal
import time

import psutil
import pytest

from laneserve.demo_corpus import build_corpus, write_jsonl
from tests.stack.stack_helpers import UpProcess, laneserve, processes_mentioning


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


@pytest.mark.slow
def test_demo_quick_completes_and_stops_its_stack(model_home):
    res = laneserve(model_home, "demo", "--quick", "--no-dashboard", timeout=900)
    assert res.returncode == 0, res.stdout + res.stderr[-5000:]
    for needle in ("TTFT", "TPOT", "queue", "prefill", "decode", "interactive", "batch"):
        assert needle in res.stdout, needle
    (summary_path,) = (model_home / "demo").glob("*/summary.json")
    summary = json.loads(summary_path.read_text())
    assert summary["jobs"]["summarize"]["status"] == "completed"
    assert summary["jobs"]["translate"]["status"] == "completed"
    assert summary["jobs"]["summarize"]["total"] + summary["jobs"]["translate"]["total"] == 12
    assert summary["lanes"]["batch"]["requests"] >= 12
    assert summary["lanes"]["batch"]["ttft_ms"]["p50"] > 0
    assert summary["chats"]["done"] >= 1 and summary["lanes"]["interactive"]["requests"] >= 1
    outputs = [json.loads(x) for x in open(summary["files"]["summarize_output"])]
    assert len(outputs) == 4
    assert all(o["response"]["body"]["choices"][0]["message"]["content"] for o in outputs)
    assert not (model_home / "stack.json").exists()  # the demo stopped the stack it started
    assert processes_mentioning(str(model_home)) == []


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
