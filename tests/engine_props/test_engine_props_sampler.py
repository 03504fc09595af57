"""Property: a seeded row's tokens are a function of its own logits, parameters and seed only.

Random vocabularies (below and above `TOP_P_CANDIDATES`, so both top-p paths run), peaked and flat
logits, random target parameters and random neighbours at a random position in the batch."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from laneserve.gpu_worker.sampler import TOP_P_CANDIDATES, Sampler
from laneserve.gpu_worker.sampling_params import SamplingParams
from tests.engine_props.props_helpers import prop_settings


@st.composite
def params(draw, vocab: int, seeded: bool) -> SamplingParams:
    return SamplingParams(
        temperature=draw(st.sampled_from([0.0, 0.3, 1.0, 1.7])),
        top_k=draw(st.sampled_from([0, 1, 7, vocab - 1, vocab + 5])),
        top_p=draw(st.sampled_from([1.0, 0.3, 0.9, 0.999])),
        repetition_penalty=draw(st.sampled_from([1.0, 1.3])),
        frequency_penalty=draw(st.sampled_from([0.0, 0.5])),
        min_tokens=draw(st.sampled_from([0, 2])),
        logprobs=draw(st.sampled_from([None, 0, 3])),
        seed=draw(st.integers(0, 2**32)) if seeded else None,
    )


@st.composite
def batches(draw):
    vocab = draw(st.sampled_from([50, TOP_P_CANDIDATES + 500]))
    target = draw(params(vocab, seeded=True))
    others = draw(st.lists(params(vocab, seeded=draw(st.booleans())), max_size=5))
    position = draw(st.integers(0, len(others)))
    scale = draw(st.sampled_from([0.05, 1.0, 6.0]))  # flat, mild, peaked
    return vocab, target, others, position, scale, draw(st.integers(0, 2**31))


def draw_tokens(vocab, target, others, position, scale, data_seed, steps=4):
    """Tokens of `target` over `steps` steps, with `others` around it (random logits each)."""
    rng = torch.Generator().manual_seed(data_seed)
    sampler = Sampler(eos_token_ids=[0])
    gens = [torch.Generator().manual_seed(p.seed) if p.seed is not None else None for p in others]
    target_gen = torch.Generator().manual_seed(target.seed)
    prompt = torch.randint(0, vocab, (12,), generator=rng).tolist()
    own: list[int] = []
    neighbour_out = [[] for _ in others]
    probs = []
    for _ in range(steps):
        row = torch.randn(vocab, generator=rng) * scale
        noise = torch.randn(len(others), vocab) * scale * 2  # global RNG: differs per call
        logits = torch.cat([noise[:position], row[None], noise[position:]])
        batch = others[:position] + [target] + others[position:]
        batch_gens = gens[:position] + [target_gen] + gens[position:]
        outs = neighbour_out[:position] + [own] + neighbour_out[position:]
        prompts = [prompt] * len(batch)
        probs.append(sampler.sampling_probs(logits, batch, prompts, outs)[position])
        result = sampler(logits, batch, batch_gens, prompts, outs)
        for i, out in enumerate(outs):
            out.append(result.token_ids[i])
    return own, probs


@prop_settings(150)
@given(batches())
def test_seeded_row_is_independent_of_its_batch(case):
    vocab, target, others, position, scale, data_seed = case
    alone, alone_probs = draw_tokens(vocab, target, [], 0, scale, data_seed)
    mixed, mixed_probs = draw_tokens(vocab, target, others, position, scale, data_seed)
    assert mixed == alone
    for p_alone, p_mixed, token in zip(alone_probs, mixed_probs, alone, strict=True):
        assert torch.equal(p_alone, p_mixed)
        assert p_alone[token] > 0  # never a token outside the row's own support
