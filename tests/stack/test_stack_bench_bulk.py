"""A bulk job after a one-token chat keeps its steps sized for throughput (issue 53), through
`scripts/bench_bulk.py` on real stacks with the bundled model (slow).

The property read from the worker's step trace, not a timing: once the chat is answered, every
step with no interactive request running or waiting is a batch-alone plan whose token budget is
at least the batch rows running (a running mean of prompt lengths once cut them to 1-4 tokens
beside 64 running rows after one "Hi")."""

from __future__ import annotations

import argparse
import json

import pytest

from tests.harness import load_script, run_script


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_one_token_chat_leaves_the_jobs_steps_sized_for_throughput(model_home, tmp_path):
    traces = tmp_path / "traces"
    proc = run_script(
        "bench_bulk",
        model_home,
        "--lines", "24",
        "--max-tokens", "8",
        "--phases", "offline,after_chat,beside_chats,chats_only",
        "--chats-only-s", "3",
        "--interactive-rate", "0.5",  # 2 a second saturated a 2-core AVX2 EPYC: the job starved
        "--chats", "2",
        "--keep-traces", str(traces),
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["machine"]["simd_flags"] is not None
    size = report["sizes"]["24"]
    got = size["rounds"][0]
    for phase in ("after_chat", "beside_chats"):
        assert got[phase]["lines_completed"] == 24, got[phase]
        assert got[phase]["completion_tokens"] == 24 * 8
        assert got[phase]["tok_s"] > 0
    assert got["offline"]["completion_tokens"] == 24 * 8
    # time per computed token on both sides: the offline engine's and the job's batch-only steps'
    assert got["offline"]["steps"] > 0 and got["offline"]["ms_per_token"] > 0
    assert got["offline"]["tokens_per_step"] > 8  # 24 prompts of ~300 tokens in 2,048-token steps
    assert got["after_chat"]["steps"]["ms_per_token"] > 0
    # both sides' steps by kind: the offline engine's 24 prompts of ~300 tokens go in through
    # prefill steps of hundreds of tokens, its last decodes in decode-only steps of at most 24
    offline = got["offline"]["step_kinds"]
    assert offline["prefill"]["steps"] >= 1 and offline["prefill"]["tokens_per_step"] > 100
    assert offline["decode_only"]["steps"] >= 1
    assert 1 <= offline["decode_only"]["tokens_per_step"] <= 24
    total = offline["prefill"]["steps"] + offline["decode_only"]["steps"]
    assert total == got["offline"]["steps"]
    job = got["after_chat"]["steps"]["step_kinds"]  # the job's: its 24 prompts prefill in steps
    assert job["prefill"]["steps"] >= 1 and job["prefill"]["ms_per_token"] > 0
    assert job["prefill"]["tokens_per_step"] > 24  # a chunk beside the decodes
    assert (job["decode_only"]["tokens_per_step"] or 0) <= 24  # 24 seats, no drafts
    assert size["after_chat_over_offline_median"] > 0
    assert got["after_chat"]["steps"]["steps_with_budget_below_running"] == 0
    beside = got["beside_chats"]
    assert beside["chats"] >= 1 and beside["chat_errors"] == 0
    assert beside["ttft_p99_over_idle_p99"] > 0
    (slowest,) = beside["slowest_idle_chats"]  # where its gaps went: the idle set's short chat
    assert slowest["tokens"] >= 2 and slowest["long_gaps_ms"] + slowest["other_gaps_ms"] > 0
    alone_chats = got["chats_only"]  # the same chats with no job beside them
    assert alone_chats["chats"] >= 1 and alone_chats["chat_errors"] == 0
    assert "lines_completed" not in alone_chats and alone_chats["span_s"] >= 3

    (trace,) = traces.glob("after_chat-*.jsonl")
    steps = [json.loads(line) for line in trace.read_text().splitlines()]
    chat = [s for s in steps if s["plan"]["reason"] == "prompt"]
    assert len(chat) == 1  # the chat's one prefill step (its one token ends it)
    alone = [
        s
        for s in steps
        if s["t"] > chat[0]["t"]
        and not s["view"]["interactive_running"]
        and not s["view"]["interactive_waiting_tokens"]
        and s["view"]["batch_running"]
    ]
    # the job ran after the chat, in steps of its own: each line emits 8 tokens, one a step
    assert len(alone) >= 8
    for s in alone:
        assert s["plan"]["reason"].startswith("batch-alone"), s
        assert s["plan"]["token_budget"] >= s["view"]["batch_running"], s
        assert s["robust_prompt"] >= 256, s
    # the steps with prompts to prefill take chunks of real size, not 1-4 tokens (the others
    # decode the job's running rows)
    budgets = sorted(s["plan"]["token_budget"] for s in alone if s["view"]["batch_prefill_tokens"])
    assert budgets and budgets[len(budgets) // 2] >= 32

    # beside the chats, those that came while a batch-only step ran were served between its
    # layers (gpu_worker/interleave.py): interactive steps alone, beside batch rows in flight
    # (whether a chat came then is the arrivals' chance: tests/engine/test_engine_interleave.py
    # makes one come)
    (trace,) = traces.glob("beside_chats-*.jsonl")
    steps = [json.loads(line) for line in trace.read_text().splitlines()]
    between = [s for s in steps if s["plan"]["reason"] == "interleaved"]
    assert beside["steps"]["interleaved_steps"] == len(between)
    for s in between:
        assert s["view"]["batch_running"] >= 1, s
        assert s["view"]["interactive_running"] or s["view"]["interactive_waiting_tokens"], s


def test_policy_phases_set_the_whole_wait_policy_and_split_the_gap():
    """The phases that tell the OpenMP wait policy's share of the gap from the path's: a phase's
    policy replaces both variables (an inherited ``GOMP_SPINCOUNT=0``, as the test suite sets,
    would otherwise win over ``OMP_WAIT_POLICY=ACTIVE`` in libgomp), and the summary splits
    offline / alone into offline / offline-under-the-worker's-policy and that / alone."""
    bench = load_script("bench_bulk")
    inherited = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0", "PATH": "/bin"}
    assert bench.with_openmp(inherited, bench.SPIN_ENV) == {
        "OMP_WAIT_POLICY": "ACTIVE",
        "PATH": "/bin",
    }
    short = bench.with_openmp(inherited, bench.SHORT_SPIN_ENV)
    assert short["GOMP_SPINCOUNT"] == "3000" and short["OMP_WAIT_POLICY"] == "PASSIVE"
    assert inherited["GOMP_SPINCOUNT"] == "0"  # the caller's environment is left as it was
    assert bench.openmp_vars("OMP_WAIT_POLICY=PASSIVE, GOMP_SPINCOUNT=100000") == {
        "OMP_WAIT_POLICY": "PASSIVE",
        "GOMP_SPINCOUNT": "100000",
    }
    for bad in ("OMP_NUM_THREADS=1", "GOMP_SPINCOUNT", "OMP_WAIT_POLICY="):
        with pytest.raises(argparse.ArgumentTypeError, match="expected NAME=VALUE"):
            bench.openmp_vars(bad)
    rounds = [
        {"offline": {"tok_s": 400.0}, "offline_worker_policy": {"tok_s": 320.0},
         "alone": {"tok_s": 288.0}, "alone_active": {"tok_s": 360.0}},
    ]  # fmt: skip
    phases = ["offline", "offline_worker_policy", "alone", "alone_active"]
    out = bench.summarize(rounds, phases)
    assert out["offline_worker_policy_over_offline_median"] == 0.8
    assert out["alone_over_offline_worker_policy_median"] == 0.9
    assert out["alone_over_offline_median"] == 0.72
    assert out["alone_active_over_offline_median"] == 0.9
