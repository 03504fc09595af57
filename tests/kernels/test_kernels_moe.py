"""The Triton fused-MoE kernel against its plain-PyTorch reference (interpreted on CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from laneserve.kernels import moe

E, H, INTER = 5, 48, 40  # H, INTER not multiples of the kernel's tiles: masked edges


def inputs(num_tokens: int, top_k: int, dtype, gen, device):
    x = torch.randn(num_tokens, H, generator=gen)
    w13 = torch.randn(E, 2 * INTER, H, generator=gen) / H**0.5
    w2 = torch.randn(E, H, INTER, generator=gen) / INTER**0.5
    gate = torch.randn(E - 1, H, generator=gen)  # the last expert gets no tokens
    weights, ids = moe.route(x, gate, top_k, renormalize=True)
    return [t.to(device) for t in (x.to(dtype), w13.to(dtype), w2.to(dtype))] + [
        weights.to(device),
        ids.to(device),
    ]


@pytest.mark.parametrize(
    "num_tokens,top_k,dtype",
    [(1, 2, torch.float32), (37, 2, torch.float32), (19, 3, torch.bfloat16)],
)
def test_triton_fused_moe_matches_reference(num_tokens, top_k, dtype, gen, device):
    from laneserve.kernels.triton.fused_moe import fused_moe as triton_fused_moe

    args = inputs(num_tokens, top_k, dtype, gen, device)
    out = triton_fused_moe(*args)
    ref = moe.fused_moe_reference(
        *[t.cpu().float() for t in args[:3]], *[t.cpu() for t in args[3:]]
    )
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert out.dtype == dtype and out.shape == (num_tokens, H)
    torch.testing.assert_close(out.cpu().float(), ref, rtol=tol, atol=tol * ref.abs().max().item())


def test_align_block_size_groups_pairs_by_expert():
    from laneserve.kernels.triton.fused_moe import align_block_size

    ids = torch.tensor([[2, 0], [2, 1], [0, 2]])
    sorted_ids, experts, total = align_block_size(ids, num_experts=4, block_m=4)
    pad = ids.numel()
    assert total.tolist() == [12]
    assert sorted_ids.tolist()[:12] == [1, 4, pad, pad, 3, pad, pad, pad, 0, 2, 5, pad]
    # the shape-only bound: ceil(6 / 4) + min(4, 6) = 6 blocks, the unused ones padding
    assert sorted_ids.tolist()[12:] == [pad] * 12
    assert experts.tolist() == [0, 1, 2, 4, 4, 4]


def test_fused_moe_rejects_bad_arguments(gen):
    x, w13, w2, weights, ids = inputs(4, 2, torch.float32, gen, "cpu")
    with pytest.raises(ValueError, match="topk_ids out of range"):
        moe.fused_moe(x, w13, w2, weights, ids + E)
    with pytest.raises(ValueError, match="do not fit"):
        moe.fused_moe(x, w13, w2[:, :, :-1], weights, ids)
    with pytest.raises(TypeError, match="int64"):
        moe.fused_moe(x, w13, w2, weights, ids.int())


_COMPILE = """
import json, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from laneserve.kernels.triton.fused_moe import compile_cases
for name, fn, sig, consts in compile_cases():
    sig = {**sig, **dict.fromkeys(consts, "constexpr")}
    compiled = triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32))
    print(json.dumps({"kernel": name, "shared": compiled.metadata.shared}), flush=True)
"""


@pytest.mark.slow
def test_fused_moe_compiles_for_sm90():
    """The compiled dialect (TRITON_INTERPRET off, through ptxas) accepts every variant, within
    an H100's shared memory."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(rows) == 4 and all(row["shared"] <= 227 * 1024 for row in rows), rows
