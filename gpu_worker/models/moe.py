"""The sparse MoE block of Mixtral and Qwen3-MoE: a router and `num_experts` SwiGLU experts.

A decoder layer whose index is in `ModelConfig.moe_layers` runs this block instead of its dense MLP
(`models/llama.py`). Routing is transformers' (`kernels.moe.route`: float32 softmax over every
expert, `torch.topk`, renormalized with `norm_topk_prob`). The experts run grouped by expert
(`kernels.moe.grouped_experts`: one GEMM per active expert and weight per step) over each
expert's own linears, dense or quantized (`QuantLinear` int8/int4, GGUF Q4_0/Q8_0 blocks), or, for
dense weights where the kernels' backend is Triton (CUDA, or `LANESERVE_ATTENTION_BACKEND=triton`),
as the Triton fused-MoE kernel over the experts' stacked weights.

Checkpoint layouts read (per layer prefix `model.layers.{i}.`):
- Mixtral: `block_sparse_moe.gate.weight` [E, H], `block_sparse_moe.experts.{e}.w1|w3|w2.weight`
  (gate, up, down);
- Qwen3-MoE: `mlp.gate.weight`, `mlp.experts.{e}.gate_proj|up_proj|down_proj.weight`;
- fused 3-D experts as transformers 5 holds them in memory: `{block}.experts.gate_up_proj`
  [E, 2I, H] and `{block}.experts.down_proj` [E, H, I].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from laneserve import kernels
from laneserve.gpu_worker import quantization as quant
from laneserve.gpu_worker.errors import ModelLoadError
from laneserve.gpu_worker.quantization import QuantLinear
from laneserve.kernels import moe as moe_ops

if TYPE_CHECKING:
    from laneserve.gpu_worker.model_config import ModelConfig
    from laneserve.gpu_worker.models.checkpoint import WeightReader

Linear = torch.Tensor | QuantLinear

# per-expert names: (gate, up, down)
_EXPERT_NAMES = (("w1", "w3", "w2"), ("gate_proj", "up_proj", "down_proj"))


@dataclass(slots=True)
class MoEWeights:
    """One layer's router and experts.

    gate: router [E, H] (dense, activation dtype)
    gate_up: per expert [2I, H] = cat(gate, up), dense or quantized
    down: per expert [H, I]
    w13, w2: the dense experts stacked ([E, 2I, H], [E, H, I]; `gate_up` / `down` are views of
        them), None when the experts are quantized
    """

    gate: torch.Tensor
    gate_up: list[Linear]
    down: list[Linear]
    w13: torch.Tensor | None
    w2: torch.Tensor | None
    top_k: int
    renormalize: bool

    def linears(self) -> list[Linear]:
        return [*self.gate_up, *self.down]

    def nbytes(self) -> int:
        if self.w13 is not None:
            parts = [self.gate, self.w13, self.w2]
        else:
            parts = [self.gate, *self.linears()]
        return sum(quant.nbytes(t) for t in parts)


def _block_prefix(w: WeightReader, p: str) -> str:
    """`model.layers.{i}.block_sparse_moe.` (Mixtral) or `model.layers.{i}.mlp.`."""
    for block in ("block_sparse_moe.", "mlp."):
        if p + block + "gate.weight" in w.weights:
            return p + block
    raise ModelLoadError(
        f"weight {p}block_sparse_moe.gate.weight (or {p}mlp.gate.weight) is missing: "
        "the MoE router of this layer"
    )


def _expert_parts(w: WeightReader, b: str, e: int, h: int, inter: int, num: int):
    """Expert `e`'s (gate, up, down) weights from per-expert tensors or the fused 3-D ones."""
    fused = b + "experts.gate_up_proj"
    if fused in w.weights:
        gate_up = w.raw(fused, (num, 2 * inter, h))[e]
        down = w.raw(b + "experts.down_proj", (num, h, inter))[e]
        return [gate_up[:inter], gate_up[inter:]], down
    names = next(
        (n for n in _EXPERT_NAMES if f"{b}experts.{e}.{n[0]}.weight" in w.weights),
        _EXPERT_NAMES[0],
    )
    gate, up, down = (f"{b}experts.{e}.{n}.weight" for n in names)
    return [w.raw(gate, (inter, h)), w.raw(up, (inter, h))], w.raw(down, (h, inter))


def load_moe(w: WeightReader, config: ModelConfig, i: int) -> MoEWeights:
    """Layer `i`'s MoE block.

    Raises:
        ModelLoadError: a weight is missing or has the wrong shape (the message names it).
    """
    h, inter, num = config.hidden_size, config.moe_intermediate_size, config.num_experts
    b = _block_prefix(w, f"model.layers.{i}.")
    gate = w.take(b + "gate.weight", (num, h))
    gate_up, down = [], []
    for e in range(num):
        parts, down_part = _expert_parts(w, b, e, h, inter, num)
        name = f"{b}experts.{e}"
        gate_up.append(quant.build_linear(name, parts, *w.build_args))
        down.append(quant.build_linear(name, [down_part], *w.build_args))
    w.drop([name for name in w.weights if name.startswith(b + "experts.")])
    w13 = w2 = None
    if all(isinstance(t, torch.Tensor) for t in gate_up + down):
        w13 = torch.stack(gate_up).to(w.device)
        w2 = torch.stack(down).to(w.device)
        gate_up, down = list(w13.unbind(0)), list(w2.unbind(0))
    return MoEWeights(
        gate, gate_up, down, w13, w2, config.num_experts_per_tok, config.norm_topk_prob
    )


def forward(h: torch.Tensor, m: MoEWeights, silu_and_mul) -> torch.Tensor:
    """The block's output [T, H] for the normed hidden states `h` [T, H]."""
    weights, ids = moe_ops.route(h, m.gate, m.top_k, m.renormalize)
    if m.w13 is not None and kernels.backend_for(h) == "triton":
        return moe_ops.fused_moe(h, m.w13, m.w2, weights, ids)

    def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
        return quant.linear(silu_and_mul(quant.linear(rows, m.gate_up[e])), m.down[e])

    return moe_ops.grouped_experts(h, weights, ids, len(m.gate_up), expert)
