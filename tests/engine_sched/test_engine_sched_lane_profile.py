"""The worker's lane profile: short CPU steps when serving interactive traffic, else the big budget;
the engine config's step knobs take it only where the operator gave nothing."""

from __future__ import annotations

import argparse

import pytest

from laneserve.gpu_worker.config import (
    ENGINE_DEFAULTS,
    EngineConfig,
    EngineConfigError,
    add_engine_arguments,
    config_from_args,
    lane_profile,
)
from laneserve.gpu_worker.scheduler_config import SchedulerConfig


def test_cpu_worker_serving_interactive_keeps_steps_short():
    profile = lane_profile(["interactive", "batch"], on_gpu=False)
    assert profile.max_num_batched_tokens == 48
    assert profile.interactive_batch_token_cap == 8
    assert profile.max_num_seqs == 64
    # DESIGN "Lanes inside one worker": without interactive traffic batch gets the whole budget
    assert EngineConfig().with_profile(profile).batch_token_budget is None


def test_batch_only_and_gpu_workers_take_the_large_budget():
    assert lane_profile(["batch"], on_gpu=False).max_num_batched_tokens == 2048
    assert lane_profile(["batch"], on_gpu=False).interactive_batch_token_cap == 512
    for lanes in (["interactive", "batch"], ["batch"]):
        assert lane_profile(lanes, on_gpu=True) == ENGINE_DEFAULTS


def test_under_slo_control_the_knobs_are_only_upper_bounds():
    """A worker sizes its steps from SLO targets by default: the profile's knobs become the
    engine's large bounds (the CPU keeps its seat count), and `--no-slo-control` restores the
    short fixed CPU profile."""
    from laneserve.commands.worker import engine_config, register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    on = engine_config(parser.parse_args(["worker", "--device", "cpu"]))
    assert on.slo_control is True
    assert (on.max_num_batched_tokens, on.interactive_batch_token_cap, on.max_num_seqs) == (
        2048, 512, 64,
    )  # fmt: skip
    off = engine_config(parser.parse_args(["worker", "--device", "cpu", "--no-slo-control"]))
    assert off.slo_control is False
    assert (off.max_num_batched_tokens, off.interactive_batch_token_cap) == (48, 8)
    synthetic = engine_config(parser.parse_args(["worker", "--synthetic"]))
    assert synthetic.slo_control is False  # no scheduler to control
    assert EngineConfig().slo_control is None  # an offline LLM: fixed knobs


def test_given_knobs_win_over_the_profile():
    profile = lane_profile(["interactive"], on_gpu=False)
    config = EngineConfig(max_num_batched_tokens=300, lanes=("interactive",))
    resolved = config.with_profile(profile)
    assert resolved.max_num_batched_tokens == 300
    assert resolved.interactive_batch_token_cap == 8 and resolved.max_num_seqs == 64


def test_scheduler_defaults_are_the_engine_defaults():
    sched = SchedulerConfig()
    assert sched.max_num_seqs == ENGINE_DEFAULTS.max_num_seqs == 256
    assert sched.max_num_batched_tokens == ENGINE_DEFAULTS.max_num_batched_tokens
    assert sched.interactive_batch_token_cap == ENGINE_DEFAULTS.interactive_batch_token_cap
    resolved = EngineConfig(batch_token_budget=96).with_profile()
    from_engine = SchedulerConfig.from_engine(resolved, max_model_len=1024)
    assert from_engine.batch_token_budget == 96 and from_engine.max_model_len == 1024
    assert from_engine.max_num_seqs == 256


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    return parser.parse_args(list(argv))


def test_flags_json_round_trip():
    args = _parse(
        "--dtype", "float32", "--block-size", "32", "--max-num-seqs", "12",
        "--max-num-batched-tokens", "96", "--kv-cache-memory", "64MiB", "--lanes", "batch",
        "--interactive-batch-token-cap", "4", "--batch-token-budget", "40",
        "--no-enable-prefix-caching",
    )  # fmt: skip
    config = config_from_args(args)
    assert config.kv_cache_memory_bytes == 64 * 2**20 and config.lanes == ("batch",)
    assert config.enable_prefix_caching is False and config.max_num_seqs == 12
    assert EngineConfig.from_json(config.to_json()) == config
    untouched = config_from_args(_parse())
    assert untouched == EngineConfig() and untouched.max_num_seqs is None


@pytest.mark.parametrize(
    "argv",
    [["--max-num-seqs", "0"], ["--kv-cache-memory", "lots"], ["--lanes", "bulk"], ["--dtype", "x"]],
)
def test_bad_flags_are_argparse_errors(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        _parse(*argv)
    assert exc.value.code == 2 and argv[0] in capsys.readouterr().err


@pytest.mark.parametrize(
    "text",
    ['{"max_num_seqs": 0}', '{"max_num_seqs": "8"}', '{"bogus": 1}', '{"lanes": []}', "[1]", "{"],
)
def test_bad_json_is_a_typed_error(text):
    with pytest.raises(EngineConfigError):
        EngineConfig.from_json(text)
