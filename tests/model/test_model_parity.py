"""Our paged-KV forward against transformers (float32): the bundled SmolLM2, and every family's
tiny random-weight shape from scripts/make_test_model.py (greedy tokens and logits)."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

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


def test_greedy_continuation_matches_transformers(runner, smollm2_loaded, hf_smollm2):
    """Prompts of 1 token, around a block and past several, each against transformers run alone,
    decoded in one batch through the paged cache: whole prefills, then 7-token chunks. (One
    prompt alone through our runner: the logits test above and the families' test below; a
    batch equal to its prompts alone: tests/engine/test_engine_invariance.py.)"""
    lengths = [1, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK, 500]
    prompts = [long_ids(smollm2_loaded.tokenizer, n) for n in lengths]
    assert list(map(len, prompts)) == lengths
    refs = [hf_greedy(hf_smollm2, ids, 24) for ids in prompts]
    sizes = [(n + 24) // BLOCK + 1 for n in lengths]  # each prompt's own blocks, disjoint
    tables = [list(range(sum(sizes[:b]), sum(sizes[: b + 1]))) for b in range(len(sizes))]
    assert greedy(runner, prompts, 24, tables=tables) == refs
    assert greedy(runner, prompts, 24, chunk=7, tables=tables) == refs


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


# Sliding-window attention (Mistral; Qwen2 with use_sliding_window, its first layer full): a
# tiny random-weight model whose 24-token window is shorter than the prompts (3 blocks of 8), so
# the kernels skip whole blocks; greedy float32 tokens equal transformers' `generate`.
WINDOW, SW_BLOCK = 24, 8


def _tiny_sliding_window(family: str):
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from laneserve.gpu_worker.model_config import config_from_hf_dict

    torch.manual_seed(0)
    shape = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                 sliding_window=WINDOW, tie_word_embeddings=False, eos_token_id=None)  # fmt: skip
    if family == "mistral":
        hf = MistralForCausalLM(MistralConfig(**shape, head_dim=16))
    else:
        hf = Qwen2ForCausalLM(Qwen2Config(**shape, use_sliding_window=True, max_window_layers=1))
    hf = hf.eval()
    config = config_from_hf_dict(hf.config.to_dict(), Path(f"tiny-{family}"))
    assert config.max_model_len == 256  # not capped to the window
    weights = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    model = LlamaForCausalLM(config, weights, torch.float32, "cpu")
    return hf, ModelRunner(model, block_size=SW_BLOCK, num_blocks=64)


@pytest.fixture(scope="module", params=["mistral", "qwen2"])
def sliding_window_pair(request):
    return _tiny_sliding_window(request.param)


def greedy_batch(runner, prompts, max_new: int, chunk: int) -> list[list[int]]:
    """Greedy decoding of several prompts in one batch: prefill chunks of up to `chunk` tokens
    beside the other prompts' decodes, one token per prompt per step after that."""
    seqs = [list(p) for p in prompts]
    per_seq = (max(map(len, prompts)) + max_new) // SW_BLOCK + 1
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(prompts))]
    done = [0] * len(prompts)
    while any(len(s) < len(p) + max_new for s, p in zip(seqs, prompts, strict=True)):
        live = [
            i
            for i, (s, p) in enumerate(zip(seqs, prompts, strict=True))
            if len(s) < len(p) + max_new
        ]
        news = [seqs[i][done[i] : done[i] + chunk] for i in live]
        samples = [done[i] + len(n) == len(seqs[i]) for i, n in zip(live, news, strict=True)]
        inputs = runner.prepare_inputs(
            news, [done[i] for i in live], [tables[i] for i in live], samples
        )
        logits = runner.execute(inputs)
        rows = iter(logits)
        for i, n, sample in zip(live, news, samples, strict=True):
            done[i] += len(n)
            if sample:
                seqs[i].append(int(next(rows).argmax()))
    return [s[len(p) :] for s, p in zip(seqs, prompts, strict=True)]


def test_sliding_window_greedy_matches_transformers(sliding_window_pair):
    hf, runner = sliding_window_pair
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 96, (n,), generator=gen).tolist() for n in (41, 47, 20)]
    refs = []
    for p in prompts:
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=32, do_sample=False, pad_token_id=0)  # no EOS  # fmt: skip
        refs.append(out[0, len(p) :].tolist())
    assert greedy_batch(runner, prompts[:1], 32, chunk=64) == refs[:1]  # alone, one prefill pass
    assert greedy_batch(runner, prompts, 32, chunk=64) == refs  # batched
    assert greedy_batch(runner, prompts, 32, chunk=10) == refs  # chunked prefill beside decodes
    windows = runner.model.sliding_windows
    runner.model.sliding_windows = [None] * len(windows)  # the same model without its window
    try:
        assert greedy_batch(runner, prompts, 32, chunk=64) != refs  # the window matters here
    finally:
        runner.model.sliding_windows = windows


@pytest.mark.parametrize(
    ("family", "extra", "window", "layer_types"),
    [
        ("MistralForCausalLM", {}, WINDOW, ()),  # every layer
        ("Qwen2ForCausalLM", {"use_sliding_window": True, "max_window_layers": 1}, WINDOW,
         ("full_attention", "sliding_attention")),
        ("Qwen2ForCausalLM", {}, None, ()),  # Qwen2's window is off unless use_sliding_window
    ],
)  # fmt: skip
def test_sliding_window_config_fields(family, extra, window, layer_types):
    from laneserve.gpu_worker.model_config import config_from_hf_dict

    cfg = dict(architectures=[family], vocab_size=96, hidden_size=64, intermediate_size=128,
               num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=256,
               sliding_window=WINDOW, **extra)  # fmt: skip
    config = config_from_hf_dict(cfg, Path("tiny"))
    assert (config.sliding_window, config.layer_types) == (window, layer_types)
    assert config.max_model_len == 256
    expected = [None if window is None or (layer_types and t != "sliding_attention") else window
                for t in (layer_types or ("sliding_attention",) * 2)]  # fmt: skip
    assert [config.layer_sliding_window(i) for i in range(2)] == expected
    assert config_from_hf_dict(config.to_hf_dict(), Path("tiny")) == config  # round trip


def test_sliding_window_engine_frees_blocks_that_left_the_window(tmp_path, smollm2_dir):
    """A tiny Mistral (every layer windowed, W = 24, blocks of 8) generating 48 tokens past a
    41-token prompt through the engine: after each step a request holds at most
    ceil(W / block) + 1 blocks, the freed ones return to the pool, and the tokens equal
    transformers'. A second request whose prompt repeats the first's prompt and output hits the
    prefix cache through blocks freed by the window (still cached) and still matches; a model
    with a global layer frees nothing."""
    from transformers import AutoTokenizer, MistralConfig, MistralForCausalLM

    from laneserve.gpu_worker.block_manager import NULL_BLOCK
    from laneserve.gpu_worker.llm import LLM
    from laneserve.gpu_worker.sampling_params import SamplingParams

    torch.manual_seed(0)
    hf = MistralForCausalLM(MistralConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        sliding_window=WINDOW, tie_word_embeddings=False, eos_token_id=None)).eval()  # fmt: skip
    hf.save_pretrained(tmp_path, safe_serialization=True)
    AutoTokenizer.from_pretrained(str(smollm2_dir)).save_pretrained(tmp_path)
    llm = LLM(model=str(tmp_path), dtype="float32", block_size=SW_BLOCK, num_blocks=64)
    engine, bm = llm.engine, llm.engine.block_manager
    assert bm.sliding_window == WINDOW
    prompt = random_prompts([41], seed=3)[0]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    ref = hf_greedy(hf, prompt, 48)
    limit = -(-WINDOW // SW_BLOCK) + 1

    def run(rid: str, ids: list[int]) -> tuple[list[int], int]:
        req = engine.add_request(rid, prompt_token_ids=ids, sampling_params=params)
        out, peak = [], 0
        while engine.has_unfinished_requests():
            for delta in engine.step():
                out.extend(delta.new_token_ids)
            held = [b for b in req.block_table if b != NULL_BLOCK]
            peak = max(peak, len(held))
            if req.block_table:
                assert len(held) <= limit, (len(held), req.num_computed_tokens)
                assert bm.num_free_blocks == bm.num_total_blocks - len(held)
            engine.check_integrity()
        return out, peak

    tokens, peak = run("a", prompt)
    assert tokens == ref
    assert peak <= limit and bm.num_window_freed_blocks >= (41 + 48 - WINDOW) // SW_BLOCK - 1
    longer = prompt + ref + random_prompts([5], seed=4)[0]
    hits_before = bm.prefix_cache_hits
    assert run("b", longer)[0] == hf_greedy(hf, longer, 48)
    assert bm.prefix_cache_hits > hits_before  # the hit ran through blocks the window freed
    config = dataclasses.replace(
        engine.model_config, layer_types=("full_attention", "sliding_attention")
    )
    assert config.kv_sliding_window is None  # a global layer reads every key: nothing is freed
