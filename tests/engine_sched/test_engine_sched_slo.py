"""The step-cost model and the SLO budget controller on synthetic step-cost traces (no model).

A "true" cost function plays the machine: each simulated step's measured time is what it says
for the step's features (plus noise), fed back to the controller as the worker would. The
scheduler and block manager are the real ones (EngineSim from conftest.py).
"""

from __future__ import annotations

import argparse
import collections
import random
from typing import NamedTuple

import pytest

from gpu_worker.config import (
    EngineConfig,
    EngineConfigError,
    add_engine_arguments,
    config_from_args,
)
from gpu_worker.request import Lane
from gpu_worker.step_budget import (
    MIN_BATCH_CHUNK,
    BudgetController,
    LaneSlo,
    SloTargets,
    StepView,
    default_targets,
    parse_slo,
)
from gpu_worker.step_cost import StepCostModel, StepFeatures, fit_least_squares
from tests.engine_sched.conftest import EngineSim

TRUE = [4.0, 0.5, 0.3, 2.0]  # ms, ms/token, ms/row, ms/ktoken: a small CPU's shape


def true_ms(f: StepFeatures, scale: float = 1.0, rng: random.Random | None = None) -> float:
    ms = TRUE[0] + TRUE[1] * f.tokens + TRUE[2] * f.rows + TRUE[3] * f.context / 1000.0
    noise = 1.0 + (rng.uniform(-0.03, 0.03) if rng else 0.0)
    return scale * ms * noise


def random_features(rng: random.Random) -> StepFeatures:
    rows = rng.randint(1, 32)
    return StepFeatures(rows + rng.choice([0, 0, 16, 64, 200]), rows, rng.randint(100, 20_000))


# ------------------------------------------------------------------ the cost model


def test_least_squares_prior_recovers_the_cost_from_a_short_profile():
    rng = random.Random(0)
    profile = [random_features(rng) for _ in range(12)]
    theta = fit_least_squares([(f, true_ms(f)) for f in profile])
    assert theta == pytest.approx(TRUE, rel=0.02, abs=0.02)
    with pytest.raises(ValueError):
        fit_least_squares([])


def test_rls_converges_from_a_wrong_prior():
    rng = random.Random(1)
    model = StepCostModel([1.0, 0.1, 0.1, 0.1])
    for _ in range(300):
        f = random_features(rng)
        model.update(f, true_ms(f, rng=rng))
    assert model.coefficients == pytest.approx(TRUE, rel=0.15, abs=0.3)
    f = StepFeatures(100, 20, 8000)
    assert model.predict(f) == pytest.approx(true_ms(f), rel=0.05)


def test_rls_follows_a_cost_that_doubles_mid_run():
    rng = random.Random(2)
    model = StepCostModel(fit_least_squares([(f, true_ms(f)) for f in
                                             (random_features(rng) for _ in range(8))]))  # fmt: skip
    for _ in range(100):
        f = random_features(rng)
        model.update(f, true_ms(f, rng=rng))
    probe = StepFeatures(64, 16, 4000)
    assert model.predict(probe) == pytest.approx(true_ms(probe), rel=0.05)
    errors = []
    for _ in range(80):  # the machine is now twice as slow
        f = random_features(rng)
        errors.append(abs(model.predict(f) / true_ms(f, 2.0) - 1.0))
        model.update(f, true_ms(f, 2.0, rng=rng))
    assert errors[0] > 0.3  # the change is visible ...
    assert max(errors[-20:]) < 0.08  # ... and learnt within a few dozen steps
    assert model.predict(probe) == pytest.approx(true_ms(probe, 2.0), rel=0.05)


def test_identical_steps_do_not_wind_the_model_up():
    model = StepCostModel(TRUE)
    f = StepFeatures(1, 1, 100)
    for _ in range(5000):
        model.update(f, true_ms(f))
    assert sum(model.p[i][i] for i in range(4)) <= 4 * model.prior_variance + 1e-9
    g = StepFeatures(200, 8, 3000)  # a shape never seen in those 5000 steps
    assert model.predict(g) == pytest.approx(true_ms(g), rel=0.05)


# ------------------------------------------------------------------ targets


def test_parse_slo_and_its_errors():
    assert parse_slo("interactive:ttft=800,tpot=60 batch:tpot=400") == {
        "interactive": {"ttft": 800.0, "tpot": 60.0},
        "batch": {"tpot": 400.0},
    }
    assert parse_slo("interactive:tpot=50;batch:ttft=9000") == {
        "interactive": {"tpot": 50.0},
        "batch": {"ttft": 9000.0},
    }
    assert parse_slo(None) == {} and parse_slo("") == {}
    for bad in ("fast:ttft=1", "interactive", "interactive:ttft=-3", "interactive:p99=3",
                "interactive:ttft=x", "interactive:tpot=1 interactive:tpot=2"):  # fmt: skip
        with pytest.raises(ValueError):
            parse_slo(bad)


def test_default_targets_are_multiples_of_the_measured_idle_step():
    model = StepCostModel(TRUE)
    t = default_targets(model, {"batch": {"tpot": 999.0}})
    idle_step = model.predict(StepFeatures(1, 1, 256))
    idle_ttft = model.predict(StepFeatures(256, 1, 256))
    assert t.interactive.tpot_ms == pytest.approx(1.45 * idle_step, abs=0.1)
    assert t.interactive.ttft_ms == pytest.approx(1.8 * idle_ttft, abs=0.1)
    assert t.batch.tpot_ms == 999.0 and t.batch.ttft_ms > t.interactive.ttft_ms


def test_slo_flags_are_engine_options():
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(
        ["--slo", "interactive:ttft=800,tpot=60", "batch:tpot=400", "--no-slo-control"]
    )
    config = config_from_args(args)
    assert config.slo == "interactive:ttft=800,tpot=60 batch:tpot=400"
    assert config.slo_control is False
    assert EngineConfig.from_json(config.to_json()) == config
    with pytest.raises(SystemExit):
        parser.parse_args(["--slo", "interactive:ttft=zero"])
    with pytest.raises(EngineConfigError):
        EngineConfig(slo="batch:tpot=1 batch:tpot=2")


# ------------------------------------------------------------------ the controller


def _controlled(make_sched, model: StepCostModel, targets: SloTargets) -> EngineSim:
    sched = make_sched(num_blocks=4096, block_size=16, max_num_seqs=64,
                       max_num_batched_tokens=2048, interactive_batch_token_cap=512)  # fmt: skip
    sched.step_budget = BudgetController(targets, model, 2048, wall_clock=False)
    return EngineSim(sched)


class Trace(NamedTuple):
    steps: list[tuple[float, float | None, int]]  # (measured ms, target ms, batch tokens)
    ttft_ms: list[float]  # per finished interactive request, on the simulated clock
    tpot_ms: list[float]


def _run(sim: EngineSim, steps: int, scale: float, rng: random.Random, traffic: bool) -> Trace:
    """Steps with a saturating batch lane and (when `traffic`) a few interactive streams, on a
    simulated clock advanced by each step's true cost."""
    ctl = sim.sched.step_budget
    trace = Trace([], [], [])
    clock, arrival, times = 0.0, {}, collections.defaultdict(list)
    for k in range(steps):
        if len([r for r in sim.sched.requests.values() if r.lane is Lane.BATCH]) < 48:
            sim.add(f"b{rng.random()}", rng.randint(50, 400), max_tokens=rng.randint(20, 80))
        streams = [r for r in sim.sched.requests.values() if r.lane is Lane.INTERACTIVE]
        if traffic and len(streams) < 3 and k % 7 == 0:
            rid = f"i{rng.random()}"
            sim.add(rid, rng.randint(20, 200), lane="interactive", max_tokens=30)
            arrival[rid] = clock
        out = sim.step()
        f = sim.sched.last_features
        ms = true_ms(f, scale, rng)
        clock += ms
        target = ctl.last_target_ms
        ctl.observe(f, ms, target)
        batch = sum(e.num_new_tokens for e in out.scheduled if e.request.lane is Lane.BATCH)
        trace.steps.append((ms, target, batch))
        for e in out.scheduled:
            if e.samples and e.request.lane is Lane.INTERACTIVE:
                times[e.request.request_id].append(clock)
    for rid, t in times.items():
        if len(t) == 30:  # finished
            trace.ttft_ms.append(t[0] - arrival[rid])
            trace.tpot_ms.append((t[-1] - t[0]) / 29)
    return trace


def _p99(values: list[float]) -> float:
    return sorted(values)[min(len(values) - 1, int(0.99 * len(values)))]


def _batch_share(trace: Trace) -> float:
    """Mean batch tokens of the steps paced by interactive streams."""
    paced = [b for _, target, b in trace.steps if target is not None and target <= 40.0]
    return sum(paced) / len(paced)


def test_budget_keeps_interactive_within_targets_and_batch_busy(make_sched):
    rng = random.Random(3)
    model = StepCostModel(TRUE)  # the model is right
    targets = SloTargets(LaneSlo(ttft_ms=400.0, tpot_ms=40.0), LaneSlo(10_000.0, 400.0))
    sim = _controlled(make_sched, model, targets)
    trace = _run(sim, 600, 1.0, rng, traffic=True)
    assert len(trace.tpot_ms) >= 10
    assert _p99(trace.tpot_ms) <= 40.0 and _p99(trace.ttft_ms) <= 400.0
    assert _batch_share(trace) > 5  # batch rides along


def test_budget_adapts_when_the_step_cost_doubles(make_sched):
    rng = random.Random(4)
    model = StepCostModel(TRUE)
    targets = SloTargets(LaneSlo(ttft_ms=400.0, tpot_ms=40.0), LaneSlo(10_000.0, 400.0))
    sim = _controlled(make_sched, model, targets)
    before = _run(sim, 300, 1.0, rng, traffic=True)
    after = _run(sim, 600, 2.0, rng, traffic=True)  # the machine is now twice as slow
    assert len(after.tpot_ms) >= 10
    late = after.tpot_ms[3:]  # streams that started after the change was learnt
    assert _p99(late) <= 40.0, after.tpot_ms
    assert _batch_share(after) < 0.75 * _batch_share(before)  # less batch per step at 2x
    assert model.coefficients[1] == pytest.approx(2 * TRUE[1], rel=0.25)


def test_without_interactive_traffic_batch_steps_grow_within_the_ttft_slack(make_sched):
    rng = random.Random(5)
    model = StepCostModel(TRUE)
    targets = SloTargets(LaneSlo(ttft_ms=600.0, tpot_ms=40.0), LaneSlo(10_000.0, 400.0))
    sim = _controlled(make_sched, model, targets)
    trace = _run(sim, 150, 1.0, rng, traffic=False)
    steps = [ms for ms, _, _ in trace.steps[20:]]
    slack = 600.0 - model.predict(StepFeatures(256, 1, 256))
    assert max(steps) <= slack  # an interactive arrival still meets its TTFT
    assert sum(steps) / len(steps) > 3 * 40.0  # far longer than an interactive-paced step
    view = StepView(0, 48, 10_000, 0)
    assert sim.sched.step_budget.plan(view).batch_tokens is None


def test_batch_decodes_never_crowd_prefill_out(make_sched):
    """Without interactive traffic, 64 batch decodes over long contexts are predicted over the
    TTFT slack on their own: the budget still holds them plus the prefill chunk that alone
    fits the slack, so new prompts keep entering (a bulk job ran at a fifth of its throughput
    when the budget was the decodes alone)."""
    model = StepCostModel(TRUE)
    targets = SloTargets(LaneSlo(ttft_ms=300.0, tpot_ms=40.0), LaneSlo(10_000.0, 400.0))
    ctl = _controlled(make_sched, model, targets).sched.step_budget
    slack = 300.0 - model.predict(StepFeatures(256, 1, 256))
    assert model.predict(StepFeatures(64, 64, 64 * 1500)) > slack
    chunk = model.max_tokens_within(slack, 0, 0)
    assert chunk > 64 and ctl.max_tokens >= 64 + chunk
    assert ctl.plan(StepView(0, 64, 64 * 1500, 0)).token_budget == 64 + chunk
    # few short decodes: the same rule; the step exceeds the slack by the decodes' own cost only
    plan = ctl.plan(StepView(0, 2, 200, 0))
    assert plan.token_budget == 2 + chunk
    over = model.predict(StepFeatures(plan.token_budget, 2, 200)) - slack
    assert 0 <= over <= model.predict(StepFeatures(2, 2, 200)) - model.predict(StepFeatures(0, 0, 0))
    # a model that prices tokens dearly still leaves MIN_BATCH_CHUNK prefill tokens (and so keeps
    # seeing steps of real size to correct itself)
    dear = _controlled(make_sched, StepCostModel([4.0, 20.0, 0.3, 2.0]), targets).sched.step_budget
    assert dear.plan(StepView(0, 3, 300, 0)).token_budget == 3 + MIN_BATCH_CHUNK


def test_attainment_counts_finished_requests_per_lane(make_sched):
    model = StepCostModel(TRUE)
    targets = SloTargets(LaneSlo(ttft_ms=1e6, tpot_ms=1e6), LaneSlo(1e-6, 1e-6))
    sim = _controlled(make_sched, model, targets)
    sim.add("i", 10, lane="interactive", max_tokens=3)
    sim.add("b", 10, max_tokens=3)
    sim.run()
    stats = sim.sched.stats()
    assert stats["slo_interactive_attainment"] == 1.0  # generous targets: met
    assert stats["slo_batch_attainment"] == 0.0  # impossible targets: missed
    assert stats["slo_interactive_tpot_ms"] == 1e6 and stats["step_token_budget"] >= 1
