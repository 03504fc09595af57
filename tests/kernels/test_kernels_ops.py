"""reshape_and_cache, rms_norm, rotary_embedding, silu_and_mul: Triton vs reference vs transformers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from laneserve import kernels
from laneserve.kernels import reference
from laneserve.kernels import triton as triton_ops

DTYPES = [torch.float32, torch.bfloat16]


def _on(device, *tensors):
    return [t.to(device) for t in tensors]


@pytest.mark.parametrize("dtype", DTYPES)
def test_reshape_and_cache_writes_slots_and_skips_negatives(dtype, gen, device):
    num_blocks, block_size, heads, dim = 50, 8, 3, 64
    key = torch.randn(9, heads, dim, generator=gen).to(dtype)
    value = torch.randn(9, heads, dim, generator=gen).to(dtype)
    slots = torch.tensor([0, 7, 8, 399, -1, 100, 5, -3, 250])
    ref_k = torch.zeros(num_blocks, block_size, heads, dim, dtype=dtype)
    ref_v = torch.zeros_like(ref_k)
    reference.reshape_and_cache(key, value, ref_k, ref_v, slots)
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(ref_k[slot // block_size, slot % block_size], key[i])
            assert torch.equal(ref_v[slot // block_size, slot % block_size], value[i])
    assert int((ref_k != 0).any(-1).any(-1).sum()) == 7  # the two negative slots wrote nothing

    key_d, value_d, slots_d = _on(device, key, value, slots)
    tri_k, tri_v = torch.zeros_like(ref_k, device=device), torch.zeros_like(ref_v, device=device)
    triton_ops.reshape_and_cache(key_d, value_d, tri_k, tri_v, slots_d)
    assert torch.equal(tri_k.cpu(), ref_k) and torch.equal(tri_v.cpu(), ref_v)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_transformers(dtype, gen, device):
    hidden = 96
    norm = LlamaRMSNorm(hidden, eps=1e-5).to(dtype)
    norm.weight.data = torch.randn(hidden, generator=gen).to(dtype)
    x = torch.randn(5, hidden, generator=gen).to(dtype)
    residual = torch.randn(5, hidden, generator=gen).to(dtype)
    with torch.no_grad():
        expected = norm(x)
        expected_res = norm(x + residual)

    assert torch.equal(reference.rms_norm(x, norm.weight, 1e-5), expected)
    out, new_res = reference.rms_norm(x, norm.weight, 1e-5, residual)
    assert torch.equal(out, expected_res) and torch.equal(new_res, x + residual)

    x_d, w_d, r_d = _on(device, x, norm.weight.data, residual)
    tol = {} if dtype == torch.bfloat16 else {"atol": 1e-5, "rtol": 1e-5}
    torch.testing.assert_close(triton_ops.rms_norm(x_d, w_d, 1e-5).cpu(), expected, **tol)
    out, new_res = triton_ops.rms_norm(x_d, w_d, 1e-5, r_d)
    torch.testing.assert_close(out.cpu(), expected_res, **tol)
    assert torch.equal(new_res.cpu(), x + residual)


def _freqs(max_pos: int, rot_dim: int, base: float = 10000.0) -> torch.Tensor:
    """Llama RoPE angles ``[max_pos, rot_dim / 2]`` (inv_freq = base^(-2i/d))."""
    inv_freq = 1.0 / base ** (torch.arange(0, rot_dim, 2).float() / rot_dim)
    return torch.outer(torch.arange(max_pos).float(), inv_freq)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_embedding_matches_transformers(dtype, gen, device):
    tokens, dim = 9, 64
    freqs = _freqs(300, dim)
    cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)  # [max_pos, dim]
    positions = torch.randint(0, 300, (tokens,), generator=gen)
    q = torch.randn(tokens, 6, dim, generator=gen).to(dtype)
    k = torch.randn(tokens, 2, dim, generator=gen).to(dtype)
    # transformers: emb = cat(freqs, freqs); cos/sin in fp32, then cast to the activation dtype
    emb = torch.cat([freqs[positions], freqs[positions]], dim=-1)
    cos, sin = emb.cos().to(dtype)[None], emb.sin().to(dtype)[None]
    exp_q, exp_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    exp_q, exp_k = exp_q[0].transpose(0, 1), exp_k[0].transpose(0, 1)

    ref_q, ref_k = q.clone(), k.clone()
    result = reference.rotary_embedding(positions, ref_q, ref_k, cache)
    assert result[0] is ref_q and result[1] is ref_k  # in place
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {}
    torch.testing.assert_close(ref_q, exp_q, **tol)
    torch.testing.assert_close(ref_k, exp_k, **tol)

    tri_q, tri_k, pos_d, cache_d = _on(device, q, k, positions, cache)
    triton_ops.rotary_embedding(pos_d, tri_q, tri_k, cache_d)
    torch.testing.assert_close(tri_q.cpu(), ref_q, **tol)
    torch.testing.assert_close(tri_k.cpu(), ref_k, **tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype, gen, device):
    x = torch.randn(7, 2 * 40, generator=gen).to(dtype)
    expected = F.silu(x[:, :40]) * x[:, 40:]
    assert torch.equal(reference.silu_and_mul(x), expected)
    tol = {"atol": 1e-6, "rtol": 1e-6} if dtype == torch.float32 else {}
    torch.testing.assert_close(triton_ops.silu_and_mul(x.to(device)).cpu(), expected, **tol)


def test_layer_op_arguments_are_checked():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="weight"):
        kernels.rms_norm(x, torch.ones(7), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        kernels.rms_norm(x, torch.ones(8), 1e-6, residual=torch.randn(4, 9))
    with pytest.raises(TypeError, match="x must have dtype"):
        kernels.rms_norm(x.int(), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="even"):
        kernels.silu_and_mul(torch.randn(3, 7))
    with pytest.raises(ValueError, match="positions"):
        kernels.rotary_embedding(
            torch.arange(3), torch.randn(4, 2, 8), torch.randn(4, 1, 8), torch.randn(10, 8)
        )
    with pytest.raises(ValueError, match="cos_sin_cache"):
        kernels.rotary_embedding(
            torch.arange(4), torch.randn(4, 2, 8), torch.randn(4, 1, 8), torch.randn(10, 16)
        )
    with pytest.raises(TypeError, match="slot_mapping"):
        kernels.reshape_and_cache(
            torch.randn(2, 1, 8),
            torch.randn(2, 1, 8),
            torch.zeros(4, 4, 1, 8),
            torch.zeros(4, 4, 1, 8),
            torch.tensor([0.0, 1.0]),
        )
    with pytest.raises(ValueError, match="key"):
        kernels.reshape_and_cache(
            torch.randn(2, 2, 8),
            torch.randn(2, 2, 8),
            torch.zeros(4, 4, 1, 8),
            torch.zeros(4, 4, 1, 8),
            torch.tensor([0, 1]),
        )


def test_ours_does_not_break_transformers_kernels_probe():
    """Our top-level `kernels` shadows HF's optional package; transformers must not adopt it."""
    import transformers
    from transformers import LlamaForCausalLM  # noqa: F401
    from transformers.utils.import_utils import is_kernels_available

    assert transformers.__version__
    assert not is_kernels_available()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU fallback")
def test_forced_triton_without_gpu_turns_on_the_interpreter():
    """LANESERVE_ATTENTION_BACKEND=triton on a CPU-only host works without TRITON_INTERPRET set."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["LANESERVE_ATTENTION_BACKEND"] = "triton"
    code = (
        "import os, torch\n"
        "from laneserve import kernels\n"
        "x = torch.randn(3, 8)\n"
        "out = kernels.silu_and_mul(x)\n"
        "assert torch.allclose(out, kernels.reference.silu_and_mul(x), atol=1e-6)\n"
        "import laneserve.kernels.triton._common as c\n"
        "print(os.environ['TRITON_INTERPRET'], c.INTERPRET)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["1", "True"]
