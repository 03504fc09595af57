"""Weights in the layouts of laneserve's C++ kernels (kernels/csrc/quant_gemv.cpp GEMVs,
kernels/csrc/amx_matmul.cpp AMX matmuls): `GemvBlocks`, the block orders the built kernels read
(`int4_block_order`, `q8_0_block_order`, `amx_order`), and when those kernels take a call
(`amx_usable`, `amx_takes`, `gemv_takes_bf16`, `BF16_GEMV_MIN_TOKENS`). gpu_worker/quantization.py
routes each linear's calls between them, torch's kernels and a dense copy (its module docstring).
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass

import torch

from laneserve.contracts import env
from laneserve.gpu_worker.gguf_blocks import (
    GROUP_SIZE,
    GGUFQuantTensor,
    Int4Groups,
    q8_0_arrays,
    q8_0_values,
)
from laneserve.gpu_worker.hardware import cpu_flags
from laneserve.gpu_worker.kernel_routes import AMX_MAX_TOKENS, AMX_MIN_TOKENS, BF16_GEMV_MIN_TOKENS  # noqa: F401
from laneserve.kernels import cpu_ext


@dataclass(slots=True)
class GemvBlocks:
    """A weight in the layout of the C++ GEMVs (kernels/csrc/quant_gemv.cpp). float32 activations
    are rounded by the kernel to int16 per 32-element group; bf16 ones are multiplied as they are
    with the weights rounded to bf16 where the CPU has AVX512-BF16 (`gemv_takes_bf16`), else
    read as float32 (exact) through the int16 path, the result rounded once to bf16.

    int4: qs uint8 [N, K/2] (ggml's nibble order while `block_groups` is 1; `prepare` reorders
    them into the blocks of groups the built kernel reads, `int4_block_order`), scale and offset
    float32 [N, K/32] with W = q * scale + offset (the GGUF's own d and m: no bf16 rounding);
    q8_0: qs int8 [N, K], scale float32 [N, K/32] (the Q8_0 blocks, exact), offset None. A
    tied LM head's blocks (`QuantLinear.read_q8_0_blocks` sets `block_copy`) get, where the kernel
    was built for AVX-512BW, `qs_blocks` from `prepare`: the same weights in blocks of 16 groups
    (`q8_0_block_order`) for the int16 path, beside `qs` (the embedding's own array, and what
    the bf16 path reads): 1.0 more byte per weight (28 MB for SmolLM2's head) for 0.7-0.9x
    the int16 path's time on that head from 4 rows up (whole bf16 decode steps of 2-8 rows
    0.94-0.99x on a 2-core Zen 4, docs/benchmarks.md Run 15). Other Q8_0 blocks keep the
    GGUF's order only (a copy would double them).
    """

    kind: str  # "int4" | "q8_0"
    qs: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None = None
    block_groups: int = 1  # int4: the order qs is in (1: the GGUF's)
    block_copy: bool = False  # q8_0: `prepare` adds `qs_blocks` (a tied LM head's)
    qs_blocks: torch.Tensor | None = None  # q8_0: qs in `q8_0_block_order` (after `prepare`)
    # where the AMX matmuls run (`amx_usable`): the same weights in their layout (`amx_order`),
    # added by `prepare`; bf16 calls of `AMX_MIN_TOKENS` to `AMX_MAX_TOKENS` rows read them
    amx_qs: torch.Tensor | None = None
    amx_scale: torch.Tensor | None = None
    # whether `prepare` adds the AMX copy: set by the builders for a bf16 model's linears only,
    # so no other model holds a copy no call reads (scripts/bench_quant.py's `noamx` clears it)
    use_amx: bool = False

    @staticmethod
    def from_int4(groups: Int4Groups) -> GemvBlocks:
        n, k = groups.q.shape
        q = groups.q.reshape(n, k // GROUP_SIZE, GROUP_SIZE)
        qs = (q[..., :16] | (q[..., 16:] << 4)).reshape(n, k // 2).contiguous()
        offset = groups.zero - 8.0 * groups.scale  # (q - 8) * s + z = q * s + (z - 8 s)
        return GemvBlocks("int4", qs, groups.scale.contiguous(), offset.contiguous())

    @staticmethod
    def from_q8_0(parts: list[GGUFQuantTensor]) -> GemvBlocks:
        qs, d = zip(*(q8_0_arrays(p) for p in parts), strict=True)
        return GemvBlocks("q8_0", torch.cat(qs).contiguous(), torch.cat(d).contiguous())

    def nbytes(self) -> int:
        tensors = (self.qs, self.scale, self.offset, self.qs_blocks, self.amx_qs, self.amx_scale)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def dequantize_rows(self, r0: int, r1: int) -> torch.Tensor:
        """Rows r0..r1 of a q8_0 weight as float32 (exact: the GGUF's values), for the tile route
        of a linear without a dense copy (`QuantLinear.tiled`)."""
        assert self.kind == "q8_0", self.kind
        return q8_0_values(self.qs[r0:r1], self.scale[r0:r1])

    def prepare(self) -> None:
        """Reorder int4 weights into the order the built kernel reads, or add the block-order
        copy of Q8_0 ones (once; needs `kernels.cpu_ext.load()`). The model runner calls it ahead
        of the first step (`LlamaForCausalLM.prepare_gemv_blocks`) when the kernels are built; a
        worker that builds them in the background reorders each linear on its first call after
        they load (SmolLM2's 120 int4 linears: ~0.5 s in all on 2 cores, once). Where the AMX
        matmuls run, every block first gets its `amx_order` copy (read from the GGUF's order)."""
        if self.use_amx and self.amx_qs is None and self.qs.shape[0] % 16 == 0 and amx_usable():
            with _PREPARE_LOCK:
                if self.amx_qs is None and (self.kind == "q8_0" or self.block_groups == 1):
                    qa, sa = amx_order(self.kind, self.qs, self.scale, self.offset)
                    self.amx_scale = sa
                    self.amx_qs = qa  # last: a set `amx_qs` means the copy is whole
        if self.kind == "q8_0":
            if self.block_copy and self.qs_blocks is None and q8_0_kernel_block_groups() > 1:
                with _PREPARE_LOCK:
                    if self.qs_blocks is None:
                        self.qs_blocks = q8_0_block_order(self.qs)
            return
        want = int4_kernel_block_groups()
        if self.block_groups == want:
            return
        with _PREPARE_LOCK:
            if self.block_groups != want:
                if self.block_groups != 1:
                    raise ValueError(f"int4 blocks of {self.block_groups} groups, need {want}")
                self.qs = int4_block_order(self.qs)
                self.block_groups = want

    def takes_amx(self, x: torch.Tensor) -> bool:
        """Whether a call on `x` runs the AMX matmul (`amx_takes`, and the blocks have their AMX
        copy, which `prepare` adds where the matmuls run; needs `kernels.cpu_ext.load()`)."""
        if not amx_takes(x.shape[0], x.dtype):
            return False
        self.prepare()
        return self.amx_qs is not None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x float32 or bf16 [M, K], contiguous -> [M, N] in x's dtype (needs
        `kernels.cpu_ext.load()`)."""
        if self.kind == "int4":
            self.prepare()
            if self.amx_qs is not None and amx_takes(x.shape[0], x.dtype):
                return torch.ops.laneserve.int4_amx(x, self.amx_qs, self.amx_scale)
            return torch.ops.laneserve.int4_gemv(
                x, self.qs, self.scale, self.offset, self.block_groups
            )
        self.prepare()
        if self.amx_qs is not None and amx_takes(x.shape[0], x.dtype):
            return torch.ops.laneserve.q8_0_amx(x, self.amx_qs, self.amx_scale)
        if self.qs_blocks is not None and not (
            x.dtype == torch.bfloat16 and x.shape[0] >= BF16_GEMV_MIN_TOKENS and gemv_takes_bf16()
        ):  # the int16 path (the bf16 one reads the GGUF's order)
            return torch.ops.laneserve.q8_0_gemv(x, self.qs_blocks, self.scale, Q8_0_BLOCK_GROUPS)
        return torch.ops.laneserve.q8_0_gemv(x, self.qs, self.scale, 1)


_PREPARE_LOCK = threading.Lock()
INT4_BLOCK_GROUPS = 8  # the block order's groups per block (kInt4BlockGroups with AVX2)
Q8_0_BLOCK_GROUPS = 16  # the Q8_0 block order's (kQ8BlockGroups with AVX-512BW)


@functools.cache
def q8_0_kernel_block_groups() -> int:
    """16 where the built C++ GEMV's int16 path reads Q8_0 weights in `q8_0_block_order`
    (AVX-512BW), 1 (the GGUF's order only) elsewhere."""
    return int(torch.ops.laneserve.q8_0_gemv_block_groups())


def amx_usable() -> bool:
    """Whether the built C++ kernels run the AMX matmuls here: a CPU with AMX-BF16 (the build
    is ``-march=native``) whose kernel granted this process the tile state. False while the
    kernels are not built (asked again later), and with ``LANESERVE_AMX=0``."""
    if not cpu_ext.load():
        return False
    return _amx_granted()


@functools.cache
def _amx_granted() -> bool:
    return env.get("LANESERVE_AMX") and bool(torch.ops.laneserve.amx_usable())


def amx_takes(rows: int, dtype: torch.dtype) -> bool:
    """Whether a call of `rows` rows of `dtype` on blocks with an AMX copy runs the AMX matmul."""
    return dtype == torch.bfloat16 and AMX_MIN_TOKENS <= rows <= AMX_MAX_TOKENS


def amx_order(
    kind: str, qs: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """GEMV blocks (`GemvBlocks`, the GGUF's order; N a multiple of 16) in the AMX matmuls'
    layout (kernels/csrc/amx_matmul.cpp): (qa, sa). Tile row r of output block b and group g holds the
    pairs k = 32 g + 2 r, 2 r + 1 of outputs 16 b .. 16 b + 7 in its first half and of outputs
    16 b + 8 .. 16 b + 15 in its second (int4: low and high nibbles of the same 16 bytes)."""
    n, g = scale.shape
    nb = n // 16
    if kind == "int4":
        b = qs.view(n, g, 16)
        values = torch.cat([b & 15, b >> 4], dim=2)  # [N, G, 32]: q[n, 32 g + j]
        q = values.view(nb, 2, 8, g, 16, 2)  # block, half, output, group, row, pair
        qa = (q[:, 0] | (q[:, 1] << 4)).permute(0, 2, 3, 1, 4).reshape(nb, g, 16, 16)
        parts = [scale, offset]
    else:
        q = qs.view(nb, 2, 8, g, 16, 2)
        qa = q.permute(0, 3, 4, 1, 2, 5).reshape(nb, g, 16, 32)
        parts = [scale]
    sa = torch.cat([p.view(nb, 16, g).permute(0, 2, 1) for p in parts], dim=2)
    return qa.contiguous(), sa.float().contiguous()


def q8_0_block_order(qs: torch.Tensor) -> torch.Tensor:
    """Q8_0 weights int8 [N, K] from the GGUF's order into the kernel's block order: for each full
    block of 16 groups, 16 chunks of 32 bytes, byte i of chunk c holding element 2 c + i % 2 of
    the block's group i // 2, so that a chunk widens into int16 pairs that each belong to one
    group (kernels/csrc/quant_gemv.cpp); the last G % 16 groups as they were."""
    n, k = qs.shape
    full = k // GROUP_SIZE // Q8_0_BLOCK_GROUPS * Q8_0_BLOCK_GROUPS
    b = qs[:, : full * GROUP_SIZE].reshape(n, -1, Q8_0_BLOCK_GROUPS, GROUP_SIZE // 2, 2)
    blocks = b.permute(0, 1, 3, 2, 4).reshape(n, -1)  # [N, block, chunk c, group, element t]
    return torch.cat([blocks, qs[:, full * GROUP_SIZE :]], dim=1).contiguous()


@functools.cache
def int4_kernel_block_groups() -> int:
    """The int4 weight order the built C++ GEMV reads: 8 (`int4_block_order`) where it was built
    for AVX2 without AVX-512BW, 1 (the GGUF's) elsewhere."""
    return int(torch.ops.laneserve.int4_gemv_block_groups())


def int4_block_order(qs: torch.Tensor) -> torch.Tensor:
    """int4 weights uint8 [N, K/2] from the GGUF's nibble order (byte 16 g + j: elements j and
    16 + j of group g) into the kernel's block order: for each full block of 8 groups, 8 chunks
    of 16 bytes, byte i of chunk c holding element 2 c + i % 2 of the block's group i // 2 in its
    low nibble and element 2 (c + 8) + i % 2 in its high one, so that a chunk unpacks into lanes
    that each belong to one group (kernels/csrc/quant_gemv.cpp); the last G % 8 groups as they
    were."""
    n, half = qs.shape
    groups = half // (GROUP_SIZE // 2)
    full = groups // INT4_BLOCK_GROUPS * INT4_BLOCK_GROUPS
    b = qs[:, : full * GROUP_SIZE // 2].reshape(n, full, GROUP_SIZE // 2)
    q = torch.cat([b & 15, b >> 4], dim=2)  # [N, full, 32] in element order
    q = q.reshape(n, full // INT4_BLOCK_GROUPS, INT4_BLOCK_GROUPS, GROUP_SIZE // 2, 2)
    q = q.permute(0, 1, 3, 2, 4).reshape(n, -1, GROUP_SIZE // 2, 2 * INT4_BLOCK_GROUPS)
    chunks = GROUP_SIZE // 4  # element pairs (k) 0..7 in the low nibbles, 8..15 in the high
    blocks = q[:, :, :chunks] | (q[:, :, chunks:] << 4)  # [N, blocks, chunk c, byte i]
    return torch.cat([blocks.reshape(n, -1), qs[:, full * GROUP_SIZE // 2 :]], dim=1).contiguous()


def gemv_takes_bf16() -> bool:
    """Whether a bf16 model's int4 and Q8_0 linears get GEMV blocks, about 0.75 bytes per weight
    beside torch's int4 pack and the dense copy (SmolLM2's weights 396 -> 475 MB; on an AMX CPU
    the AMX copies, `amx_order`, add ~0.75 bytes per weight more: 504 -> 615 MB). On a CPU with
    AVX512-BF16 the kernel converts each weight group to bf16 once and runs one vdpbf16ps per
    group and row, so extra rows cost little (`BF16_GEMV_MIN_TOKENS` rows up: 5-row calls of the
    SmolLM2 linears took 0.47-0.74x the time of torch's int4 kernel, scripts/bench_quant.py;
    Q8_0 linears' fewer rows then run the int16 path instead of torch's int8 kernel). Elsewhere
    bf16 int4 calls stay on torch's kernel. The CPU flag decides, read at load time, when the
    extension may still be building; its ``-march=native`` build compiles the bf16 path for
    exactly these CPUs."""
    return "avx512_bf16" in cpu_flags()
