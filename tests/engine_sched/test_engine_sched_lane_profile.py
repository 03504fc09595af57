"""The worker's lane profile: short CPU steps when serving interactive traffic, else the big budget."""

from __future__ import annotations

from laneserve.commands.worker import lane_profile


def test_cpu_worker_serving_interactive_keeps_steps_short():
    profile = lane_profile(["interactive", "batch"], "cpu")
    assert profile["max_num_batched_tokens"] == 48
    assert profile["interactive_batch_token_cap"] == 8
    # DESIGN "Lanes inside one worker": without interactive traffic batch gets the whole budget
    assert profile["batch_token_budget"] is None


def test_batch_only_and_gpu_workers_take_the_large_budget():
    for lanes, device in ((["batch"], "cpu"), (["interactive", "batch"], "cuda:0")):
        profile = lane_profile(lanes, device)
        assert profile["max_num_batched_tokens"] == 2048
        assert profile["interactive_batch_token_cap"] == 512
        assert profile["batch_token_budget"] is None
