"""`SamplingParams.prompt_logprobs` (vLLM's shape) against a full-sequence forward of transformers,
across chunked prefill and preemption, and `min_p` / `logit_bias` in the engine (float32)."""

from __future__ import annotations

import math

import pytest
import torch

from laneserve.gpu_worker import SamplingParams
from laneserve.gpu_worker.errors import InvalidRequestError

TEXT = (
    "The history of the printing press begins in the fifteenth century, when movable type "
    "changed how books were made, sold and read across Europe and beyond."
)


@pytest.fixture(scope="module")
def exact_llm(make_llm):
    return make_llm(quantization="none", enable_prefix_caching=True)


@pytest.fixture(scope="module")
def hf_logprobs(smollm2_dir, exact_llm):
    """log_softmax of transformers' own float32 forward over the whole prompt: `[P, V]`, on the
    converted directory the engine loads (transformers' own GGUF reading, against our converter,
    is tests/model/test_model_parity.py's reference)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    ids = exact_llm.tokenizer(TEXT)["input_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return ids, torch.log_softmax(logits, dim=-1)


def _values(out) -> list[float]:
    ids = out.prompt_token_ids
    return [out.prompt_logprobs[p][ids[p]].logprob for p in range(1, len(ids))]


def test_prompt_logprobs_equal_full_forward(exact_llm, hf_logprobs):
    ids, ref = hf_logprobs
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=3)
    out = exact_llm.generate([ids], params)[0]
    plp = out.prompt_logprobs
    assert plp is not None and len(plp) == len(ids) and plp[0] is None
    for p in range(1, len(ids)):
        entry = plp[p]
        expect = ref[p - 1]  # position p - 1 predicts token p
        actual = entry[ids[p]]
        assert actual.logprob == pytest.approx(expect[ids[p]].item(), abs=2e-4)
        assert actual.rank == int((expect > expect[ids[p]]).sum()) + 1
        assert actual.decoded_token == exact_llm.tokenizer.decode([ids[p]])
        top = sorted((lp for lp in entry.values() if lp.rank <= 3), key=lambda lp: lp.rank)
        assert [lp.rank for lp in top][:3] == [1, 2, 3]
        ref_top = torch.topk(expect, 3).values.tolist()
        assert [lp.logprob for lp in top][:3] == pytest.approx(ref_top, abs=2e-4)
        assert 3 <= len(entry) <= 4  # the prompt token plus the top 3 (it may be one of them)
    # the prompt's log-likelihood is the sum of the entries, as harnesses compute it
    total = sum(_values(out))
    assert total == pytest.approx(sum(ref[p - 1, ids[p]].item() for p in range(1, len(ids))))
    assert math.isfinite(total) and total < 0


def test_prompt_logprobs_same_under_chunking(make_llm, exact_llm):
    ids = exact_llm.tokenizer(TEXT)["input_ids"]
    params = SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=0, ignore_eos=True)
    whole = exact_llm.generate([ids], params)[0]
    chunked = make_llm(quantization="none", max_num_batched_tokens=7).generate([ids], params)[0]
    assert chunked.metrics["prefill_chunks"] >= 4
    # fp32 rounding of other GEMM shapes: not bit-equal, within 5e-5
    assert _values(chunked) == pytest.approx(_values(whole), abs=5e-5)
    assert chunked.token_ids == whole.token_ids


def test_prompt_logprobs_once_across_preemption(make_llm, exact_llm):
    long = exact_llm.tokenizer(TEXT)["input_ids"] * 4
    lengths = [3, 7, 15, 16, 17, 31, 32, 33, 48, 64, 70, 5, 90, 11, 100, 111]
    prompts = [long[i * 3 : i * 3 + n] for i, n in enumerate(lengths)]
    params = SamplingParams(max_tokens=10, temperature=0.0, prompt_logprobs=1, ignore_eos=True)
    # the same batch in a pool that never preempts (a batch equals its prompts run alone:
    # tests/engine/test_engine_invariance.py, prompt logprobs under chunking above)
    alone = exact_llm.generate(prompts, params)
    assert exact_llm.stats()["num_preemptions"] == 0
    # 14 blocks x 16 = 224 slots for 16 requests of up to 121 tokens: preempted and recomputed
    tight = make_llm(quantization="none", num_blocks=14, max_model_len=224)
    outs = tight.generate(prompts, params)
    assert tight.stats()["num_preemptions"] > 0
    for o, a in zip(outs, alone, strict=True):
        assert len(o.prompt_logprobs) == len(o.prompt_token_ids)
        assert _values(o) == pytest.approx(_values(a), abs=5e-5)
        assert o.token_ids == a.token_ids
    tight.check_integrity()


def test_prompt_logprobs_skip_the_prefix_cache_and_cost_nothing_when_off(exact_llm):
    ids = exact_llm.tokenizer(TEXT)["input_ids"]
    plain = SamplingParams(max_tokens=2, temperature=0.0)
    exact_llm.generate([ids], plain)
    cached = exact_llm.generate([ids], plain)[0]
    assert cached.num_cached_tokens > 0 and cached.prompt_logprobs is None
    asked = exact_llm.generate([ids], SamplingParams(max_tokens=2, prompt_logprobs=1))[0]
    assert asked.num_cached_tokens == 0 and len(asked.prompt_logprobs) == len(ids)


def test_logit_bias_forces_and_bans(exact_llm):
    ids = exact_llm.tokenizer(TEXT)["input_ids"]
    greedy = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    base = exact_llm.generate([ids], greedy)[0].token_ids
    forced_id = 1000
    forced = SamplingParams(
        max_tokens=3, temperature=0.0, ignore_eos=True, logit_bias={forced_id: 100.0}
    )
    assert exact_llm.generate([ids], forced)[0].token_ids == [forced_id] * 3
    banned = SamplingParams(
        max_tokens=3, temperature=0.0, ignore_eos=True, logit_bias={str(base[0]): -100}
    )
    assert exact_llm.generate([ids], banned)[0].token_ids[0] != base[0]
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        SamplingParams(logit_bias={5: 101.0})
    assert SamplingParams.from_dict(forced.to_dict()).logit_bias == {forced_id: 100.0}


def test_min_p_keeps_only_likely_tokens(exact_llm):
    ids = exact_llm.tokenizer(TEXT)["input_ids"]
    probe = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=None, logprobs=20)
    top = exact_llm.generate([ids], probe)[0].logprobs[0]["top"]
    best = top[0][1]
    # min_p filters after temperature: p_i / p_max = exp((lp_i - lp_max) / T) >= 0.5
    allowed = {t for t, lp in top if lp >= best + 1.5 * math.log(0.5)}
    params = [SamplingParams(max_tokens=1, temperature=1.5, min_p=0.5, seed=s) for s in range(24)]
    drawn = {o.token_ids[0] for o in exact_llm.generate([ids] * 24, params)}
    assert drawn <= allowed
    loose = [SamplingParams(max_tokens=1, temperature=1.5, seed=s) for s in range(24)]
    assert len({o.token_ids[0] for o in exact_llm.generate([ids] * 24, loose)}) > len(drawn)
