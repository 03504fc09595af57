"""CPU host tuning: glibc allocator settings and the OpenMP thread policy of the model runner."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from gpu_worker import model_runner


def _in_fresh_process(code: str, **env: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return out.stdout.strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_malloc_tuning_applies_once_and_can_be_turned_off():
    code = (
        "from gpu_worker import host_memory as h; "
        "print(h.tune_for_inference(), h.tune_for_inference())"
    )
    assert _in_fresh_process(code) == "True True"
    assert _in_fresh_process(code, LANESERVE_MALLOC_TUNING="0") == "False False"


@pytest.mark.parametrize(
    ("env", "passive"),
    [
        ({"OMP_WAIT_POLICY": "PASSIVE"}, True),
        ({"OMP_WAIT_POLICY": "passive", "GOMP_SPINCOUNT": "0"}, True),
        ({"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "3000"}, False),
        ({}, False),
        ({"OMP_WAIT_POLICY": "ACTIVE"}, False),
    ],
)
def test_openmp_passive_detection(monkeypatch, env, passive):
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert model_runner.openmp_is_purely_passive() is passive


def test_gpu_worker_sets_a_short_spin_unless_told_otherwise():
    code = "import os, gpu_worker; print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'))"
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run(
        [sys.executable, "-c", code], env=clean, capture_output=True, text=True, timeout=60
    )
    assert out.stdout.split() == ["PASSIVE", "3000"]
    assert _in_fresh_process(code, OMP_WAIT_POLICY="ACTIVE", GOMP_SPINCOUNT="7") == "ACTIVE 7"


def test_small_cpu_steps_run_single_threaded_and_restore_threads(base_llm, monkeypatch):
    """A decode step under the single-thread rule runs with 1 thread and leaves the setting alone."""
    engine = base_llm.engine
    runner = engine.runner
    monkeypatch.setattr(runner, "cpu_single_thread_tokens", 48)
    seen = []
    real = runner._forward

    def spy(inputs):
        seen.append(torch.get_num_threads())
        return real(inputs)

    monkeypatch.setattr(runner, "_forward", spy)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        from gpu_worker import SamplingParams

        engine.add_request(
            "t",
            prompt_token_ids=list(range(100, 160)),
            sampling_params=SamplingParams(max_tokens=3),
        )
        while engine.has_unfinished_requests():
            engine.step()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert seen[0] == 2 and seen[1:] == [1, 1], seen  # 60-token prefill: 2 threads; decodes: 1
