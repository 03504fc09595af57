"""Our paged-KV Llama forward against transformers on the bundled SmolLM2 (float32)."""

from __future__ import annotations

import pytest
import torch

from laneserve.gpu_worker.model_runner import ModelRunner
from laneserve.gpu_worker.models.llama import LlamaForCausalLM

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


def greedy(runner, ids, max_new: int, chunk: int | None = None) -> list[int]:
    """Greedy decoding through the paged cache: chunked prefill, then one token per step."""
    tokens = list(ids)
    table = list(range((len(ids) + max_new) // BLOCK + 1))
    done = 0
    while len(tokens) < len(ids) + max_new:
        n = len(tokens) - done
        if chunk:
            n = min(n, chunk)
        inputs = runner.prepare_inputs(
            [tokens[done : done + n]], [done], [table], [done + n == len(tokens)]
        )
        done += n
        if not inputs.sample_rows:
            runner.execute(inputs)
            continue
        logits = runner.execute(inputs)
        tokens.append(int(logits[0].argmax()))
    return tokens[len(ids) :]


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
    with torch.no_grad():
        ref = hf_smollm2.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, length, dtype=torch.long),
            max_new_tokens=24,
            min_new_tokens=24,
            do_sample=False,
            pad_token_id=2,
        )[0, length:].tolist()
    assert greedy(runner, ids, 24) == ref
    assert greedy(runner, ids, 24, chunk=7) == ref
