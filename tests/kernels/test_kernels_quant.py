"""Weight-only quantized linears (gpu_worker.quantization) against dequantize-then-matmul.

Synthetic weights are quantized with gguf-py, written to a real GGUF file and read back through
the loader with `keep_quantized=True`; odd shapes (K a multiple of 32 but not of 128, N not a
multiple of 64) on purpose.
"""

from __future__ import annotations

import logging
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import quants

from laneserve.gpu_worker import gguf_blocks
from laneserve.gpu_worker import quantization as quant
from laneserve.gpu_worker.gguf_blocks import GGUFQuantTensor
from laneserve.gpu_worker.gguf_loader import load_gguf_weights
from laneserve.gpu_worker.model_config import ModelConfig
from laneserve.gpu_worker.quantization import QuantLinear

K = 160  # 5 groups of 32; not a multiple of 128
SHAPES = {  # GGUF tensor name -> (N, K); N = 40, 24, 72 are not multiples of 64
    "blk.0.attn_q.weight": (40, K),  # 5 heads x 8
    "blk.0.attn_k.weight": (24, K),  # 3 KV heads x 8
    "blk.0.attn_v.weight": (24, K),
    "blk.0.ffn_down.weight": (72, K),
}
CONFIG = ModelConfig(
    architecture="llama",
    num_hidden_layers=1,
    num_attention_heads=5,
    num_key_value_heads=3,
    head_dim=8,
    hidden_size=K,
    intermediate_size=K,
    vocab_size=64,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    max_model_len=64,
    eos_token_ids=(0,),
)


def write_gguf(path: Path, qtype: str, rng: np.random.Generator) -> Path:
    """The tensors of SHAPES in `qtype` (plus a Q5_0 one, which has no quantized kernel)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, shape in SHAPES.items():
        w = (rng.standard_normal(shape) * 0.05 + rng.standard_normal((shape[0], 1)) * 0.01).astype(
            np.float32
        )
        writer.add_tensor(
            name,
            quants.quantize(w, gguf.GGMLQuantizationType[qtype]),
            raw_dtype=gguf.GGMLQuantizationType[qtype],
        )
    q5 = quants.quantize(
        rng.standard_normal((8, K)).astype(np.float32), gguf.GGMLQuantizationType.Q5_0
    )
    writer.add_tensor("blk.0.ffn_up.weight", q5, raw_dtype=gguf.GGMLQuantizationType.Q5_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(params=["Q4_0", "Q4_1", "Q8_0"])
def loaded(request, tmp_path):
    """(qtype, blocks kept quantized, the same file dequantized by the float32 loader)."""
    path = write_gguf(tmp_path / f"{request.param}.gguf", request.param, np.random.default_rng(0))
    kept = load_gguf_weights(gguf.GGUFReader(str(path)), CONFIG, path, keep_quantized=True)
    dense = load_gguf_weights(gguf.GGUFReader(str(path)), CONFIG, path)
    return request.param, kept, dense


def bf16_tolerance(ref: torch.Tensor) -> dict:
    """bf16 rounding of inputs, weights and output: a few units of 2^-8 of the output's scale."""
    return {"atol": 4 * 2**-8 * ref.abs().max().item(), "rtol": 2**-7}


def test_blocks_kept_and_q_k_rows_unpermuted(loaded):
    """Quantized blocks dequantize to exactly what the float32 loader returns (Q/K un-permuted
    by whole rows of blocks), and the Q5_0 tensor falls back to float32."""
    qtype, kept, dense = loaded
    hf = "model.layers.0."
    for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.down_proj"):
        t = kept[hf + name + ".weight"]
        assert isinstance(t, GGUFQuantTensor) and t.qtype == qtype
        torch.testing.assert_close(
            gguf_blocks.dequantize(t), dense[hf + name + ".weight"], rtol=0, atol=0
        )
    assert isinstance(kept[hf + "mlp.up_proj.weight"], torch.Tensor)


def test_fallback_is_logged_with_tensor_and_type(tmp_path, caplog):
    path = write_gguf(tmp_path / "m.gguf", "Q4_1", np.random.default_rng(1))
    with caplog.at_level(logging.INFO, logger="laneserve.gpu_worker.gguf_loader"):
        load_gguf_weights(gguf.GGUFReader(str(path)), CONFIG, path, keep_quantized=True)
    lines = [r.getMessage() for r in caplog.records if "no quantized kernel" in r.getMessage()]
    assert len(lines) == 1 and "blk.0.ffn_up.weight" in lines[0] and "Q5_0" in lines[0]


@pytest.mark.parametrize("m", [1, 3, 17])
def test_fused_linear_matches_dequantized_matmul(loaded, m):
    """auto: Q4_x on the int4 kernel (exact weights), Q8_0 on int8 per channel (requantized)."""
    qtype, kept, dense = loaded
    hf = "model.layers.0.self_attn."
    names = [hf + f"{p}_proj.weight" for p in "qkv"]
    lin = quant.build_linear("qkv", [kept[n] for n in names], "auto", torch.float32)
    assert isinstance(lin, QuantLinear) and lin.kind == ("int8" if qtype == "Q8_0" else "int4")
    assert lin.shape == (88, K) and lin.dense.dtype == torch.float32  # for prefill-sized calls
    w = torch.cat([dense[n] for n in names])  # dequantize-then-matmul reference
    x = torch.randn(m, K, generator=torch.Generator().manual_seed(m))
    ref = x @ w.T
    out = lin(x)
    assert out.dtype == torch.float32 and out.shape == (m, 88)
    if qtype == "Q8_0":  # per-channel requantization: |error| <= max|w_row| / 254 per weight,
        # plus the scale's rounding to bf16 (2^-8 relative)
        row_max = w.abs().amax(1, keepdim=True)
        assert ((lin.dequantize() - w).abs() <= row_max / 254 + row_max * 2**-8).all()
        ref = x @ lin.dequantize().T
    torch.testing.assert_close(out, ref, **bf16_tolerance(ref))
    out_bf16 = lin(x.bfloat16())
    assert out_bf16.dtype == torch.bfloat16
    torch.testing.assert_close(out_bf16.float(), ref, **bf16_tolerance(ref))


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_int4_convention_is_exact(qtype):
    """torch's int4 kernel computes W = (q - 8) * scale + zero; with scale = d and zero = m + 8d
    (Q4_1) or 0 (Q4_0) it reproduces gguf's dequantization exactly. Hand-made blocks whose d and
    m are small multiples of 2^-6, so every value is exact in bf16 too."""
    rng = np.random.default_rng(2)
    n, nb = 24, K // 32
    d = rng.integers(1, 8, (n, nb)).astype(np.float16) / 64
    m = -rng.integers(0, 32, (n, nb)).astype(np.float16) / 64
    qs = rng.integers(0, 256, (n, nb, 16), dtype=np.uint8)
    head = [d[..., None].view(np.uint8)]
    if qtype == "Q4_1":
        head.append(m[..., None].view(np.uint8))
    blocks = np.concatenate([*(h.reshape(n, nb, 2) for h in head), qs], axis=-1).reshape(n, -1)
    t = GGUFQuantTensor("w", qtype, blocks, (n, K))
    lin = QuantLinear.from_int4(gguf_blocks.int4_from_gguf(t))
    ref = quants.dequantize(blocks, gguf.GGMLQuantizationType[qtype]).reshape(n, K)
    np.testing.assert_array_equal(lin.dequantize().numpy(), ref)


def test_rows_do_not_depend_on_the_batch():
    """Row i of a quantized linear is bitwise the same whatever else is in the batch (int4 and
    int8): the property the engine's invariance tests need."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(72, K, generator=gen) * 0.05
    x = torch.randn(40, K, generator=gen).bfloat16()
    for lin in (
        QuantLinear.from_int4(gguf_blocks.int4_from_float(w)),
        QuantLinear.from_int8(*gguf_blocks.int8_from_float(w)),
    ):
        full = lin(x)
        assert full.is_contiguous()  # N = 72 is padded to 80 for the int4 packer: rows dropped
        for m in (1, 2, 5, 16, 33):
            assert torch.equal(lin(x[:m]), full[:m]), (lin.kind, m)


def test_dense_copy_routes_large_calls():
    """A dense copy (kept for bf16 activations on CPUs with native bf16: `dense_copy_dtype`)
    takes calls of >= dense_min_tokens rows through F.linear."""
    w = torch.randn(72, K, generator=torch.Generator().manual_seed(4)) * 0.05
    groups = gguf_blocks.int4_from_float(w)
    lin = QuantLinear.from_int4(groups, dense=groups.dequantize().bfloat16())
    x = torch.randn(lin.dense_min_tokens, K).bfloat16()
    assert torch.equal(lin(x), F.linear(x, lin.dense))
    assert torch.equal(lin(x[:1]), lin._kernel(x[:1]))  # below the threshold: the int4 kernel


def test_float_requantization_error_bounds():
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(40, K, generator=gen)
    g = gguf_blocks.int4_from_float(w)
    step = (w.reshape(40, -1, 32).amax(-1) - w.reshape(40, -1, 32).amin(-1)) / 15
    err = (g.dequantize() - w).abs().reshape(40, -1, 32)
    assert (err <= step[..., None] / 2 + 1e-5).all()
    q, s = gguf_blocks.int8_from_float(w)
    assert ((q.float() * s[:, None] - w).abs() <= s[:, None] / 2 + 1e-6).all()


def test_q8_embedding_lookup_is_exact():
    rng = np.random.default_rng(6)
    w = rng.standard_normal((64, K)).astype(np.float32)
    blocks = quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
    t = GGUFQuantTensor("emb", "Q8_0", blocks, (64, K))
    emb = quant.build_embedding(t, "auto", torch.float32)
    ids = torch.tensor([5, 0, 63, 5])
    ref = torch.from_numpy(quants.dequantize(blocks, gguf.GGMLQuantizationType.Q8_0).reshape(64, K))
    assert torch.equal(quant.embedding(ids, emb), ref[ids])
    assert quant.nbytes(emb) < 64 * K * 2  # less than bf16


def test_modes_are_checked():
    with pytest.raises(ValueError, match="quantization must be one of"):
        quant.check_mode("fp8")
    assert quant.resolve_mode("auto", torch.device("cpu")) == "auto"
    assert quant.resolve_mode("auto", torch.device("meta")) == "none"
    with pytest.raises(ValueError, match="not implemented on meta"):
        quant.resolve_mode("int4", torch.device("meta"))
    cuda = torch.device("cuda")  # a device object: no GPU needed to check the rules
    assert quant.resolve_mode("auto", cuda, torch.bfloat16) == "none"
    assert quant.resolve_mode("int4", cuda, torch.bfloat16) == "int4"
    with pytest.raises(ValueError, match="needs dtype bfloat16"):
        quant.resolve_mode("int4", cuda, torch.float32)
    with pytest.raises(ValueError, match="'int8' is not implemented on cuda"):
        quant.resolve_mode("int8", cuda, torch.bfloat16)


def test_cuda_inner_k_tiles():
    assert [quant.cuda_inner_k_tiles(k) for k in (576, 1536, 4096, 96)] == [4, 8, 8, 2]
    with pytest.raises(ValueError, match="multiple of 32"):
        quant.cuda_inner_k_tiles(48)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (scripts/gpu_checks.sh)")
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_cuda_int4_linear_matches_the_gguf_values(qtype):
    """The CUDA int4 kernel reproduces gguf's dequantization (the same hand-made exact blocks as
    the CPU convention test), through `build_linear` on a CUDA device, N not a multiple of 16 (padded), several M."""
    rng = np.random.default_rng(3)
    n, nb = 40, K // 32
    d = rng.integers(1, 8, (n, nb)).astype(np.float16) / 64
    m = -rng.integers(0, 32, (n, nb)).astype(np.float16) / 64
    qs = rng.integers(0, 256, (n, nb, 16), dtype=np.uint8)
    head = [d[..., None].view(np.uint8)] + (
        [m[..., None].view(np.uint8)] if qtype == "Q4_1" else []
    )
    blocks = np.concatenate([*(h.reshape(n, nb, 2) for h in head), qs], axis=-1).reshape(n, -1)
    t = GGUFQuantTensor("w", qtype, blocks, (n, K))
    lin = quant.build_linear("w", [t], "int4", torch.bfloat16, torch.device("cuda"))
    assert lin.weight.is_cuda and lin.dense is None and lin.gemv is None
    ref = torch.from_numpy(
        quants.dequantize(blocks, gguf.GGMLQuantizationType[qtype]).reshape(n, K)
    )
    np.testing.assert_array_equal(lin.dequantize().cpu().numpy(), ref.numpy())
    for rows in (1, 7, 64):
        x = torch.randn(rows, K, device="cuda").bfloat16()
        out = lin(x).float().cpu()
        torch.testing.assert_close(out, x.float().cpu() @ ref.T, **bf16_tolerance(out))
