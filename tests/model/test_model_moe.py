"""Sparse MoE families (Mixtral, Qwen3-MoE) against transformers, on tiny random-weight models
saved with `save_pretrained` in the test (float32, the bundled SmolLM2 tokenizer)."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from laneserve.gpu_worker import quantization as quant
from laneserve.gpu_worker.errors import ModelLoadError
from laneserve.gpu_worker.model_loader import load_model_files
from laneserve.gpu_worker.models import moe
from laneserve.gpu_worker.models.llama import LlamaForCausalLM
from laneserve.gpu_worker.sampling_params import SamplingParams
from laneserve.kernels import moe as moe_ops
from laneserve.kernels.moe import silu_and_mul_ref

NEW_TOKENS = 32
PROMPT_LENS = (3, 17, 41)  # the 41-token prompt is prefilled in chunks (max_num_batched_tokens)
SHAPE = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=256,
    initializer_range=0.2,  # peaked routing and logits: no near-ties between runs
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)


def hf_model(family: str, vocab: int, **overrides):
    """A seeded random transformers model of `family` ("mixtral" | "qwen3_moe")."""
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    if family == "mixtral":
        config = MixtralConfig(
            vocab_size=vocab, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2
        )
        cls = MixtralForCausalLM
    else:
        config = Qwen3MoeConfig(
            vocab_size=vocab,
            intermediate_size=48,
            moe_intermediate_size=24,
            num_experts=6,
            num_experts_per_tok=2,
            norm_topk_prob=False,
        )
        cls = Qwen3MoeForCausalLM
    for key, value in {**SHAPE, **overrides}.items():
        setattr(config, key, value)
    return cls(config).eval()


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe"])
def family_dir(request, tmp_path_factory, smollm2_loaded):
    """(family, HF directory, transformers model) with the SmolLM2 tokenizer."""
    tokenizer = smollm2_loaded.tokenizer
    family = request.param
    overrides = {"mlp_only_layers": [1]} if family == "qwen3_moe" else {}
    model = hf_model(family, len(tokenizer), **overrides)
    out = tmp_path_factory.mktemp(family)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    yield family, out, model
    del model
    gc.collect()


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def hf_greedy(model, ids: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(ids) :].tolist()


def test_greedy_matches_transformers_alone_batched_chunked(family_dir):
    """LLM(model=DIR): each prompt alone, then all batched (the prefix cache now holds their
    prompts), with prefill chunks of at most 16 tokens: token-identical to transformers."""
    from laneserve.gpu_worker.llm import LLM

    family, path, model = family_dir
    llm = LLM(
        str(path),
        dtype="float32",
        device="cpu",
        num_blocks=64,
        max_model_len=128,
        max_num_batched_tokens=16,
    )
    assert llm.engine.model_config.architecture == family
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    batch = prompts(model.config.vocab_size)
    expected = [hf_greedy(model, ids) for ids in batch]
    alone = [llm.generate([ids], params)[0].token_ids for ids in batch]
    batched = llm.generate(batch, params)
    assert alone == expected
    assert [o.token_ids for o in batched] == expected
    assert sum(o.num_cached_tokens for o in batched) > 0
    del llm
    int8 = dict(dtype="float32", device="cpu", num_blocks=64, quantization="int8")
    if family == "qwen3_moe":  # experts' in_features 24: torch's int8 matmul would crash on it
        with pytest.raises(ModelLoadError, match="int8 weight-only kernel needs in_features"):
            LLM(str(path), **int8)
        return
    # int8 experts (QuantLinear) through the engine: the tiny model's argmax survives rounding
    # for the first token (later ones drift apart, as rounded weights do)
    llm = LLM(str(path), **int8)
    experts = llm.engine.runner.model.layers[0].moe.linears()
    assert all(isinstance(t, quant.QuantLinear) for t in experts)
    outs = llm.generate(batch, params)
    assert [o.token_ids[0] for o in outs] == [e[0] for e in expected]
    assert all(len(o.token_ids) == NEW_TOKENS for o in outs)


@pytest.mark.slow
@pytest.mark.parametrize("family_dir", ["qwen3_moe"], indirect=True)
def test_triton_forced_engine_matches_transformers(family_dir, monkeypatch):
    """The Triton backend forced (attention, layer ops and the fused-MoE kernel, interpreted on
    CPU): a 17-token prefill and 4 decode steps."""
    from laneserve.gpu_worker.llm import LLM

    family, path, model = family_dir
    monkeypatch.setenv("LANESERVE_ATTENTION_BACKEND", "triton")
    llm = LLM(str(path), dtype="float32", device="cpu", num_blocks=32, max_model_len=64)
    ids = prompts(model.config.vocab_size)[1]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    assert llm.generate([ids], params)[0].token_ids == hf_greedy(model, ids)[:4]


def _hf_block(model, layer: int):
    decoder = model.model.layers[layer]
    return getattr(decoder, "block_sparse_moe", None) or decoder.mlp


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_routing_and_block_match_transformers(family):
    """Top-k ids and weights against transformers' router on random hidden states, ties included
    (two router rows equal: both pick the lower expert as torch.topk does); the grouped experts
    against transformers' MoE block."""
    model = hf_model(family, vocab=64, initializer_range=0.1)
    block = _hf_block(model, 0)
    with torch.no_grad():
        block.gate.weight[3] = block.gate.weight[1]  # experts 1 and 3 always tie
    h = torch.randn(50, SHAPE["hidden_size"], generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        _, ref_weights, ref_ids = block.gate(h)
        ref_out = block(h[None])[0]
    renorm = family == "mixtral"
    weights, ids = moe_ops.route(h, block.gate.weight, model.config.num_experts_per_tok, renorm)
    assert torch.equal(ids, ref_ids)
    assert (ids == 1).any()  # the tie decided which of 1 and 3 these tokens got
    torch.testing.assert_close(weights, ref_weights.float(), rtol=0, atol=0)
    loaded = _our_layer(model, family)
    ours = moe.forward(h, loaded.layers[0].moe, silu_and_mul_ref)
    torch.testing.assert_close(ours, ref_out, rtol=1e-5, atol=1e-6)
    # every parameter held once (experts stacked, their per-expert linears views)
    assert loaded.weight_bytes() == sum(p.numel() * 4 for p in model.parameters())


def _our_layer(model, family, quantization="none", weights=None) -> LlamaForCausalLM:
    from laneserve.gpu_worker.model_config import config_from_hf_dict

    cfg = model.config.to_dict() | {"architectures": [type(model).__name__]}
    config = config_from_hf_dict(cfg, Path(family))
    state = weights if weights is not None else dict(model.state_dict())
    return LlamaForCausalLM(config, state, torch.float32, "cpu", quantization)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_experts_match_their_dequantized_weights(mode):
    """Over QuantLinear experts the grouped block equals the dense reference run on the same
    (dequantized) weights, to the kernels' bf16 activation rounding."""
    model = hf_model(
        "mixtral", vocab=64, initializer_range=0.1, intermediate_size=64
    )  # int4: K % 32
    layer = _our_layer(model, "mixtral", quantization=mode).layers[0].moe
    assert layer.w13 is None and all(isinstance(t, quant.QuantLinear) for t in layer.linears())
    w13 = torch.stack([t.dequantize() for t in layer.gate_up])
    w2 = torch.stack([t.dequantize() for t in layer.down])
    h = torch.randn(20, SHAPE["hidden_size"], generator=torch.Generator().manual_seed(5))
    weights, ids = moe_ops.route(h, layer.gate, layer.top_k, layer.renormalize)
    ref = moe_ops.fused_moe_reference(h, w13, w2, weights, ids)
    ours = moe.forward(h, layer, silu_and_mul_ref)
    torch.testing.assert_close(ours, ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


def test_qwen3_moe_sparse_layers_follow_config():
    """`mlp_only_layers` and `decoder_sparse_step` pick the sparse layers as transformers does."""
    from laneserve.gpu_worker.model_config import config_from_hf_dict

    cfg = hf_model("qwen3_moe", vocab=64, num_hidden_layers=6).config.to_dict()
    cfg |= {"architectures": ["Qwen3MoeForCausalLM"], "decoder_sparse_step": 2}
    cfg["mlp_only_layers"] = [3]
    config = config_from_hf_dict(cfg, Path("q"))
    assert config.moe_layers == (1, 5)
    assert (config.num_experts, config.num_experts_per_tok, config.norm_topk_prob) == (6, 2, False)
    assert config.moe_intermediate_size == 24
    with pytest.raises(ModelLoadError, match="num_experts_per_tok 7 must be 1..num_experts"):
        config_from_hf_dict(cfg | {"num_experts_per_tok": 7}, Path("q"))


def test_checkpoint_missing_or_misshapen_expert_is_named(tmp_path):
    model = hf_model("mixtral", vocab=64)
    state = {k: v for k, v in model.state_dict().items() if "layers.1.mlp.experts" not in k}
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.experts\.0\.w1\.weight"):
        _our_layer(model, "mixtral", weights=state)
    state = dict(model.state_dict())
    state["model.layers.0.mlp.experts.down_proj"] = state["model.layers.0.mlp.experts.down_proj"][
        :3
    ]
    with pytest.raises(ModelLoadError, match=r"experts\.down_proj has shape \(3, 32, 48\)"):
        _our_layer(model, "mixtral", weights=state)


def test_unsupported_moe_architecture_is_refused_by_name(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["DeepseekV3ForCausalLM"]}')
    with pytest.raises(ModelLoadError, match="DeepseekV3ForCausalLM.*MixtralForCausalLM"):
        load_model_files(tmp_path)


def write_gguf(model, family: str, path: Path, expert_type: str = "F32") -> Path:
    """`model`'s weights as llama.cpp lays them out (scripts/make_test_model.py): Mixtral as
    `llama` with experts (Q/K rows permuted), Qwen3-MoE as `qwen3moe`; experts as 3-D
    `ffn_*_exps` tensors of `expert_type`."""
    from tests.harness import load_script

    return load_script("make_test_model").write_gguf(model, family, path, expert_type=expert_type)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_gguf_experts_load_like_transformers(family, tmp_path):
    """llama.cpp's layouts: F32 gives transformers' logits; Q8_0 and Q4_0 experts kept in their
    blocks (int8 / int4 kernels) give the logits of the same file dequantized."""
    from laneserve.gpu_worker.gguf_loader import config_from_gguf, load_gguf_weights, open_gguf
    from laneserve.gpu_worker.model_config import config_from_hf_dict
    from laneserve.gpu_worker.model_runner import ModelRunner

    extra = {"mlp_only_layers": [1]} if family == "qwen3_moe" else {}
    # llama.cpp's qwen3moe renormalizes the top-k weights (as Qwen3-30B-A3B's config says)
    extra |= {"moe_intermediate_size": 32, "norm_topk_prob": True} if family == "qwen3_moe" else {}
    model = hf_model(family, vocab=96, intermediate_size=64, **extra)
    ids = torch.randint(0, 96, (29,), generator=torch.Generator().manual_seed(2)).tolist()

    def logits(path: Path, mode: str) -> torch.Tensor:
        reader = open_gguf(path)
        config = config_from_gguf(reader, path)
        assert config.architecture == family
        assert config.moe_layers == ((0,) if family == "qwen3_moe" else (0, 1))
        assert config_from_hf_dict(config.to_hf_dict(), path) == config  # the converted cache's
        weights = load_gguf_weights(reader, config, path, keep_quantized=mode != "none")
        ours = LlamaForCausalLM(config, weights, torch.float32, "cpu", mode)
        experts = ours.layers[0].moe.linears()
        assert all(isinstance(t, quant.QuantLinear) == (mode == "auto") for t in experts)
        runner = ModelRunner(ours, block_size=8, num_blocks=8)
        inputs = runner.prepare_inputs([ids], [0], [list(range(4))], [True])
        inputs.logits_indices = torch.arange(len(ids))
        return runner.execute(inputs)

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a - b).abs().max() / b.abs().max()).item()

    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0]
    assert rel(logits(write_gguf(model, family, tmp_path / "f32.gguf"), "none"), ref) < 1e-4
    for expert_type in ("Q8_0", "Q4_0"):
        path = write_gguf(model, family, tmp_path / f"{expert_type}.gguf", expert_type)
        assert rel(logits(path, "auto"), logits(path, "none")) < 2e-3, expert_type


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_llm_from_gguf_file_matches_transformers(family, tmp_path, smollm2_gguf):
    """`LLM(model=FILE.gguf)` end to end on the GGUF that scripts/make_test_model.py writes from
    its `tiny` shape (qwen3moe; Mixtral as llama with experts, Q/K permuted; the bundled GGUF's
    tokenizer): greedy float32 tokens of two prompts, batched, equal transformers' own."""
    from laneserve.gpu_worker.llm import LLM
    from tests.harness import load_script

    maker = load_script("make_test_model")
    model = maker.make_model(family, "tiny")
    path = maker.write_gguf(model, family, tmp_path / f"{family}.gguf", smollm2_gguf)
    llm = LLM(str(path), dtype="float32", device="cpu", num_blocks=32, max_model_len=128)
    assert llm.engine.model_config.architecture == family
    g = torch.Generator().manual_seed(5)
    batch = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (9, 23)]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate(batch, params)
    assert [o.token_ids for o in outs] == [hf_greedy(model, ids) for ids in batch]
