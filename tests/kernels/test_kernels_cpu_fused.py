"""The C++ CPU layer ops (kernels.cpu_ext) against the PyTorch reference, and the op count of a
batch-1 decode step of the bundled model."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from laneserve import kernels
from laneserve.kernels import cpu_ext, reference

DTYPES = [torch.float32, torch.bfloat16, torch.float16]

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")


@pytest.fixture(autouse=True)
def built():
    assert cpu_ext.load(), "the C++ CPU kernels failed to build (see the warning logged)"


def _ops(fn) -> list[str]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return [e.name for e in prof.events() if e.cpu_parent is None]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_and_residual_add_match_reference(dtype, gen):
    x = torch.randn(7, 576, generator=gen).to(dtype)
    residual = torch.randn(7, 576, generator=gen).to(dtype)
    weight = torch.randn(576, generator=gen).to(dtype)
    out, new_res = kernels.rms_norm(x, weight, 1e-5, residual)
    ref_out, ref_res = reference.rms_norm(x, weight, 1e-5, residual)
    assert torch.equal(new_res, ref_res)  # one rounding of x + residual, as torch adds
    # the mean of squares sums in another order: within one rounding of the output dtype
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {}
    torch.testing.assert_close(out, ref_out, **tol)
    torch.testing.assert_close(
        kernels.rms_norm(x, weight, 1e-5), reference.rms_norm(x, weight, 1e-5), **tol
    )
    assert _ops(lambda: kernels.rms_norm(x, weight, 1e-5, residual)) == [
        "laneserve::fused_add_rms_norm"
    ]


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_reference(dtype, gen):
    x = torch.randn(5, 2 * 1536, generator=gen).to(dtype) * 4
    tol = {"atol": 1e-6, "rtol": 1e-6} if dtype == torch.float32 else {}
    torch.testing.assert_close(kernels.silu_and_mul(x), reference.silu_and_mul(x), **tol)
    assert _ops(lambda: kernels.silu_and_mul(x)) == ["laneserve::silu_and_mul"]


def test_nan_propagates_through_the_vectorized_exp(gen):
    """A NaN gate or a NaN key gives NaN where the reference does (the polynomial exp clamps its
    input range, and must not clamp NaN into a finite value)."""
    x = torch.randn(2, 2 * 24, generator=gen, dtype=torch.bfloat16)
    x[0, 3] = float("nan")
    assert torch.equal(kernels.silu_and_mul(x).isnan(), reference.silu_and_mul(x).isnan())
    assert kernels.silu_and_mul(x).isnan().sum() == 1
    k = torch.randn(4, 16, 1, 64, generator=gen)
    v = torch.randn(4, 16, 1, 64, generator=gen)
    k[1, 2, 0, 7] = float("nan")  # token 18 of the context
    q = torch.randn(2, 2, 64, generator=gen)
    args = (
        torch.tensor([24, 16], dtype=torch.int32),
        torch.arange(4, dtype=torch.int32).repeat(2, 1),
    )
    got = torch.ops.laneserve.paged_decode_attention(q, k, v, *args, 0.125)
    assert got[0].isnan().all() and not got[1].isnan().any()  # row 1 reads tokens 0-15 only


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_at_the_ends_of_the_float_range(dtype):
    """Past the polynomial exp's clamp the gate still gives the reference's silu (-0, NaN, g)."""
    g = torch.tensor([-3e38, -1e3, -100.0, -float("inf"), 100.0, 3e38, float("inf")], dtype=dtype)
    x = torch.cat([g, torch.ones_like(g)])[None]
    got, want = kernels.silu_and_mul(x), reference.silu_and_mul(x)
    torch.testing.assert_close(got, want, equal_nan=True, atol=1e-30, rtol=1e-6)


def _cos_sin(max_pos: int, rot_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, rot_dim, 2).float() / rot_dim)
    freqs = torch.outer(torch.arange(max_pos).float(), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("hq", "hk", "dim", "rot_dim"), [(9, 3, 64, 64), (4, 4, 32, 16)])
def test_rope_and_cache_equals_rotary_then_cache_write(dtype, hq, hk, dim, rot_dim, gen):
    tokens, block_size = 6, 4
    qkv = torch.randn(tokens, (hq + 2 * hk) * dim, generator=gen).to(dtype)
    positions = torch.tensor([0, 5, 17, 299, 3, 40])
    slots = torch.tensor([3, 9, -1, 20, 0, 31])  # one padded token writes nothing
    cos_sin = _cos_sin(300, rot_dim)
    shape = (2, 8, block_size, hk, dim)
    fast, slow = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)

    q = kernels.rope_and_cache(qkv, positions, cos_sin, fast[0], fast[1], slots, hq, hk)
    with pytest.MonkeyPatch.context() as mp:  # the composed PyTorch path, as without the build
        mp.setitem(cpu_ext._state, "ok", False)
        q_ref = kernels.rope_and_cache(qkv, positions, cos_sin, slow[0], slow[1], slots, hq, hk)
    assert q.shape == (tokens, hq, dim)
    assert torch.equal(q, q_ref)  # the same products and sums, rounded the same way
    assert torch.equal(fast, slow)
    assert int((fast[0] != 0).any(-1).any(-1).sum()) == tokens - 1


def test_rope_and_cache_rejects_bad_input(gen):
    qkv = torch.randn(2, (4 + 2 * 2) * 32, generator=gen)
    cache = torch.zeros(2, 4, 4, 2, 32)
    cos_sin = _cos_sin(10, 32)
    args = (cos_sin, cache[0], cache[1], torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="position 10 outside"):
        kernels.rope_and_cache(qkv, torch.tensor([1, 10]), *args, 4, 2)
    with pytest.raises(ValueError, match="wide"):
        kernels.rope_and_cache(qkv, torch.tensor([1, 2]), *args, 4, 1)
    with pytest.raises(RuntimeError, match="slot 16 outside"):
        kernels.rope_and_cache(
            qkv, torch.tensor([1, 2]), cos_sin, cache[0], cache[1], torch.tensor([0, 16]), 4, 2
        )


def test_decode_attention_rejects_a_block_id_outside_the_pool():
    q = torch.randn(1, 4, 32)
    cache = torch.randn(3, 8, 2, 32)
    with pytest.raises(RuntimeError, match="block id 3 outside"):
        torch.ops.laneserve.paged_decode_attention(
            q,
            cache,
            cache,
            torch.tensor([9], dtype=torch.int32),
            torch.tensor([[0, 3]], dtype=torch.int32),
            0.1,
        )


def test_batch1_decode_step_dispatches_at_most_400_ops(smollm2_dir):
    """Issue target: <= 400 ops dispatched from Python per batch-1 decode step (was ~2,750)."""
    from laneserve.gpu_worker.model_loader import load_model_files
    from laneserve.gpu_worker.model_runner import ModelRunner
    from laneserve.gpu_worker.models.llama import LlamaForCausalLM

    loaded = load_model_files(smollm2_dir)
    model = LlamaForCausalLM(loaded.config, loaded.weights, torch.bfloat16, "cpu")
    runner = ModelRunner(model, block_size=16, num_blocks=40)
    inputs = runner.prepare_inputs([[1, 2, 3, 4, 5]], [0], [[0]], [True])
    runner.execute(inputs)
    step = runner.prepare_inputs([[6]], [5], [[0]], [True])
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        logits = runner.execute(step)
    ops = [e for e in prof.events() if e.name.startswith(("aten::", "laneserve::"))]
    ids = {e.id for e in ops}
    top = [e.name for e in ops if e.cpu_parent is None or e.cpu_parent.id not in ids]
    layers = loaded.config.num_hidden_layers
    assert top.count("laneserve::paged_decode_attention") == layers
    assert len(top) <= 400, f"{len(top)} ops per decode step"
    assert logits.shape == (1, loaded.config.vocab_size) and torch.isfinite(logits).all()


def test_cpp_ops_reject_mismatched_shapes_instead_of_reading_past_them():
    L = torch.ops.laneserve
    kc = torch.zeros(4, 16, 2, 32)
    sl, bt = torch.tensor([5], dtype=torch.int32), torch.zeros(1, 4, dtype=torch.int32)
    bad_attention = [
        (torch.zeros(1, 5, 32), kc, kc),  # 5 query heads over 2 KV heads
        (torch.zeros(1, 4, 64), kc, kc),  # head dim 64 against a cache of 32
        (torch.zeros(1, 4, 32), kc, torch.zeros(1, 16, 2, 32)),  # a smaller v_cache
    ]
    for q, k, v in bad_attention:
        with pytest.raises(RuntimeError):
            L.paged_decode_attention(q, k, v, sl, bt, 0.1)
    x = torch.zeros(3, 64)
    with pytest.raises(RuntimeError, match="weight"):
        L.rms_norm(x, torch.ones(8), 1e-5)
    with pytest.raises(RuntimeError, match="residual"):
        L.fused_add_rms_norm(x, torch.zeros(1, 64), torch.ones(64), 1e-5)
    with pytest.raises(RuntimeError):
        L.silu_and_mul(torch.zeros(2, 7))
    pos, slots = torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long)
    with pytest.raises(RuntimeError, match="rot"):  # cos/sin wider than the head dim
        L.rope_and_cache(torch.zeros(1, 6 * 32), pos, torch.zeros(8, 64), kc, kc, slots, 2, 2)
    with pytest.raises(RuntimeError, match="num_kv_heads"):  # 1 KV head against a cache of 2
        L.rope_and_cache(torch.zeros(1, 3 * 32), pos, torch.zeros(8, 32), kc, kc, slots, 1, 1)


def test_step_ops_go_straight_to_cpp_and_equal_the_checked_ops(smollm2_dir, monkeypatch):
    """kernels.step_ops checks a step's tensors once and hands the model the C++ ops directly
    (the in-place decode kernel for a pure decode step); logits equal the checked path's."""
    from laneserve.gpu_worker.model_loader import load_model_files
    from laneserve.gpu_worker.model_runner import ModelRunner
    from laneserve.gpu_worker.models.llama import LlamaForCausalLM

    loaded = load_model_files(smollm2_dir)
    model = LlamaForCausalLM(loaded.config, loaded.weights, torch.bfloat16, "cpu")
    runners = [ModelRunner(model, block_size=16, num_blocks=40) for _ in range(2)]
    prompts, tables = [[1, 2, 3, 4, 5], [7, 8, 9]], [[0], [1]]
    seen = []
    original = kernels.step_ops

    def recording(*args):
        seen.append(original(*args))
        return seen[-1]

    def run(runner):
        prefill = runner.execute(runner.prepare_inputs(prompts, [0, 0], tables, [True, True]))
        decode = runner.execute(runner.prepare_inputs([[6], [10]], [5, 3], tables, [True, True]))
        return prefill, decode

    monkeypatch.setattr(kernels, "step_ops", recording)
    fused = run(runners[0])
    assert seen[0] is kernels._FUSED_OPS and seen[1] is kernels._FUSED_DECODE_OPS
    monkeypatch.setattr(kernels, "step_ops", lambda *args: kernels._CHECKED_OPS)
    checked = run(runners[1])
    for a, b in zip(fused, checked, strict=True):
        assert torch.equal(a, b)
    x = torch.zeros(3, model.config.hidden_size, dtype=torch.bfloat16)
    cache = runners[0].kv_views[0]
    layout = (
        torch.zeros(3, dtype=torch.int32),  # int32 positions: the C++ op takes int64 only
        torch.zeros(3, dtype=torch.int64),
        model.cos_sin_cache,
        torch.ones(3, dtype=torch.int32),
        torch.zeros(3, 1, dtype=torch.int32),
    )
    assert original(x, model.norm, cache[0], cache[1], *layout) is kernels._CHECKED_OPS


def test_a_build_lock_left_by_a_killed_build_does_not_block_loading():
    """torch's lock file outlives a build killed half-way; loading must not wait on it forever."""
    stale = cpu_ext.build_directory() / "lock"
    stale.write_text("")
    code = "from laneserve.kernels import cpu_ext; assert cpu_ext.load()"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=300)
    assert not stale.exists()


def test_an_unbuilt_extension_compiles_in_the_background_without_blocking(tmp_path):
    """On a machine where the extension is not built yet (a fresh extension root here), the
    worker's start asks for it in the background: `load()` answers False at once while the
    compiler runs (the ops take the PyTorch path), so the first tokens do not wait minutes; a
    failed build leaves the PyTorch path in place."""
    code = """if True:
        import threading
        import time
        from laneserve.kernels import cpu_ext
        assert cpu_ext.is_built() is False
        t0 = time.perf_counter()
        assert cpu_ext.load_or_build_in_background() is False
        assert cpu_ext.load() is False and cpu_ext._background.is_set()
        assert time.perf_counter() - t0 < 5, "the build must not block the caller"
        assert cpu_ext.load_or_build_in_background() is False  # one build thread, not two
        builds = [t for t in threading.enumerate() if t.name == "cpu-ext-build"]
        assert len(builds) == 1
        builds[0].join(120)  # CXX=false: the build fails at once
        assert cpu_ext.load() is False and not cpu_ext._background.is_set()
        print("ok")
    """
    env = {
        **os.environ,
        "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
        "XDG_CACHE_HOME": str(tmp_path),  # torch's extension root: an empty one
        "CXX": "false",  # a compiler that fails at once: no build outlives the test
    }
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    assert cpu_ext.is_built()  # this process's build is unaffected


@pytest.mark.parametrize(
    ("batch", "vocab", "rows", "words"),
    [(64, 49152, list(range(64)), 1536), (5, 49155, [0, 2, 4], 1536), (4, 70, [3, 1], 3),
     (3, 100, [1], 4)],
)  # fmt: skip
def test_grammar_bitmask_op_equals_the_torch_path(gen, batch, vocab, rows, words):
    """`apply_token_bitmask_` (C++, in place) forbids exactly the tokens the torch path does: clear
    bits, a last word's ids past the vocabulary, ids past a bitmask narrower than the vocabulary
    (49155 ids, 1536 words), only the mask's rows; a word of all ones leaves its 32 tokens."""
    from laneserve.gpu_worker.structured_output import (
        GrammarMask,
        apply_token_bitmask,
        apply_token_bitmask_torch,
    )

    logits = torch.randn(batch, vocab, generator=gen).to(torch.bfloat16)
    bits = torch.randint(-(2**31), 2**31 - 1, (len(rows), words), generator=gen, dtype=torch.int32)
    bits[0, 0] = -1  # every token of the first word allowed
    mask = GrammarMask(rows, bits)
    fast = apply_token_bitmask(logits, mask)
    expect = apply_token_bitmask_torch(logits.to(torch.float32, copy=True), mask)
    assert torch.equal(fast, expect)
    assert torch.isinf(fast).any() and not torch.isinf(fast[rows[0], :32]).any()
    untouched = [b for b in range(batch) if b not in rows]
    assert torch.equal(fast[untouched], logits[untouched].float())
