"""Our paged-KV Llama forward against transformers on the bundled SmolLM2 (float32)."""

from __future__ import annotations

import copy

import pytest
import torch

from laneserve.gpu_worker.model_runner import ModelRunner
from laneserve.gpu_worker.models.llama import LlamaForCausalLM
from tests.harness import load_script

BLOCK = 16
TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based inks and a wooden press adapted from wine making. "
)


@pytest.fixture(scope="module")
def runner(smollm2_loaded):
    model = LlamaForCausalLM(smollm2_loaded.config, smollm2_loaded.weights, torch.float32, "cpu")
    return ModelRunner(model, block_size=BLOCK, num_blocks=128)


def long_ids(tokenizer, n: int) -> list[int]:
    ids = tokenizer(TEXT * (n // 20 + 2))["input_ids"]
    return ids[:n]


def run_pieces(runner, ids, pieces, rows="all"):
    """Feed `ids` in `pieces` through the paged cache; return logits for every fed row."""
    table = list(range(len(ids) // BLOCK + 2))
    done, outs = 0, []
    for n in pieces:
        inputs = runner.prepare_inputs([ids[done : done + n]], [done], [table], [True])
        inputs.logits_indices = torch.arange(n)
        outs.append(runner.execute(inputs))
        done += n
    return torch.cat(outs)


def greedy(runner, prompts, max_new: int, chunk=None, tables=None, cached=None) -> list[list[int]]:
    """Greedy decoding of `prompts` in one batch through the paged cache: chunked prefill (at most
    `chunk` tokens a step per request), then one token per step. `tables`: per prompt, its block
    ids (default: disjoint ranges); `cached`: per prompt, tokens whose KV those blocks already hold
    (a prefix-cache hit). Returns the new tokens of each prompt."""
    n = len(prompts)
    if tables is None:
        per = (max(map(len, prompts)) + max_new) // BLOCK + 1
        tables = [list(range(b * per, (b + 1) * per)) for b in range(n)]
    tokens, done = [list(p) for p in prompts], list(cached or [0] * n)
    while active := [b for b in range(n) if len(tokens[b]) < len(prompts[b]) + max_new]:
        new = [tokens[b][done[b] : done[b] + (chunk or len(tokens[b]))] for b in active]
        samples = [done[b] + len(ids) == len(tokens[b]) for b, ids in zip(active, new, strict=True)]
        inputs = runner.prepare_inputs(
            new, [done[b] for b in active], [tables[b] for b in active], samples
        )
        logits = runner.execute(inputs)
        for b, ids in zip(active, new, strict=True):
            done[b] += len(ids)
        for row, i in enumerate(inputs.sample_rows):
            tokens[active[i]].append(int(logits[row].argmax()))
    return [t[len(p) :] for t, p in zip(tokens, prompts, strict=True)]


def hf_greedy(model, ids: list[int], max_new: int) -> list[int]:
    """transformers' own greedy `generate` of exactly `max_new` tokens (an end token is kept like
    any other, as `greedy` does: the only stop id is one outside the vocabulary)."""
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id = model.config.vocab_size
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            generation_config=config,
            max_new_tokens=max_new,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(ids) :].tolist()


def test_logits_one_pass_and_pieces_match_transformers(runner, smollm2_loaded, hf_smollm2):
    ids = long_ids(smollm2_loaded.tokenizer, 77)
    with torch.no_grad():
        ref = hf_smollm2(torch.tensor([ids])).logits[0].float()
    scale = ref.abs().max()
    one = run_pieces(runner, ids, [len(ids)])
    pieces = run_pieces(runner, ids, [1, 15, 16, 17, 28])
    assert ((one - ref).abs().max() / scale).item() < 1e-4
    assert ((pieces - ref).abs().max() / scale).item() < 1e-4
    assert torch.equal(one.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("length", [1, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK, 500])
def test_greedy_continuation_matches_transformers(runner, smollm2_loaded, hf_smollm2, length):
    ids = long_ids(smollm2_loaded.tokenizer, length)
    assert len(ids) == length
    ref = hf_greedy(hf_smollm2, ids, 24)
    assert greedy(runner, [ids], 24) == [ref]
    assert greedy(runner, [ids], 24, chunk=7) == [ref]


# ----------------------------------------------------------------- other families, tiny random weights

FAMILIES = ["llama", "qwen3", "phi3", "gemma3"]  # scripts/make_test_model.py's `tiny` shape of each


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, smollm2_dir, tmp_path_factory):
    """(transformers model, our runner over the same weights loaded back from its saved
    directory) for one family's tiny random-weight shape."""
    from laneserve.gpu_worker.model_loader import load_model_files
    from laneserve.gpu_worker.models.registry import build_model

    maker = load_script("make_test_model")
    hf_model = maker.make_model(request.param, "tiny")
    out = maker.save_hf(hf_model, tmp_path_factory.mktemp(request.param), smollm2_dir)
    loaded = load_model_files(out)
    assert loaded.config.architecture == request.param
    model = build_model(loaded.config, loaded.weights, torch.float32, "cpu")
    yield hf_model, ModelRunner(model, block_size=BLOCK, num_blocks=64)


def random_prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


def test_family_greedy_matches_transformers(family):
    """32 greedy tokens token-identical to transformers' `generate`: alone, in one batch with
    chunked prefill, and from a prefix-cache hit (the second request reuses the first's blocks)."""
    hf_model, runner = family
    prompts = random_prompts([37, 5, 2 * BLOCK + 3])
    refs = [hf_greedy(hf_model, ids, 32) for ids in prompts]
    ids = prompts[0] + refs[0]
    with torch.no_grad():  # the logits themselves too (Gemma's soft-capping keeps the argmax)
        ref = hf_model(torch.tensor([ids])).logits[0]
    ours = run_pieces(runner, ids, [len(ids)])
    assert ((ours - ref).abs().max() / ref.abs().max()).item() < 1e-4
    assert greedy(runner, prompts[:1], 32) == refs[:1]
    assert greedy(runner, prompts, 32, chunk=7) == refs
    first = prompts[2]
    hit = first[: 2 * BLOCK] + random_prompts([9], seed=1)[0]
    assert greedy(runner, [first], 32, tables=[[0, 1, 2, 3, 4]]) == [refs[2]]
    assert greedy(runner, [hit], 32, tables=[[0, 1, 5, 6, 7]], cached=[2 * BLOCK]) == [
        hf_greedy(hf_model, hit, 32)
    ]
