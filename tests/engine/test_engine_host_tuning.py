"""CPU host tuning: glibc allocator settings, the OpenMP wait policy of engine processes (applied by
the entry points before torch loads, never by importing gpu_worker) and the model runner's thread
rule."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from laneserve.gpu_worker import openmp

OMP_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


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
        "from laneserve.gpu_worker import host_memory as h; "
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
    assert openmp.openmp_is_purely_passive() is passive


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in OMP_VARS}
    return {**env, "PYTHONPATH": os.getcwd(), **extra}


def test_importing_gpu_worker_leaves_the_environment_alone():
    code = (
        "import os, json; before = dict(os.environ); "
        "import laneserve.gpu_worker, laneserve.gpu_worker.config, laneserve.gpu_worker.worker, "
        "laneserve.gpu_worker.synthetic, laneserve.gpu_worker.faults, laneserve.gpu_worker.llm, "
        "laneserve.gpu_worker.engine, laneserve.kernels; "
        "from laneserve.gpu_worker import LLM, EngineConfig, SamplingParams; "
        "after = dict(os.environ); "
        "print(json.dumps({k: [before.get(k), after.get(k)] for k in set(before) | set(after) "
        "if before.get(k) != after.get(k)}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=_clean_env(), capture_output=True, text=True,
        timeout=120, check=True,
    )  # fmt: skip
    assert out.stdout.strip() == "{}", out.stdout


def _libgomp_settings(stderr: str) -> dict[str, str]:
    """What libgomp printed under OMP_DISPLAY_ENV=verbose when torch loaded it."""
    found = {}
    for line in stderr.splitlines():
        name, sep, value = line.strip().partition(" = ")
        if sep and name in OMP_VARS:
            found[name] = value.strip("'")
    return found


@pytest.mark.slow
@pytest.mark.parametrize(
    ("argv", "policy"),
    [
        # the worker entry point (it shares the cores with the broker and the API server): the
        # short spin, then torch (device check), then the model fails
        (
            ["-m", "laneserve.commands.worker", "--model", "/nonexistent/model.gguf"],
            {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "3000"},
        ),
        # the offline API owns the cores: LLM() makes the threads spin, before the engine loads
        # (libgomp's spin count for ACTIVE)
        (
            ["-c", "from laneserve.gpu_worker import LLM; LLM(model='/nonexistent/model.gguf')"],
            {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "30000000000"},
        ),
    ],
    ids=["worker", "LLM"],
)
def test_entry_points_start_torch_under_their_policy(argv, policy):
    """libgomp reads its policy once, when torch loads: check what it actually runs with."""
    env = _clean_env(OMP_DISPLAY_ENV="VERBOSE")
    out = subprocess.run(
        [sys.executable, *argv], env=env, capture_output=True, text=True, timeout=180
    )
    assert out.returncode != 0  # the model does not exist: the process stops after torch loaded
    assert _libgomp_settings(out.stderr) == policy
    explicit = subprocess.run(
        [sys.executable, *argv], env={**env, "GOMP_SPINCOUNT": "7"}, capture_output=True,
        text=True, timeout=180,
    )  # fmt: skip
    assert _libgomp_settings(explicit.stderr)["GOMP_SPINCOUNT"] == "7"  # an explicit value wins


def test_plain_torch_import_keeps_libgomps_long_spin():
    """The control for the test above: without the entry points libgomp spins 300000 times."""
    out = subprocess.run(
        [sys.executable, "-c", "import laneserve.gpu_worker, torch"],
        env=_clean_env(OMP_DISPLAY_ENV="VERBOSE"), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert _libgomp_settings(out.stderr)["GOMP_SPINCOUNT"] == "300000"


def test_policy_env_for_children():
    assert openmp.policy_env({}) == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "3000"}
    assert openmp.policy_env({"GOMP_SPINCOUNT": "0"}) == {}
    assert openmp.policy_env({"OMP_WAIT_POLICY": "ACTIVE"}) == {}
    assert openmp.policy_env({}, exclusive=True) == {"OMP_WAIT_POLICY": "ACTIVE"}
    assert openmp.policy_env({"OMP_WAIT_POLICY": "PASSIVE"}, exclusive=True) == {}


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
        from laneserve.gpu_worker import SamplingParams

        engine.add_request(
            "t",
            prompt_token_ids=list(range(100, 160)),
            sampling_params=SamplingParams(max_tokens=3, temperature=0.0),
        )
        while engine.has_unfinished_requests():
            engine.step()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert seen[0] == 2 and seen[1:] == [1, 1], seen  # 60-token prefill: 2 threads; decodes: 1
