"""Speculative decoding on the tiny random Llama and on hand-made logits: the proposer, the
rejection sampler's distribution, rollback under preemption and small budgets, no block leak."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from laneserve.gpu_worker.config import SpeculativeConfig
from laneserve.gpu_worker.request import Request
from laneserve.gpu_worker.sampler import Sampler
from laneserve.gpu_worker.sampling_params import SamplingParams
from laneserve.gpu_worker.spec_decode import (
    NgramProposer,
    RequestSpecStats,
    SpecController,
    SpecRequest,
    TokenHistory,
    YieldGuard,
    verify,
)
from tests.engine_props.props_helpers import run_engine

FORCED = SpeculativeConfig(num_speculative_tokens=4, adaptive=False)


class ReplayProposer:
    """Drafts replayed from a finished run (a random model rarely copies its prompt, so n-gram
    drafts alone would seldom be accepted here): for a sequence whose prompt is a key of
    `outputs`, the next k tokens that run produced, the last one corrupted every other step so
    both full acceptance and rejections happen."""

    def __init__(self, outputs: dict[tuple[int, ...], list[int]], corrupt: bool = True) -> None:
        self.outputs = outputs
        self.calls = 0
        self.corrupt = corrupt

    def propose(self, tokens: np.ndarray, k: int) -> np.ndarray:
        self.calls += 1
        seq = tokens.tolist()
        for prompt, out in self.outputs.items():
            if tuple(seq[: len(prompt)]) == prompt:
                drafts = list(out[len(seq) - len(prompt) : len(seq) - len(prompt) + k])
                if drafts and self.calls % 2 and self.corrupt:
                    drafts[-1] = 7
                return np.array(drafts, dtype=np.int64)
        return tokens[:0]


def _chi2_pvalue(observed: np.ndarray, expected: np.ndarray) -> float:
    """Pearson chi-square test p-value (cells with expected count >= 5 only)."""
    keep = expected >= 5
    stat = float((((observed[keep] - expected[keep]) ** 2) / expected[keep]).sum())
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), torch.tensor(stat / 2.0)))


def test_proposer_takes_the_longest_then_most_recent_match():
    prop = NgramProposer(min_n=2, max_n=3)
    seq = np.array([1, 2, 3, 9, 2, 3, 7, 8, 1, 2, 3], dtype=np.int64)
    # suffix (1,2,3) occurs at 0..2 -> drafts follow it: 9, 2, 3; (2,3) alone is more recent
    assert prop.propose(seq, 3).tolist() == [9, 2, 3]
    seq = np.array([5, 2, 3, 9, 4, 2, 3, 7, 8, 2, 3], dtype=np.int64)
    assert prop.propose(seq, 2).tolist() == [7, 8]  # equally long (2,3): the latest wins
    assert prop.propose(np.array([1, 2, 3, 4], dtype=np.int64), 3).tolist() == []
    assert prop.propose(np.array([4, 1, 2, 1], dtype=np.int64), 3).tolist() == []  # n=1 < min
    tail = np.array([6, 7, 6, 7], dtype=np.int64)  # the draft may run into the suffix itself
    assert prop.propose(tail, 5).tolist() == [6, 7]


def test_controller_speculates_when_a_token_is_cheap_and_stops_when_it_is_not():
    ctl = SpecController(SpeculativeConfig(num_speculative_tokens=4))
    for tokens, ms in [(1, 20.0), (5, 21.0), (9, 22.0)] * 10:  # bandwidth-bound: 0.25 ms/token
        ctl.observe_step(tokens, ms)
    good = RequestSpecStats(acc=8.0, rej=1.0)
    drafts = [np.arange(4)]
    assert ctl.choose(drafts, [good], 1) == [4]
    ctl = SpecController(SpeculativeConfig(num_speculative_tokens=4))
    for tokens, ms in [(64, 160.0), (80, 200.0), (96, 240.0)] * 10:  # compute-bound: 2.5 ms/token
        ctl.observe_step(tokens, ms)
    assert ctl.choose(drafts * 64, [RequestSpecStats(acc=2.0, rej=2.0)] * 64, 64) == [0] * 64
    forced = SpecController(FORCED)
    assert forced.choose(drafts, [RequestSpecStats()], 64) == [4]


def test_controller_stops_short_of_a_measured_cost_cliff():
    """Steps of 1-4 tokens cost about the same, a 5th token doubles the step (torch's int4 CPU
    kernel: 4 rows per weight unpack): 3 drafts, not 4. A line through the same steps would
    have sent all 4; a measured count replaces the line only once it has enough steps."""
    ms = {1: 10.0, 2: 11.0, 3: 12.0, 4: 13.0, 5: 24.0, 9: 26.0}
    ctl = SpecController(SpeculativeConfig(num_speculative_tokens=4))
    for _ in range(SpecController.TABLE_MIN_SAMPLES):
        for tokens, t in ms.items():
            ctl.observe_step(tokens, t)
    good = RequestSpecStats(acc=8.0, rej=1.0)  # acceptance 0.82
    assert ctl.choose([np.arange(4)], [good], 1) == [3]
    assert ctl.step_ms(np.array([4, 5])).tolist() == pytest.approx([13.0, 24.0])
    # fewer samples of the 5-token step than the table needs: the line decides (all 4 drafts)
    fresh = SpecController(SpeculativeConfig(num_speculative_tokens=4))
    for tokens, t in ms.items():
        fresh.observe_step(tokens, t)
    assert fresh.choose([np.arange(4)], [good], 1) == [4]


def _guard_run(guard: YieldGuard, rows: int, steps: int, rate_on: float, rate_off: float) -> int:
    """Steps (of `steps`) the guard allowed drafts, each step measuring `rate_*` tokens/ms."""
    allowed = 0
    for _ in range(steps):
        on = guard.allow(rows)
        allowed += on
        guard.observe(rows, on, rows * 2, rows * 2 / (rate_on if on else rate_off))
    return allowed


def test_yield_guard_vetoes_drafts_where_they_measured_slower_and_keeps_probing():
    guard = YieldGuard()
    # batch 64: steps with drafts emit 0.7 tokens/ms, without 0.8: vetoed after the first
    # samples of each, with one probe in PROBE_EVERY steps
    allowed = _guard_run(guard, 64, 160, rate_on=0.7, rate_off=0.8)
    assert guard.vetoed() == [64]
    probes = 160 // YieldGuard.PROBE_EVERY
    assert YieldGuard.MIN_SAMPLES <= allowed <= YieldGuard.MIN_SAMPLES + probes + 1
    # batch 1 is its own bucket: drafts pay there, so they stay on but for the probes
    allowed = _guard_run(guard, 1, 160, rate_on=0.05, rate_off=0.04)
    assert 160 - probes - YieldGuard.MIN_SAMPLES - 1 <= allowed < 160 and guard.vetoed() == [64]
    # the cost changes: the probes notice and the veto at 64 lifts
    _guard_run(guard, 64, 400, rate_on=0.9, rate_off=0.8)
    assert guard.vetoed() == []


def test_controller_drafts_only_in_pure_decode_steps_the_guard_measured():
    ctl = SpecController(SpeculativeConfig(num_speculative_tokens=4))
    ctl._step_rows = 8
    ctl.observe_wall(8, 8 + 5, 5, 8 + 3, 10.0)  # pure decode, 3 drafts accepted: counted
    ctl.observe_wall(8, 8 + 5 + 100, 5, 11, 10.0)  # a prefill chunk rode along: not counted
    ctl.observe_wall(7, 7 + 5, 5, 10, 10.0)  # not the requests propose saw: not counted
    ctl.observe_wall(8, 8, 0, 7, 10.0)  # no drafts, one row failed: 7 emitted
    assert ctl.guard._means[YieldGuard.bucket(8)] == [0.7, 1, 1.1, 1]


def test_adaptive_drafts_only_in_pure_decode_steps():
    """Drafts take a step's token budget before prompts' chunks do: adaptive speculation sends
    none while a running request prefills, and drafts again once the step is pure decode;
    forced speculation always drafts."""
    prompt = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3]  # + output 4: drafts 5, 1, 2, 3
    params = SamplingParams(max_tokens=50, temperature=0.0)

    def decoding(rid: str) -> Request:
        req = Request(rid, list(prompt), params)
        req.append_output_token_ids(4)
        req.num_computed_tokens = req.num_tokens - 1
        return req

    reqs = [decoding("a"), decoding("b")]
    specs = {r.request_id: SpecRequest(TokenHistory(r.all_token_ids)) for r in reqs}
    prefilling = Request("c", list(prompt), params)  # nothing computed yet
    spec_of = lambda r: (specs.get(r.request_id), params)  # noqa: E731
    for config, expect_mixed in ((SpeculativeConfig(num_speculative_tokens=4), False),
                                 (FORCED, True)):  # fmt: skip
        ctl = SpecController(config)
        ctl.guard.allow = lambda rows: True  # the measured check is not what is tested here
        ctl.propose([*reqs, prefilling], spec_of, 1024)
        assert bool(reqs[0].spec_token_ids) is expect_mixed
        ctl.propose(reqs, spec_of, 1024)
        assert reqs[0].spec_token_ids == [5, 1, 2, 3]


def test_yield_guard_buckets_are_octaves_and_bootstrap_alternates():
    assert [YieldGuard.bucket(n) for n in (1, 2, 3, 4, 7, 8, 63, 64, 127)] == [
        1, 2, 2, 3, 3, 4, 6, 7, 7]  # fmt: skip
    guard = YieldGuard()
    # until both modes have MIN_SAMPLES measured steps the guard alternates, so a bucket whose
    # steps are rarely measured cannot be stuck in one mode
    assert [guard.allow(64) for _ in range(4)] == [True, False, True, False]
    for _ in range(YieldGuard.MIN_SAMPLES):
        guard.observe(64, True, 64, 100.0)
    assert guard.allow(64) is False  # drafted steps measured, draft-free ones still needed


@pytest.mark.parametrize("draft, top_k", [(0, 0), (3, 0), (4, 3)])
def test_rejection_sampling_keeps_the_target_distribution(draft, top_k):
    """Tiny vocabulary (6 tokens): the first emitted token of a run whose draft is `draft` is
    distributed as the target p (chi-square), accepted with probability p(draft), and never when
    top-k removes the draft; each seeded generator moves by exactly one uniform per token."""
    n, vocab = 4000, 6
    row = torch.tensor([2.0, 1.5, 1.0, 0.3, -0.5, -1.0])
    logits = row.repeat(2 * n, 1)  # request i owns rows 2i (draft check) and 2i + 1 (bonus)
    params = [SamplingParams(temperature=0.9, top_k=top_k, seed=i, max_tokens=4) for i in range(n)]
    gens = [torch.Generator().manual_seed(i) for i in range(n)]
    runs = verify(Sampler([]), logits, params, gens, [[1]] * n, [[]] * n, [[draft]] * n)
    first = np.array([r.token_ids[0] for r in runs])
    probs = Sampler([]).sampling_probs(row[None], params[:1], [[1]], [[]])[0].double().numpy()
    counts = np.bincount(first, minlength=vocab)
    assert _chi2_pvalue(counts, n * probs) > 1e-3, (counts, n * probs)
    accepted = np.array([r.num_accepted for r in runs])
    assert (
        abs(accepted.mean() - probs[draft])
        < 4 * np.sqrt(probs[draft] * (1 - probs[draft]) / n) + 1e-9
    )
    assert all(len(r.token_ids) == r.num_accepted + 1 for r in runs)
    for i in (0, 1, 2):  # generator state: one draw per emitted token
        ref = torch.Generator().manual_seed(i)
        for _ in runs[i].token_ids:
            torch.rand(1, dtype=torch.float64, generator=ref)
        assert torch.equal(ref.get_state(), gens[i].get_state())


def _requests(n: int, params_of) -> list[dict]:
    """Repetitive prompts (so the proposer finds matches) of different lengths."""
    base = [300, 301, 302, 303, 304, 305]
    return [
        {
            "request_id": f"r{i}",
            "prompt_token_ids": (base * (3 + i % 4))[: 10 + 3 * i],
            "sampling_params": params_of(i),
        }
        for i in range(n)
    ]


def test_spec_on_equals_off_under_small_budgets_and_preemption(make_engine):
    """Greedy and seeded rows side by side, a step budget smaller than the drafts, a KV pool
    that forces preemption, and explicit preemptions mid-run: the same tokens as without drafts,
    integrity after every step, every block free at the end (run_engine)."""

    def params_of(i: int) -> SamplingParams:
        if i % 2:
            return SamplingParams(max_tokens=28, temperature=0.9, top_k=8, seed=i, ignore_eos=True)
        return SamplingParams(max_tokens=28, temperature=0.0, ignore_eos=True)

    opts = {"max_num_batched_tokens": 12, "num_blocks": 12, "block_size": 8, "max_model_len": 96}
    preempt = {6: ["r0", "r3"], 11: ["r1"]}
    reqs = _requests(6, params_of)
    off = run_engine(make_engine(**opts), reqs, preempt_at=preempt)
    engine = make_engine(cache=False, **opts, speculative_config=FORCED)
    engine.speculation.controller.proposer = ReplayProposer(
        {tuple(r["prompt_token_ids"]): off[r["request_id"]].token_ids for r in reqs}
    )
    before = engine.stats()
    on = run_engine(engine, _requests(6, params_of), preempt_at=preempt)
    assert {k: r.key() for k, r in on.items()} == {k: r.key() for k, r in off.items()}
    st = engine.stats()
    assert st["spec_accepted_tokens"] > before["spec_accepted_tokens"]
    assert st["num_preemptions"] > before["num_preemptions"] + 3  # KV pressure preempted too
    assert any(r.num_deltas < len(r.token_ids) for r in on.values())  # multi-token deltas


def test_sampled_token_frequencies_match_without_speculation(make_engine):
    """Two-sample chi-square over every output token of 128 unseeded requests per engine on the
    tiny model with a 6-token top-k (a tiny effective vocabulary), speculation on vs off. Drafts
    replay the greedy continuation, which a peaked (temperature 0.25) distribution often accepts
    and sometimes rejects, so both branches of the rejection sampler shape the sample."""
    prompt = [300, 301, 302, 303] * 6
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=8, temperature=0.25, top_k=6, ignore_eos=True)
    reqs = [
        {"request_id": f"r{i}", "prompt_token_ids": prompt, "sampling_params": sampled}
        for i in range(128)
    ]
    opts = {"max_num_seqs": 128, "num_blocks": 256}
    plain = make_engine(**opts)
    top = run_engine(
        plain, [{"request_id": "g", "prompt_token_ids": prompt, "sampling_params": greedy}]
    )
    torch.manual_seed(0)
    off = run_engine(plain, reqs)
    engine = make_engine(cache=False, **opts, speculative_config=FORCED)
    # uncorrupted: the sampler rejects on its own
    engine.speculation.controller.proposer = ReplayProposer(
        {tuple(prompt): top["g"].token_ids}, corrupt=False
    )
    torch.manual_seed(1)
    on = run_engine(engine, [dict(r) for r in reqs])
    st = engine.stats()
    assert 100 < st["spec_accepted_tokens"] < st["spec_draft_tokens"], (
        st["spec_accepted_tokens"],
        st["spec_draft_tokens"],
    )
    a = np.bincount([t for r in off.values() for t in r.token_ids], minlength=50_000)
    b = np.bincount([t for r in on.values() for t in r.token_ids], minlength=50_000)
    cells = np.flatnonzero((a + b) >= 10)
    table = np.stack([a[cells], b[cells]])  # [2, C]
    expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
    stat = float(((table - expected) ** 2 / expected).sum())
    p = float(torch.special.gammaincc(torch.tensor((len(cells) - 1) / 2.0), torch.tensor(stat / 2)))
    assert len(cells) >= 4 and p > 1e-3, (stat, len(cells))
