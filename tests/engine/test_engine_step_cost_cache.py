"""The start-up step-cost profile is measured once per machine, model and engine options, cached,
and read back on the next start (the warm start then only warms the engine up)."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest

from laneserve.gpu_worker import step_budget, step_profile
from laneserve.gpu_worker.sampling_params import SamplingParams
from laneserve.kernels import cpu_ext


@pytest.fixture
def step_cost_cache(tmp_path, monkeypatch):
    cpu_ext.load()  # built or found now, under the real cache: the variable below is for ours
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("LANESERVE_STEP_COST_CACHE", raising=False)
    return tmp_path / "laneserve" / "step_cost"


def _shim(engine, **options) -> SimpleNamespace:
    """What `step_cost_cache_key` reads of an engine, its options replaced by `options`."""
    return SimpleNamespace(
        config=dataclasses.replace(engine.config, **options),
        model_path=engine.model_path, dtype=engine.dtype, device=engine.device,
        quantization=engine.quantization,
    )  # fmt: skip


def _prior(llm) -> list[float]:
    return list(llm.engine.scheduler.step_budget.model.theta0)


@pytest.mark.slow
def test_second_start_reuses_the_profiled_prior(make_llm, step_cost_cache, monkeypatch):
    for _ in range(3):  # a profile the load changed during is not cached: start again
        first = make_llm(slo_control=True)
        files = list(step_cost_cache.glob("*.json"))
        if files:
            break
    assert len(files) == 1
    record = json.loads(files[0].read_text())
    cached = record["theta"]
    assert cached == pytest.approx(_prior(first)) and cached[0] > 0.0
    # the TPOT target is the measured idle decode step's multiple, kept beside the prior
    idle_step = record["idle_step_ms"]
    slo = first.engine.scheduler.step_budget.targets.interactive
    assert idle_step > 0.0 and slo.tpot_ms == pytest.approx(
        step_budget.TPOT_MULTIPLE * idle_step, abs=0.1
    )
    engine = first.engine
    assert engine.num_steps == 0 and engine.block_manager.prefix_cache_queries == 0
    key = step_profile.step_cost_cache_key(engine)
    assert files[0].stem == key
    assert step_profile.step_cost_cache_key(_shim(engine)) == key
    other_key = step_profile.step_cost_cache_key(_shim(engine, max_num_seqs=7))
    del first, engine

    # a prior the second start can only have read from the cache (its idle step a little off:
    # within IDLE_STEP_AGREEMENT of the one measured at the start, so it is believed)
    marked = [cached[0] + 123.0, *cached[1:]]
    files[0].write_text(json.dumps({"theta": marked, "idle_step_ms": idle_step * 1.1}))
    second = make_llm(slo_control=True)
    assert _prior(second) == pytest.approx(marked)
    assert second.engine.scheduler.step_budget.targets.interactive.tpot_ms == pytest.approx(
        step_budget.TPOT_MULTIPLE * idle_step * 1.1, abs=0.1
    )
    out = second.generate(["Hi"], SamplingParams(max_tokens=2, ignore_eos=True))
    assert len(out[0].token_ids) == 2  # warmed up, serves
    assert second.engine.num_steps == 2  # the start's warm-up and idle check are not counted
    del second

    # an entry profiled under load (an idle step 10x the real one, as a machine busy installing
    # packages once wrote): the start measures the idle step, disbelieves it, profiles again
    # and replaces the entry, so the TPOT target follows this machine's real step
    for _ in range(3):  # as above: a profile the load changed during is not cached, try again
        files[0].write_text(json.dumps({"theta": marked, "idle_step_ms": idle_step * 10.0}))
        repaired = make_llm(slo_control=True)
        assert _prior(repaired)[0] != pytest.approx(marked[0])
        fresh = json.loads(files[0].read_text())
        if fresh["theta"] != marked:
            break
    assert fresh["idle_step_ms"] < idle_step * 10.0 / step_profile.IDLE_STEP_AGREEMENT
    assert fresh["theta"] == pytest.approx(_prior(repaired))
    tpot = repaired.engine.scheduler.step_budget.targets.interactive.tpot_ms
    assert tpot == pytest.approx(step_budget.TPOT_MULTIPLE * fresh["idle_step_ms"], abs=0.1)
    del repaired

    # other options are another key, so another file; a damaged entry, a version-1 or version-2
    # entry, or the switch off read as absent, and a start profiles afresh on an absent entry (the
    # first start above: `_checked_prior` reads through `read_cached_prior`), so no further start
    # is built for them
    assert other_key != key
    files[0].write_text("{broken")
    assert step_profile.read_cached_prior(key) is None
    files[0].write_text(json.dumps({"theta": marked}))  # a version-1 entry: no idle step
    assert step_profile.read_cached_prior(key) is None
    files[0].write_text(json.dumps({"theta": marked[:4], "idle_step_ms": 77.0}))  # version 2's
    assert step_profile.read_cached_prior(key) is None  # four coefficients: no prefill attention
    files[0].write_text(json.dumps({"theta": marked, "idle_step_ms": 77.0}))
    assert step_profile.read_cached_prior(key) == (marked, 77.0)
    monkeypatch.setenv("LANESERVE_STEP_COST_CACHE", "0")
    assert step_profile.read_cached_prior(key) is None


@pytest.mark.slow
def test_a_restarted_worker_takes_back_its_profile_untimed(
    base_llm, make_llm, tmp_path, monkeypatch
):
    """`laneserve up` restarts a killed worker mid-traffic: an idle check would disagree with
    any profile and profile again for seconds while the requeued lines wait (issue 52)."""
    monkeypatch.setenv("LANESERVE_STEP_COST_CACHE", "0")  # only the restart file can hold it
    kept = tmp_path / "run" / "worker-0.profile.json"
    monkeypatch.setenv("LANESERVE_RESTART_PROFILE", str(kept))
    # what the previous start kept: the key of an SLO-controlled engine of these options, and
    # an idle step 10x off, which the step-cost cache's check would throw away
    engine = base_llm.engine
    shim = _shim(engine, slo_control=True, max_num_seqs=5)
    theta = [123.0, 1.0, 2.0, 3.0, 0.0]
    key = step_profile.step_cost_cache_key(shim)
    kept.parent.mkdir()
    kept.write_text(json.dumps({"theta": theta, "idle_step_ms": 500.0, "key": key}))
    restarted = make_llm(slo_control=True, max_num_seqs=5)
    assert step_profile.step_cost_cache_key(restarted.engine) == key
    assert _prior(restarted) == pytest.approx(theta)  # taken as it is, nothing re-measured
    tpot = restarted.engine.scheduler.step_budget.targets.interactive.tpot_ms
    assert tpot == pytest.approx(step_budget.TPOT_MULTIPLE * 500.0, abs=0.1)
    out = restarted.generate(["Hi"], SamplingParams(max_tokens=2, ignore_eos=True))
    assert len(out[0].token_ids) == 2  # warmed up, serves
    assert json.loads(kept.read_text())["theta"] == theta
    # a file kept for other options (another key) is not taken: read as absent
    assert step_profile._read_prior(kept, "another-key") is None


def test_idle_steps_agree_within_the_stated_factor():
    f = step_profile.IDLE_STEP_AGREEMENT
    assert step_profile.steps_agree(7.0, 7.0 * f) and step_profile.steps_agree(7.0 * f, 7.0)
    assert not step_profile.steps_agree(7.0, 7.0 * f * 1.01)
    assert not step_profile.steps_agree(66.8, 7.0)  # the entry that set a 9x target
    assert step_profile.steps_agree(None, 7.0)  # nothing measured: nothing to disagree with


def test_two_measured_rounds_keep_each_steps_lesser_time():
    f = step_budget.StepFeatures
    a = [(f(8, 1, 8, 36), 9.0), (f(1, 1, 9, 0), 30.0), (f(1, 1, 10, 0), 6.0)]
    b = [(f(8, 1, 8, 36), 12.0), (f(1, 1, 9, 0), 6.5), (f(1, 1, 10, 0), 6.2)]
    # a sibling process loaded the second step of the first round: its time does not count
    assert step_profile.least_of_rounds(a, b) == [(a[0][0], 9.0), (a[1][0], 6.5), (a[2][0], 6.0)]
    # rounds that ran different steps (drafts verified in one) are both kept as they are
    c = [(f(2, 1, 9, 0), 7.0)]
    assert step_profile.least_of_rounds(a, c) == a + c
