"""The step-cost model and the SLO budget controller on synthetic step-cost traces (no model).

A "true" cost function plays the machine: each simulated step's measured time is what it says
for the step's features (plus noise), fed back to the controller as the worker would. The
scheduler and block manager are the real ones (EngineSim from conftest.py).
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import statistics
from typing import NamedTuple

import pytest

from laneserve.gpu_worker.config import (
    EngineConfig,
    EngineConfigError,
    add_engine_arguments,
    config_from_args,
)
from laneserve.gpu_worker.request import Lane
from laneserve.gpu_worker.scheduler import step_features
from laneserve.gpu_worker.slo import LaneSlo, SloTargets, parse_slo
from laneserve.gpu_worker.step_budget import (
    MIN_BATCH_RATE,
    MIN_PREFILL_CHUNK,
    RETARGET_STEPS,
    TPOT_MULTIPLE,
    BudgetController,
    StepBudget,
    StepView,
    default_targets,
    prefill_features,
)
from laneserve.gpu_worker.step_cost import (
    StepCostModel,
    StepFeatures,
    chunk_pairs,
    fit_least_squares,
    parts_pairs,
)
from tests.engine_sched.conftest import EngineSim

TRUE = [4.0, 0.5, 0.3, 2.0, 0.6]  # ms, ms/token, ms/row, ms/ktoken, ms/kpair: a small CPU's


def true_ms(f: StepFeatures, scale: float = 1.0, rng: random.Random | None = None) -> float:
    ms = TRUE[0] + TRUE[1] * f.tokens + TRUE[2] * f.rows + TRUE[3] * f.context / 1000.0
    ms += TRUE[4] * f.prefill_pairs / 1000.0
    noise = 1.0 + (rng.uniform(-0.03, 0.03) if rng else 0.0)
    return scale * ms * noise


def random_features(rng: random.Random) -> StepFeatures:
    rows = rng.randint(1, 32)
    chunk, depth = rng.choice([0, 0, 16, 64, 200]), rng.choice([0, 100, 700])
    pairs = chunk_pairs(chunk, depth) if chunk else 0
    return StepFeatures(rows + chunk, rows, rng.randint(100, 20_000), pairs)


# ------------------------------------------------------------------ the cost model


def test_least_squares_prior_recovers_the_cost_from_a_short_profile():
    rng = random.Random(0)
    profile = [random_features(rng) for _ in range(16)]
    theta = fit_least_squares([(f, true_ms(f)) for f in profile])
    assert theta == pytest.approx(TRUE, rel=0.02, abs=0.02)
    with pytest.raises(ValueError):
        fit_least_squares([])


def test_fit_converges_from_a_wrong_prior():
    rng = random.Random(1)
    model = StepCostModel([1.0, 0.1, 0.1, 0.1, 0.1])
    for _ in range(300):
        f = random_features(rng)
        model.update(f, true_ms(f, rng=rng))
    # the fixed cost is the one the noise hides (3 % of a 20-200 ms step is 0.6-6 ms)
    assert model.coefficients[0] == pytest.approx(TRUE[0], abs=2.0)
    assert model.coefficients[1:] == pytest.approx(TRUE[1:], rel=0.15, abs=0.3)
    f = StepFeatures(100, 20, 8000)
    assert model.predict(f) == pytest.approx(true_ms(f), rel=0.05)


def test_fit_follows_a_cost_that_doubles_mid_run():
    rng = random.Random(2)
    profile = [random_features(rng) for _ in range(8)]
    model = StepCostModel(fit_least_squares([(f, true_ms(f)) for f in profile]))
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
    """5000 identical steps determine one direction; the others stay the prior's, so a shape
    never seen is still predicted right."""
    model = StepCostModel(TRUE)
    f = StepFeatures(1, 1, 100)
    for _ in range(5000):
        model.update(f, true_ms(f))
    assert model.predict(f) == pytest.approx(true_ms(f), rel=1e-3)
    g = StepFeatures(200, 8, 3000)  # a shape never seen in those 5000 steps
    assert model.predict(g) == pytest.approx(true_ms(g), rel=0.05)


def test_what_the_steps_leave_undetermined_follows_the_prior_scaled():
    """A machine twice as slow that runs only decode steps (tokens = rows, no prefill): the
    prefill's cost is never seen, so it is the prior's shape scaled to the steps seen (2x), not
    the start-up speed and not whatever the decode steps' noise makes of it."""
    rng = random.Random(8)
    model = StepCostModel(TRUE)
    for _ in range(200):
        rows = rng.randint(1, 32)
        f = StepFeatures(rows, rows, rows * rng.randint(100, 1000))
        model.update(f, true_ms(f, 2.0, rng))
    assert model.prior_scale == pytest.approx(2.0, rel=0.05)
    prefill = prefill_features(256)
    assert model.predict(prefill) == pytest.approx(true_ms(prefill, 2.0), rel=0.15)


def test_a_chunk_across_prompts_is_priced_by_their_own_attention(make_sched):
    """A batch chunk may span several prompts: its attention and context read are each
    prompt's own, from its own depth, in the order a step takes them (`parts_pairs` over
    `StepView.batch_prefill_parts`, which the scheduler reports: running prefills, then the
    waiting prompts a free seat could take), so a plan fits more tokens than it would as one
    prompt into a step where attention weighs, and the step the scheduler then builds is
    predicted within that plan (the controller's `_batch_only`)."""
    assert parts_pairs(900, ((0, 300),) * 3) == (3 * chunk_pairs(300, 0), 900)
    mixed = ((40, 260), (0, 300), (0, 300))  # a prefill 40 in, then fresh prompts
    both = chunk_pairs(260, 40) + chunk_pairs(300, 0) + chunk_pairs(90, 0)
    assert parts_pairs(650, mixed) == (both, 40 + 650)
    assert parts_pairs(250, mixed) == (chunk_pairs(250, 40), 290)
    assert parts_pairs(400, ((0, 300),)) == (chunk_pairs(400, 0), 400)  # past the last: it goes on
    model = StepCostModel([*TRUE[:4], 0.6])  # attention weighs
    one, across = model.chunk_within(400.0, 0), model.chunk_within(400.0, 0, ((0, 300),) * 20)
    assert across > 1.1 * one
    targets = SloTargets(LaneSlo(ttft_ms=300.0, tpot_ms=40.0), LaneSlo(10_000.0, 400.0))
    ctl = BudgetController(targets, model, 8192, wall_clock=False, given_ttft=True)
    ctl.interleave_pieces = 30
    view = StepView(0, 8, 8 * 300, 0, batch_context=8 * 300, batch_prefill_tokens=20 * 300,
                    batch_decodes=8, batch_prefill_parts=((0, 300),) * 20)  # fmt: skip
    plan = ctl.plan(view)
    chunk = plan.token_budget - 8
    assert chunk > 300  # several prompts in one step
    # the features of a step that prefills `chunk` tokens of whole 300-token prompts
    full, rest = divmod(chunk, 300)
    pairs = full * chunk_pairs(300, 0) + chunk_pairs(rest, 0)
    step = StepFeatures(8 + chunk, 8 + full, 8 * 301 + chunk, pairs)
    assert model.predict(step) <= ctl.last_target_ms * 1.05
    blind = ctl.plan(view._replace(batch_prefill_parts=()))  # one prompt's attention
    assert blind.token_budget < 0.9 * plan.token_budget
    # a deep running prefill is priced at its depth, the fresh prompts after it at theirs: had
    # they all been as deep, the plan would take a far shorter chunk
    deep = view._replace(batch_prefill_parts=((600, 100),) + ((0, 300),) * 19)
    bound = view._replace(batch_prefill_parts=((600, 300),) * 20)
    assert ctl.plan(deep).token_budget > 1.2 * ctl.plan(bound).token_budget
    # what the scheduler reports: a running prefill part-way in, then waiting prompts
    sched = make_sched(num_blocks=512, block_size=16, max_num_seqs=4, max_num_batched_tokens=64)
    sim = EngineSim(sched)
    sim.add("a", 100, lane="batch", max_tokens=2)
    sim.step()
    for rid in ("b", "c", "d", "e"):
        sim.add(rid, 50, lane="batch", max_tokens=2)
    got = sched._step_view()
    # (free seats for three, but past a step's 64 tokens no more are counted)
    assert got.batch_prefill_parts == ((64, 36), (0, 50))
    assert got.batch_prefill_tokens == 36 + 50
    out = sched.schedule()  # the step takes them in that order: its pairs are the parts'
    assert step_features(out).prefill_pairs == parts_pairs(64, got.batch_prefill_parts)[0]
    assert step_features(out).prefill_pairs == chunk_pairs(36, 64) + chunk_pairs(28, 0)


SPANS = ((120, 180), (0, 40), (900, 20), (0, 300))  # shallow, short, deep, fresh
DEEP_LATER = ((0, 10), (5000, 1000))  # the one-prompt guess from depth 0 overshoots


def test_the_longest_chunk_within_a_time_is_exact():
    """`chunk_within` against counting: the longest chunk whose tokens, context read and
    attention fit, at depths 0 and 700 and across prompts (deeper ones later too, past the
    one-prompt guess), including a vanishing attention coefficient (where the textbook root
    loses every digit)."""
    for pairs_ms in (0.6, 1e-9, 1e-15, 0.0):
        model = StepCostModel([*TRUE[:4], pairs_ms])
        for ms in (0.3, 7.0, 60.0, 150.0):
            cases = ((0, ()), (700, ()), (0, ((0, 300),) * 9), (0, SPANS), (0, DEEP_LATER))
            for depth, parts in cases:
                n = model.chunk_within(ms, depth, parts)
                assert model.chunk_cost(n, depth, parts) <= ms or n == 0
                assert model.chunk_cost(n + 1, depth, parts) > ms
    model = StepCostModel(TRUE)
    assert model.max_tokens_within(50.0, 4, 4000, 700) == model.chunk_within(
        50.0 - model.predict(StepFeatures(4, 4, 4000)), 700
    )
    # its parts are the model's own prediction of a step that only prefills that chunk
    for n, depth in ((32, 700), (200, 0)):
        alone = StepFeatures(n, 0, depth + n, chunk_pairs(n, depth))
        assert model.chunk_cost(n, depth) == pytest.approx(
            model.predict(alone) - model.predict(StepFeatures(0, 0, 0))
        )
    for bad in ({"prior_weight": 0.0}, {"reset_keep": 0.0}, {"reset_keep": 1.5}):
        with pytest.raises(ValueError):
            StepCostModel(TRUE, **bad)
    # measured times the prior's shape cannot fit with a positive scale: it stays positive
    odd = StepCostModel(TRUE)
    for _ in range(5):
        odd.update(StepFeatures(8, 8, 800), -1.0)
    assert odd.prior_scale > 0.0


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
    idle_ttft = model.predict(prefill_features(256))
    assert t.interactive.tpot_ms == pytest.approx(TPOT_MULTIPLE * idle_step, abs=0.1)
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
    sched.step_budget = BudgetController(targets, model, 2048, wall_clock=False, given_ttft=True)
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
    # streams that started after the change was learnt: the cost model relearns within tens of
    # steps, the headroom (a mean over 64-step windows) within a few windows
    late = after.tpot_ms[8:]
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
    slack = 600.0 - model.predict(prefill_features(256))
    assert max(steps) <= slack  # an interactive arrival still meets its TTFT
    assert sum(steps) / len(steps) > 3 * 40.0  # far longer than an interactive-paced step
    view = StepView(0, 48, 10_000, 0)
    assert sim.sched.step_budget.plan(view).batch_tokens is None


def test_a_worker_serving_no_interactive_lane_plans_whole_budget_batch_steps():
    """A batch-only worker expects no interactive arrival: prefill-only work (a batch file of
    200-token embeddings) gets the whole token budget a step, not the TTFT slack that held such
    a file to one document a step, and the step carries no target to miss; a worker serving
    both lanes keeps the slack."""
    model = StepCostModel(TRUE)
    targets = SloTargets(LaneSlo(ttft_ms=300.0, tpot_ms=40.0), LaneSlo(10_000.0, 400.0))
    view = StepView(0, 1, 0, 0, batch_context=50, batch_prefill_tokens=40 * 200,
                    batch_prefill_depth=50)  # fmt: skip
    both = BudgetController(targets, model, 2048, wall_clock=False, given_ttft=True)
    alone = BudgetController(
        targets, model, 2048, wall_clock=False, given_ttft=True, serves_interactive=False
    )
    slack_plan, whole = both.plan(view), alone.plan(view)
    assert slack_plan.reason == "batch-alone" and slack_plan.token_budget < 2048 // 4
    assert whole == StepBudget(2048, None, None, None, "batch-worker")
    assert alone.last_target_ms is None and not alone.last_paced
    interactive = StepView(0, 1, 0, 300, batch_prefill_tokens=8000)  # one arrived all the same
    assert alone.plan(interactive).reason == "prompt"


def test_interleaving_sizes_batch_only_steps_for_a_wait_of_one_layer(tmp_path, monkeypatch):
    """Where the worker runs interactive steps between a batch-only step's layers
    (gpu_worker/interleave.py), an arrival waits for one of `interleave_pieces` and a stream it
    starts decodes once a piece: the step's target is the pieces times a piece of at most the
    TTFT slack and the TPOT target less a lone decode, so the same view gets a far larger
    budget, bounded by the fixed knob; interleaved steps' time is not the step in flight's,
    they teach the cost model and are traced, and they count for no headroom window."""
    model = StepCostModel(TRUE)
    targets = SloTargets(LaneSlo(ttft_ms=300.0, tpot_ms=40.0), LaneSlo(10_000.0, 400.0))
    view = StepView(0, 48, 48 * 300, 0, batch_context=48 * 300, batch_prefill_tokens=16 * 300,
                    batch_decodes=32, batch_prefill_depth=100)  # fmt: skip
    whole = BudgetController(targets, model, 4096, wall_clock=False, given_ttft=True)
    cut = BudgetController(targets, model, 4096, wall_clock=False, given_ttft=True)
    cut.interleave_pieces = 30
    one, thirty = whole.plan(view), cut.plan(view)
    assert one.reason == thirty.reason == "batch-alone"
    slack = whole.ttft_slack()
    assert whole.last_target_ms == pytest.approx(max(40.0, slack))
    # a piece: at most the slack, and the TPOT target less a lone decode (a stream started
    # inside the step decodes once a piece), at least half the target
    decode = model.predict(StepFeatures(1, 1, 256))
    piece = min(slack, max(40.0 - decode, 20.0))
    assert cut.last_target_ms == pytest.approx(30 * piece)
    tight = BudgetController(targets, model, 4096, wall_clock=False, given_ttft=True)
    tight.interleave_pieces = 30
    tight.targets = SloTargets(LaneSlo(ttft_ms=model.predict(prefill_features(256)) + 5.0,
                                       tpot_ms=40.0), targets.batch)  # fmt: skip
    tight.plan(view)
    assert tight.last_target_ms == pytest.approx(30 * 5.0)  # the slack, when it is the lesser
    assert thirty.token_budget > 3 * one.token_budget
    # a step planned under the rows that split its gate/up runs them whole: its pieces are
    # the longer ones, and its target their count
    short = BudgetController(targets, model, 4096, wall_clock=False, given_ttft=True)
    short.interleave_pieces, short.interleave_pieces_short = 30, 20
    short.interleave_split_rows = thirty.token_budget + 1
    assert short.plan(view).token_budget < thirty.token_budget
    assert short.last_target_ms == pytest.approx(20 * piece)
    short.interleave_split_rows = thirty.token_budget
    assert short.plan(view).token_budget == thirty.token_budget
    # an interleaved step: a prompt alone gets the whole budget; beside a running stream its
    # chunk fits half the TTFT target, as in a regular step
    assert cut.interleaved_budget(StepView(0, 48, 0, 2000)) == 4096
    beside = StepView(1, 48, 300, 2000)
    chunk = model.max_tokens_within(150.0, 1, 300, 0)
    assert 32 <= chunk < 1999 and cut.interleaved_budget(beside) == 1 + chunk
    huge = BudgetController(targets, model, 512, wall_clock=False, given_ttft=True)
    huge.interleave_pieces = 30
    assert huge.plan(view).token_budget == 512  # the fixed knob still bounds it
    # the step in flight's measured time leaves out the interleaved steps run inside it, and
    # an interleaved step is learnt from and traced like any other
    path = tmp_path / "trace.jsonl"
    monkeypatch.setenv("LANESERVE_STEP_TRACE", str(path))
    clocked = BudgetController(targets, model, 4096, given_ttft=True)
    clocked.plan(view)
    features = StepFeatures(200, 40, 12_000, 10_000)
    clocked.on_scheduled(features)
    clocked.note_interleaved(0.05)
    clocked.on_step_done()
    start = clocked._pending[1]
    clocked._pending = (features, start - 0.3, *clocked._pending[2:])  # it ran 300 ms
    clocked._last_update = start
    before = clocked._num_observed
    clocked.observe_pending(start)
    assert clocked._num_observed == before + 1
    assert clocked.measured_ms == pytest.approx(250.0, abs=1.0)
    lone = StepFeatures(1, 1, 300)
    coefficients = list(model.coefficients)
    clocked.observe_interleaved(start, StepView(1, 48, 300, 0), lone, 12.5)
    assert clocked._num_observed == before + 1 and clocked.measured_ms == pytest.approx(
        250.0, abs=1.0
    )
    assert list(model.coefficients) != coefficients  # learnt from
    clocked._trace.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["plan"]["reason"] for r in lines] == ["batch-alone", "interleaved"]
    assert lines[1]["features"] == lone._asdict() and lines[1]["measured_ms"] == 12.5
    assert lines[1]["view"]["interactive_running"] == 1 and lines[1]["target_ms"] is None


def test_batch_only_steps_follow_what_they_measure_not_a_model_that_swings():
    """A cost model that predicts batch-only steps twice as long as they run (its online fit
    swung: steps all planned to one target leave its fixed cost and per-token cost apart
    undetermined) would plan half-size steps for ever, the headroom (at most 1) never making up
    for it: the plan divides its target by the measured / predicted time of the last batch-only
    steps of its kind (with a prefill chunk or decode-only) over what the model predicts for them
    now (`alone_calibration`), within 0.5-2; min-chunk plans count too (a calibration they could
    not move once held prefill at 32-token chunks)."""
    model = StepCostModel(TRUE)
    targets = SloTargets(LaneSlo(ttft_ms=600.0, tpot_ms=40.0), LaneSlo(10_000.0, 400.0))
    ctl = BudgetController(targets, model, 4096, wall_clock=False, given_ttft=True)
    view = StepView(0, 32, 32 * 300, 0, batch_context=32 * 300, batch_prefill_tokens=8000,
                    batch_decodes=32, batch_prefill_depth=100)  # fmt: skip
    first = ctl.plan(view)
    assert ctl.alone_calibration(True) == 1.0
    for _ in range(8):  # steps measured at half what the model predicted for them
        f = StepFeatures(first.token_budget, 32, 32 * 300, 20_000)
        predicted = model.predict(f)
        ctl.observe(f, 0.5 * predicted, ctl.last_target_ms, predicted, False)
    # the fit moves a little towards them; the calibration takes the rest of the bias
    steps = list(ctl._alone_steps[True])
    now = statistics.median(ms / model.predict(f) for f, ms in steps)
    assert ctl.alone_calibration(True) == pytest.approx(now) and 0.5 <= now < 0.9
    assert ctl.alone_calibration(False) == 1.0  # decode-only steps are calibrated apart
    f = StepFeatures(first.token_budget, 32, 32 * 300, 20_000)
    later = ctl.plan(view)
    assert later.reason == "batch-alone" and later.token_budget > 1.4 * first.token_budget
    # a min-chunk plan (no target) counts too
    n = len(ctl._alone_steps[True])
    ctl.observe(f, 0.5 * model.predict(f), None, model.predict(f), False, alone=True)
    assert len(ctl._alone_steps[True]) == min(n + 1, 16)
    for _ in range(16):  # and back when they run as long as predicted
        f = StepFeatures(later.token_budget, 32, 32 * 300, 20_000)
        predicted = model.predict(f)
        ctl.observe(f, predicted, ctl.last_target_ms, predicted, False)
    assert ctl.alone_calibration(True) > max(0.8, now)
    kept = list(ctl._alone_steps[True])
    for _ in range(8):  # decode-only steps: filed under their own kind only
        f = StepFeatures(32, 32, 32 * 300)
        ctl.observe(f, 2.0 * model.predict(f), ctl.last_target_ms, model.predict(f), False)
    assert list(ctl._alone_steps[True]) == kept and len(ctl._alone_steps[False]) == 8
    # and each plan divides by its own kind's: decode-only steps measured at half their
    # prediction stretch a decode-only plan and leave a prefill plan as a fresh controller's
    fresh = BudgetController(targets, model, 4096, wall_clock=False, given_ttft=True)
    decodes = view._replace(batch_running=400, batch_decodes=400, batch_context=400 * 300,
                            batch_prefill_tokens=0, batch_prefill_depth=0)  # fmt: skip
    ctl._alone_steps[True].clear()
    ctl._alone_steps[False].clear()
    for _ in range(8):
        f = StepFeatures(200, 200, 200 * 300)
        ctl._alone_steps[False].append((f, 0.5 * model.predict(f)))
    assert ctl.alone_calibration(False) == 0.5 and ctl.alone_calibration(True) == 1.0
    assert ctl.plan(view) == fresh.plan(view)
    assert ctl.plan(decodes).token_budget > 1.5 * fresh.plan(decodes).token_budget


def test_batch_decodes_never_crowd_prefill_out(make_sched):
    """Without interactive traffic, 64 batch decodes over long contexts are predicted over the
    TTFT slack on their own: the step takes as many of them as fit half the slack (rotating the
    rest) and a prefill chunk that fits the other half, so new prompts keep entering (a bulk
    job ran at a fifth of its throughput when decodes took the whole budget) and the step stays
    within the slack (it once held every decode plus a chunk: ~450 ms steps on a 2-core AVX2
    CPU, which an interactive arrival waited for)."""
    model = StepCostModel(TRUE)
    targets = SloTargets(LaneSlo(ttft_ms=300.0, tpot_ms=40.0), LaneSlo(10_000.0, 400.0))
    sim = _controlled(make_sched, model, targets)
    ctl = sim.sched.step_budget
    slack = 300.0 - model.predict(prefill_features(256))
    assert model.predict(StepFeatures(64, 64, 64 * 1500)) > slack
    view = StepView(0, 64, 0, 0, batch_context=64 * 1500, batch_prefill_tokens=5000,
                    batch_decodes=64)  # fmt: skip
    plan = ctl.plan(view)
    rows = plan.batch_decode_rows
    chunk = plan.token_budget - rows
    assert 1 <= rows < 64 and chunk >= MIN_PREFILL_CHUNK
    decodes_ms = model.predict(StepFeatures(rows, rows, rows * 1500)) - TRUE[0]
    assert decodes_ms == pytest.approx(0.5 * (slack - TRUE[0]), rel=0.1)  # half for decodes
    pairs = chunk_pairs(chunk, 0)  # the chunk's attention (a new prompt's)
    predicted = model.predict(StepFeatures(plan.token_budget, rows, rows * 1500, pairs))
    assert predicted == pytest.approx(slack, rel=0.05) and ctl.last_target_ms is not None
    # few decodes running: the prefill chunk takes what they leave
    few = ctl.plan(view._replace(batch_decodes=2, batch_context=2 * 1500))
    assert few.batch_decode_rows == 2
    pairs = chunk_pairs(few.token_budget - 2, 0)
    predicted = model.predict(StepFeatures(few.token_budget, 2, 2 * 1500, pairs))
    assert predicted == pytest.approx(slack, rel=0.05)
    # nothing to prefill: decodes take the whole slack
    only = ctl.plan(view._replace(batch_prefill_tokens=0))
    assert only.batch_decode_rows > rows and only.token_budget == only.batch_decode_rows
    # a chunk deep into its prompt costs its attention too: shorter, and the step still fits
    deep = ctl.plan(view._replace(batch_prefill_depth=700))
    assert deep.batch_decode_rows == rows and deep.token_budget - rows < chunk
    pairs = chunk_pairs(deep.token_budget - rows, 700)
    ctx = rows * 1500 + 700 + deep.token_budget - rows
    predicted = model.predict(StepFeatures(deep.token_budget, rows, ctx, pairs))
    assert predicted == pytest.approx(slack, rel=0.05)
    # a model that prices tokens dearly still leaves MIN_PREFILL_CHUNK prefill tokens (and so keeps
    # seeing steps of real size to correct itself)
    dear = _controlled(
        make_sched, StepCostModel([4.0, 20.0, 0.3, 2.0, 0.6]), targets
    ).sched.step_budget
    plan = dear.plan(StepView(0, 3, 0, 0, 300, batch_prefill_tokens=500, batch_decodes=3))
    assert plan.token_budget - plan.batch_decode_rows == MIN_PREFILL_CHUNK

    # on the real scheduler: 48 long batch requests decoding (over the slack together) and more
    # waiting, with seats free; every step stays near the slack, every running request decodes
    # within a few steps, new prompts get in
    assert model.predict(StepFeatures(48, 48, 48 * 2000)) > slack
    for i in range(48):
        sim.add(f"run{i}", 2000, max_tokens=2000, token=7)  # one prompt: cached prefill
    while any(r.num_output_tokens == 0 for r in sim.sched.running) or sim.sched.waiting:
        sim.step()
    for i in range(20):
        sim.add(f"new{i}", 200, max_tokens=5)
    last = {r.request_id: 0 for r in sim.sched.running}
    gaps, admitted = [], 0
    for k in range(1, 41):
        out = sim.step()
        f = sim.sched.last_features
        # planned from the running batch's mean context (the rows it rotates through differ)
        assert model.predict(f) <= 1.25 * slack, f
        for e in out.scheduled:
            rid = e.request.request_id
            if rid in last:
                gaps.append(k - last[rid])
                last[rid] = k
            admitted += rid.startswith("new") and e.num_computed_tokens == 0
    assert len(last) == 48 and all(last.values())  # every running request decoded
    assert max(gaps) <= 6  # round robin: nobody is skipped for long
    assert admitted >= 1


def test_deep_prefill_chunks_leave_a_batch_decode_row_priced_right(make_sched):
    """Batch-only steps of a bulk job with long prompts (docs/benchmarks.md Run 12): a
    32-token chunk deep into a 400-700-token prompt beside a few decodes. The chunk's attention
    grows with its length x depth; the `prefill_pairs` feature carries it, so these steps are
    predicted within their noise, a batch decode row is priced as it costs, and the steps keep
    decoding rows. The same steps seen without it (the four-feature model of before) are
    predicted worse: the attention lands on the context read and the fixed cost."""
    rng = random.Random(7)
    prior = [*TRUE[:4], TRUE[4] / 3]  # the start-up profile saw only shallow prefills
    model, blind = StepCostModel(prior), StepCostModel(prior)
    slack = 0.8 * model.predict(prefill_features(256))
    targets = SloTargets(LaneSlo(ttft_ms=1.8 * slack / 0.8, tpot_ms=20.0), LaneSlo(1e4, 400.0))
    sim = _controlled(make_sched, model, targets)
    ctl = sim.sched.step_budget
    assert ctl.ttft_slack() == pytest.approx(slack)
    rows, deep, errors, blind_errors = [], 0, [], []
    for k in range(300):
        while len(sim.sched.requests) < 32:
            sim.add(f"b{k}-{rng.random()}", rng.randint(400, 700), max_tokens=rng.randint(20, 60))
        out = sim.step()
        f = sim.sched.last_features
        ms = true_ms(f, 1.0, rng)
        seen = f._replace(prefill_pairs=0)
        if k >= 200:
            rows.append(sum(e.num_new_tokens == 1 for e in out.scheduled))
            errors.append(abs(model.predict(f) / ms - 1.0))
            blind_errors.append(abs(blind.predict(seen) / ms - 1.0))
        ctl.observe(f, ms, ctl.last_target_ms)
        blind.update(seen, ms)
        deep += any(e.num_computed_tokens >= 300 and e.num_new_tokens > 1 for e in out.scheduled)
    assert deep >= 100  # the situation: chunks deep into their prompts, most steps
    assert statistics.fmean(errors) < 0.04  # the noise is 3 % at most
    # (1.4x, not more: from a wrong prior the model's own early errors are larger too, and
    # steps priced by their own prompts' attention come out near one size, which leaves the
    # fixed and per-token costs less determined for both fits: 1.55x here, 3.5x before)
    assert statistics.fmean(blind_errors) > 1.4 * statistics.fmean(errors)
    assert model.coefficients[4] == pytest.approx(TRUE[4], rel=0.2)  # learnt from the steps
    chunk = StepFeatures(32, 0, 732, chunk_pairs(32, 700))
    assert model.predict(chunk) == pytest.approx(true_ms(chunk), rel=0.1)
    view = ctl._view
    ctx = view.batch_context / view.batch_running / 1000.0  # an average row's, in ktokens
    true_row = TRUE[1] + TRUE[2] + TRUE[3] * ctx
    assert ctl._batch_row_ms(view) == pytest.approx(true_row, rel=0.3)
    # the plan's decode rows: half the slack's room at the true price of a row (at least 1)
    expected = min(view.batch_decodes, int(0.5 * (0.8 * slack - TRUE[0]) / true_row))
    assert statistics.median(rows) >= 0.7 * expected >= 3


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


def test_ttft_slack_is_planned_for_a_robust_prompt_not_the_last_few(make_sched):
    """With a derived TTFT target a batch-only step's slack is 0.8x the prefill of a robust
    interactive prompt: the 90th percentile of the recent ones, never below 256 tokens. One-token
    chats ("Hi") never shrink it (a running mean once cut a bulk job's steps to 1-4 tokens after
    one), a few odd long prompts never stretch it, and prompts that are really long do. An
    operator's target is met as stated."""
    model = StepCostModel(TRUE)
    derived = default_targets(model, {})
    ctl = BudgetController(derived, model, 2048, wall_clock=False)
    prefill = lambda p: model.predict(prefill_features(p))  # noqa: E731
    view = StepView(0, 8, 0, 0, 8 * 500, batch_prefill_tokens=900, batch_decodes=8)
    assert ctl.robust_prompt() == 256
    assert ctl.ttft_slack() == pytest.approx(0.8 * prefill(256), rel=1e-6)
    alone = ctl.plan(view)
    assert alone.reason == "batch-alone" and alone.token_budget >= 8
    sched = make_sched(num_blocks=2048, block_size=16, max_num_seqs=8)
    sched.step_budget = ctl
    sim = EngineSim(sched)
    sim.add("hi", 4, lane="interactive", max_tokens=1)  # one tiny chat ...
    sim.run()
    assert ctl.robust_prompt() == 256  # ... changes nothing
    assert ctl.plan(view) == alone
    for i in range(40):  # a stream of tiny chats neither
        ctl.note_arrival(3 + i % 5)
    assert ctl.plan(view) == alone
    for _ in range(3):  # a few odd long prompts among 43 do not stretch it
        ctl.note_arrival(4000)
    assert ctl.robust_prompt() == 256
    for _ in range(40):  # prompts that are really long do (40 of the last 83)
        ctl.note_arrival(600)
    assert ctl.robust_prompt() == 600
    assert ctl.ttft_slack() == pytest.approx(0.8 * prefill(600), rel=1e-6)
    assert ctl.plan(view).token_budget > alone.token_budget
    given = BudgetController(derived, model, 2048, wall_clock=False, given_ttft=True)
    for _ in range(20):
        given.note_arrival(5)
    assert given.ttft_slack() == pytest.approx(derived.interactive.ttft_ms - prefill(256))


def _bulk_job_after(make_sched, chat_prompt: int | None, rng: random.Random) -> dict:
    """A bulk job of 300-token lines (64 seats, 120 lines queued) run for 300 steps on a
    simulated clock after one one-token chat of `chat_prompt` tokens (None: no chat), under a
    derived TTFT target; its batch-only steps' (budget, running rows) and its tokens per ms."""
    sched = make_sched(num_blocks=8192, block_size=16, max_num_seqs=64,
                       max_num_batched_tokens=2048, interactive_batch_token_cap=512)  # fmt: skip
    model = StepCostModel(TRUE)
    ctl = BudgetController(default_targets(model, {}), model, 2048, wall_clock=False)
    sched.step_budget = ctl
    sim = EngineSim(sched)
    if chat_prompt is not None:
        sim.add("chat", chat_prompt, lane="interactive", max_tokens=1)
        sim.run()
    steps, clock, tokens = [], 0.0, 0
    for k in range(300):
        while len(sched.requests) < 120:
            sim.add(f"line{k}-{rng.random()}", 300, max_tokens=64)
        out = sim.step()
        f = sched.last_features
        ms = true_ms(f, 1.0, rng)
        ctl.observe(f, ms, ctl.last_target_ms)
        clock += ms
        tokens += out.num_batched_tokens
        steps.append((ctl.last.token_budget, ctl._view.batch_running, ctl.last.reason, ms))
    return {"steps": steps, "tokens_per_ms": tokens / clock, "slack": ctl.ttft_slack()}


def test_a_tiny_or_huge_chat_leaves_a_bulk_jobs_steps_as_they_were(make_sched):
    """Issue 53: one one-token chat before a bulk job once shrank every later batch-only step to
    1-4 tokens (the slack followed a running mean of the prompts seen). Replayed on the
    simulated clock: after a 4-token chat, and after one 3,000-token chat, the job's steps are
    batch-alone plans of at least their running rows and fit the slack, and it runs as fast
    as with no chat at all."""
    runs = {
        name: _bulk_job_after(make_sched, prompt, random.Random(13))
        for name, prompt in (("none", None), ("tiny", 4), ("huge", 3000))
    }
    for name, run in runs.items():
        steps = run["steps"][20:]
        assert all(reason.startswith("batch-alone") for _, _, reason, _ in steps), name
        assert all(budget >= rows for budget, rows, _, _ in steps), name
        assert max(ms for *_, ms in steps) <= 1.05 * run["slack"], name
        assert run["slack"] == pytest.approx(runs["none"]["slack"])
        assert run["tokens_per_ms"] == pytest.approx(runs["none"]["tokens_per_ms"], rel=0.05)


def test_derived_tpot_target_follows_the_lone_decode_steps_measured():
    """A derived TPOT target is TPOT_MULTIPLE x the lone decode steps the worker measures serving
    (wall clock: what an idle stream's client sees), not the start-up profile's bare step;
    an operator's target stays as given."""
    model = StepCostModel(TRUE)
    targets = SloTargets(LaneSlo(ttft_ms=400.0, tpot_ms=10.0), LaneSlo(10_000.0, 100.0))
    derived = BudgetController(
        targets, model, 2048, wall_clock=False, given_ttft=True, given_tpot=False
    )
    given = BudgetController(targets, model, 2048, wall_clock=False, given_ttft=True)
    for k in range(30):
        for ctl in (derived, given):
            ctl.observe(StepFeatures(1, 1, 100 + k), 30.0 if k % 10 else 300.0)  # outliers
            ctl.observe(StepFeatures(40, 8, 4000), 90.0)  # not a lone decode: ignored
    assert derived.targets.interactive.tpot_ms == pytest.approx(TPOT_MULTIPLE * 30.0, rel=0.15)
    assert given.targets.interactive.tpot_ms == 10.0
    assert derived.targets.interactive.ttft_ms == 400.0 and derived.targets.batch.tpot_ms == 100.0


def test_derived_ttft_target_follows_the_cost_model():
    """A derived TTFT target is re-derived from the cost model every RETARGET_STEPS measured
    steps: on a machine that turns twice as slow it doubles (the start-up profile's target
    would leave running decodes alone overrunning half of it); an operator's stays."""
    rng = random.Random(6)
    ctls = []
    for given in (False, True):
        model = StepCostModel(TRUE)
        ctls.append(BudgetController(default_targets(model, {}), model, 2048,
                                     wall_clock=False, given_ttft=given))  # fmt: skip
    start = ctls[0].targets.interactive.ttft_ms
    for _ in range(4 * RETARGET_STEPS):
        f = random_features(rng)
        for ctl in ctls:
            ctl.observe(f, true_ms(f, 2.0))
    derived, given = ctls
    assert derived.targets.interactive.ttft_ms == pytest.approx(2 * start, rel=0.15)
    assert given.targets.interactive.ttft_ms == start


def test_an_interactive_prompt_prefills_while_running_decodes_overrun_half_its_ttft():
    """32 streams whose decodes alone take longer than half the TTFT target: an arriving prompt
    still gets MIN_PREFILL_CHUNK tokens a step (else it waited for every stream to finish)."""
    model = StepCostModel(TRUE)
    targets = SloTargets(LaneSlo(ttft_ms=20.0, tpot_ms=10.0), LaneSlo(1000.0, 100.0))
    ctl = BudgetController(targets, model, 2048, wall_clock=False, given_ttft=True)
    assert model.max_tokens_within(10.0, 32, 32 * 300) == 0
    plan = ctl.plan(StepView(32, 0, 32 * 300, 200))
    assert plan.token_budget >= 32 + MIN_PREFILL_CHUNK


def test_an_interactive_chunk_is_priced_at_its_prompts_depth(make_sched):
    """A long interactive prompt prefilling beside a running stream: the scheduler reports how
    deep into it the prefill is, and the plan's chunk there is shorter than at its start (its
    attention grows with the depth)."""
    sched = make_sched(num_blocks=512, block_size=16, max_num_seqs=8, max_num_batched_tokens=64)
    sim = EngineSim(sched)
    sim.add("stream", 8, lane="interactive", max_tokens=50)
    sim.step()
    sim.add("long", 2000, lane="interactive", max_tokens=2)
    for _ in range(12):
        sim.step()
    view = sched._step_view()
    long_req = sched.requests["long"]
    assert view.interactive_running == 1
    assert view.interactive_prefill_depth == long_req.num_computed_tokens >= 500
    model = StepCostModel(TRUE)
    targets = SloTargets(LaneSlo(ttft_ms=400.0, tpot_ms=40.0), LaneSlo(10_000.0, 400.0))
    ctl = BudgetController(targets, model, 2048, wall_clock=False, given_ttft=True)
    start = ctl.plan(view._replace(interactive_prefill_depth=0)).token_budget
    deep = ctl.plan(view).token_budget
    assert MIN_PREFILL_CHUNK < deep < start


def test_batch_beside_streams_gets_what_the_tpot_target_affords_on_average():
    """Half a batch row fits the TPOT target: batch gets a token every other step (whole tokens
    from accrued credit), not one forced into every step (a row costs ~20 % of a CPU decode
    step: the target's whole margin). With no room it still gets MIN_BATCH_RATE a step."""
    model = StepCostModel(TRUE)
    view = StepView(1, 8, 300, 0, batch_context=8 * 300, batch_decodes=8)
    base = model.predict(StepFeatures(1, 1, 300))
    row_ms = TRUE[1] + TRUE[2] + TRUE[3] * 300 / 1000
    for tpot, expected in ((base + 0.5 * row_ms, 0.5), (0.5 * base, MIN_BATCH_RATE)):
        targets = SloTargets(LaneSlo(ttft_ms=1000.0, tpot_ms=tpot), LaneSlo(10_000.0, 100.0))
        ctl = BudgetController(targets, model, 2048, wall_clock=False, given_ttft=True)
        caps = [ctl.plan(view).batch_tokens for _ in range(40)]
        assert set(caps) == {0, 1} and sum(caps) == pytest.approx(40 * expected, abs=1)


def test_headroom_follows_the_mean_step_not_single_slow_ones():
    """One lone decode step in 64 at 1.7x its target (a jittery CPU) leaves the headroom alone;
    steps over 0.85 of their target on average shrink it; windows with no target (or too few) grow
    it back."""
    model = StepCostModel(TRUE)
    targets = SloTargets(LaneSlo(ttft_ms=1000.0, tpot_ms=10.0), LaneSlo(10_000.0, 100.0))
    ctl = BudgetController(targets, model, 2048, wall_clock=False, given_ttft=True)
    ctl.headroom = 0.8
    lone = StepFeatures(1, 1, 100)
    for k in range(3 * 64):
        ctl.observe(lone, 17.0 if k % 64 == 0 else 7.7, 10.0)
    assert ctl.headroom == 0.8
    for _ in range(64):
        ctl.observe(lone, 9.5, 10.0)
    assert ctl.headroom == pytest.approx(0.72)
    for k in range(64):
        ctl.observe(StepFeatures(40, 8, 4000), 90.0, 10.0 if k < 5 else None)
    assert ctl.headroom == pytest.approx(0.72 * 1.03)


def test_streams_steps_and_batch_only_steps_have_their_own_headroom():
    """Streams' steps over their TPOT target shrink their headroom only: batch-only steps that
    keep within their TTFT slack plan as if nothing happened (twice as slow, one shared
    headroom at 0.58 cut their decode rows from 8 to 5), and the reverse."""
    model = StepCostModel(TRUE)
    targets = SloTargets(LaneSlo(ttft_ms=1000.0, tpot_ms=10.0), LaneSlo(10_000.0, 100.0))
    ctl = BudgetController(targets, model, 2048, wall_clock=False, given_ttft=True)
    fresh = BudgetController(targets, model, 2048, wall_clock=False, given_ttft=True)
    lone, batch_only = StepFeatures(1, 1, 100), StepFeatures(40, 8, 4000)
    for _ in range(64):
        ctl.observe(lone, 9.5, 10.0)  # paced: 0.95 of the TPOT target
        ctl.observe(batch_only, 30.0, 50.0)  # 0.6 of its slack
    assert ctl.headroom == pytest.approx(0.81) and ctl.slack_headroom == 1.0
    view = StepView(0, 8, 0, 0, 8 * 500, batch_prefill_tokens=900, batch_decodes=8)
    assert ctl.plan(view) == fresh.plan(view)
    for _ in range(64):
        ctl.observe(batch_only, 45.0, 50.0)  # 0.9 of its slack; no paced steps
    assert ctl.slack_headroom == pytest.approx(0.9)
    assert ctl.headroom == pytest.approx(0.81 * 1.03)


def test_step_trace_records_what_each_measured_step_saw_planned_and_took(tmp_path, monkeypatch):
    """LANESERVE_STEP_TRACE: one JSON line per measured step, with the view the plan saw, the
    plan, the features that ran, the prediction and the wall-clock time; none without it."""
    import json
    import os
    import time

    path = tmp_path / "trace.jsonl"
    monkeypatch.setenv("LANESERVE_STEP_TRACE", str(path))
    model = StepCostModel(TRUE)
    targets = SloTargets(LaneSlo(ttft_ms=1000.0, tpot_ms=50.0), LaneSlo(10_000.0, 500.0))
    ctl = BudgetController(targets, model, 2048, given_ttft=True)
    views = [StepView(1, 4, 300, 0, batch_context=1200, batch_decodes=4), StepView(0, 4, 0, 0)]
    predicted, plans, coefficients = [], [], []
    for view in views:
        ctl.observe_pending(time.monotonic())
        plan = ctl.plan(view)
        ctl.on_scheduled(StepFeatures(plan.token_budget, 1, 300))
        predicted.append(model.predict(StepFeatures(plan.token_budget, 1, 300)))
        plans.append(plan._asdict())
        coefficients.append([round(c, 5) for c in model.coefficients])
        time.sleep(0.01)
        ctl.on_step_done()
    ctl.observe_pending(time.monotonic())
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["view"] for r in lines] == [json.loads(json.dumps(v._asdict())) for v in views]
    first = lines[0]
    assert first["paced"] is True and first["target_ms"] == 50.0
    assert first["features"]["tokens"] == first["plan"]["token_budget"]
    assert [r["predicted_ms"] for r in lines] == pytest.approx(predicted, abs=0.01)
    assert [r["plan"] for r in lines] == plans
    # as each step's plan used them: a line is written before its own step is folded in
    assert [r["coefficients"] for r in lines] == coefficients
    assert coefficients[0] != coefficients[1]  # the model moved between the steps
    assert {r["pid"] for r in lines} == {os.getpid()}
    assert all(10.0 <= r["measured_ms"] < 1000.0 for r in lines)
    assert lines[0]["t"] < lines[1]["t"]
    ctl._trace.close()
    monkeypatch.setenv("LANESERVE_STEP_TRACE", str(tmp_path))  # a folder: cannot be opened
    assert BudgetController(targets, model, 2048, given_ttft=True)._trace is None
    monkeypatch.delenv("LANESERVE_STEP_TRACE")
    untraced = BudgetController(targets, model, 2048, given_ttft=True)
    assert untraced._trace is None


def test_drafts_proposed_for_streams_get_room_in_the_budget(make_sched):
    """Speculative drafts count against the step's budget; the controller's budget holds the
    drafts proposed for the streams (a lone stream's budget was once 2 tokens: at most one
    draft a verification) and for the batch decodes a batch-only step takes, and a stream's
    drafts are sent beside capped batch work (the batch decodes after it in the order, which
    the cap keeps out, once reserved the whole budget)."""
    model = StepCostModel(TRUE)
    # a TPOT target just over a lone decode step (5 ms here), as derived ones are
    targets = SloTargets(LaneSlo(ttft_ms=400.0, tpot_ms=6.0), LaneSlo(10_000.0, 400.0))
    ctl = BudgetController(targets, model, 2048, wall_clock=False, given_ttft=True)
    lone = StepView(1, 0, 100, 0, interactive_drafts=4)
    assert ctl.plan(lone).token_budget >= 1 + 4
    ctl.on_scheduled(StepFeatures(5, 1, 100), stream_drafts=True)
    assert ctl.last_target_ms is None  # a step emitting several tokens a stream: not judged
    ctl.plan(lone)
    ctl.on_scheduled(StepFeatures(1, 1, 100))  # the drafts were not sent after all: judged
    assert ctl.last_target_ms == 6.0
    assert ctl.plan(StepView(1, 0, 100, 0)).token_budget < 1 + 4
    batch_only = StepView(0, 8, 0, 0, batch_context=800, batch_decodes=8, batch_drafts=24)
    plan = ctl.plan(batch_only)
    assert (plan.token_budget, plan.batch_drafts) == (8 + 24, 24)  # all fit the TTFT slack

    sim = _controlled(make_sched, model, targets)
    for i in range(20):
        sim.add(f"b{i}", 20, max_tokens=50)
    while any(r.num_output_tokens == 0 for r in sim.sched.running):
        sim.step()
    stream = sim.add("i0", 20, lane="interactive", max_tokens=50)
    while stream.num_output_tokens == 0:
        sim.step()
    stream.spec_token_ids = [1, 2, 3, 4]
    out = sim.sched.schedule()
    (mine,) = [e for e in out.scheduled if e.request is stream]
    assert mine.num_new_tokens == 5 and list(mine.spec_token_ids) == [1, 2, 3, 4]
    batch = [e for e in out.scheduled if e.request.lane is Lane.BATCH]
    assert len(batch) <= sim.sched.step_budget.last.batch_tokens  # the cap still holds
    sim.sched.update_after_step(out, {"i0": 4})  # every draft rejected: nothing computed
    stream.spec_token_ids = []
    for e in out.scheduled:
        if e.samples:
            e.request.append_output_token_ids([7])
    sim.bm.check_integrity()


def test_batch_drafts_never_take_a_running_prefills_token_or_the_plans_chunk(make_sched):
    """Under a batch-only plan of 3 decode rows, a 7-token budget and no batch drafts (the
    time target held none), three decodes with 4 drafts each and a prompt mid-prefill: the
    decodes send no drafts and the prefill keeps the rest of the budget (drafts once took
    what the plan had priced as its chunk, and the reservation counted the prefill as a
    decode the row cap kept out, leaving it no token)."""
    from laneserve.gpu_worker.scheduler import _StepState
    from laneserve.gpu_worker.scheduler_output import SchedulerOutput

    sim = EngineSim(make_sched(num_blocks=256, block_size=16, max_num_batched_tokens=16))
    decodes = [sim.add(f"d{i}", 4, max_tokens=20) for i in range(3)]
    while any(r.num_output_tokens == 0 for r in decodes):
        sim.step()
    prompt = sim.add("p", 100, max_tokens=4)
    while prompt.num_computed_tokens == 0:
        sim.step()
    assert 0 < prompt.num_computed_tokens < prompt.num_tokens  # mid-prefill
    for r in decodes:
        r.spec_token_ids = [1, 2, 3, 4]
    step = _StepState(7, None, 3, 0)
    sched = sim.sched
    sched._schedule_running(step)
    got = {rid: e.num_new_tokens for rid, e in step.entries.items()}
    assert got == {"d0": 1, "d1": 1, "d2": 1, "p": 4}, got
    out = SchedulerOutput(list(step.entries.values()), [], sum(got.values()))
    sched.update_after_step(out)
    for r in decodes:
        r.spec_token_ids = []
        r.append_output_token_ids([9])
    sim.bm.check_integrity()
    # the same step with room for 2 batch drafts: the first decode sends them, the prefill
    # still gets a token
    for r in decodes:
        r.spec_token_ids = [1, 2, 3, 4]
    step = _StepState(9, None, 3, 2)
    sched._schedule_running(step)
    got = {rid: e.num_new_tokens for rid, e in step.entries.items()}
    assert got["d0"] == 3 and got["p"] >= 1 and sum(got.values()) <= 9, got
    out = SchedulerOutput(list(step.entries.values()), [], sum(got.values()))
    sched.update_after_step(out, {"d0": 2})
    for r in decodes:
        r.spec_token_ids = []
        r.append_output_token_ids([9])
    sim.bm.check_integrity()
