"""From a checkpoint's tensors to a model's parameters: the one loader every family uses.

A loader (`model_loader`, `gguf_loader`) hands over a dict of tensors in Hugging Face naming. The
model asks for its parameters by our names (`qkv_proj`, `gate_up_proj`, ...: the fused linears
the forward runs); `LAYER_LINEARS[family]` says which checkpoint tensors make each one, in order,
so a family whose checkpoint stores them fused (Phi-3) or split (Llama) is a table row, not code.
Every tensor's shape is checked against the config before anything is built.
"""

from __future__ import annotations

import torch

from laneserve.gpu_worker import quantization as quant
from laneserve.gpu_worker.errors import ModelLoadError
from laneserve.gpu_worker.gguf_blocks import (
    GGUF_QUANT_TYPES,
    GGUFQuantTensor,
    dequantize,
    drop_file_pages,
)
from laneserve.gpu_worker.quantization import QuantLinear

Linear = torch.Tensor | QuantLinear

# our fused linear -> the checkpoint tensors (after `model.layers.{i}.`, without `.weight`) whose
# rows it concatenates; one name where the checkpoint already stores the fused matrix
_SPLIT = {
    "qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o_proj": ("self_attn.o_proj",),
    "gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "down_proj": ("mlp.down_proj",),
}
_FUSED = {**_SPLIT, "qkv_proj": ("self_attn.qkv_proj",), "gate_up_proj": ("mlp.gate_up_proj",)}
LAYER_LINEARS = {
    "llama": _SPLIT,
    "mistral": _SPLIT,
    "qwen2": _SPLIT,
    "qwen3": _SPLIT,
    "gemma3": _SPLIT,
    "phi3": _FUSED,
    "mixtral": _SPLIT,  # attention; the experts are read by `models.moe`
    "qwen3_moe": _SPLIT,  # attention and the dense MLP of `mlp_only_layers`
}


class WeightReader:
    """Takes a model's weights out of a loader's dict (Hugging Face naming), checking each one's
    shape, onto `device`: dense in `dtype` (`take`), or as (fused) linears in the quantization mode
    (`take_linear`, `take_layer_linear`).

    With `release` (the engine's load, which owns `weights`), the tensors of each layer linear
    leave `weights` once built (`drop`).

    Raises (every method):
        ModelLoadError: a weight is missing or has the wrong shape (the message names it).
    """

    def __init__(
        self,
        weights: dict[str, torch.Tensor | GGUFQuantTensor],
        dtype: torch.dtype,
        device: torch.device,
        quantization: str,
        family: str = "llama",
        release: bool = False,
    ):
        self.weights = weights
        self.release = release
        self.dtype = dtype
        self.device = device
        self.quantization = quantization
        self.linears = LAYER_LINEARS[family]
        # whether the model's Q8_0 linears may keep dense copies (`quant.dense_copies_fit`)
        self.dense_copies = quant.dense_copies_fit(weights, dtype)

    @property
    def build_args(self) -> tuple:
        """`quant.build_linear`'s arguments after the name and parts, for this model."""
        return self.quantization, self.dtype, self.device, self.dense_copies

    def raw(self, name: str, shape: tuple[int, ...]) -> torch.Tensor | GGUFQuantTensor:
        tensor = self.weights.get(name)
        if tensor is None:
            raise ModelLoadError(f"weight {name} is missing")
        if tuple(tensor.shape) != shape:
            raise ModelLoadError(f"weight {name} has shape {tuple(tensor.shape)}, expected {shape}")
        return tensor

    def take(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """A dense tensor in `dtype` (default: the model's)."""
        tensor = self.raw(name, shape)
        if isinstance(tensor, GGUFQuantTensor):
            tensor = dequantize(tensor)
        return tensor.to(device=self.device, dtype=dtype or self.dtype).contiguous()

    def take_linear(
        self, names: list[str], shapes: list[tuple[int, int]], q8_0_blocks=None
    ) -> Linear:
        """A (fused) linear of the checkpoint tensors `names` (`quant.build_linear`)."""
        parts = [self.raw(n, s) for n, s in zip(names, shapes, strict=True)]
        built = quant.build_linear(names[0], parts, *self.build_args, q8_0_blocks)
        return built.to(self.device) if isinstance(built, torch.Tensor) else built

    def take_layer_linear(self, prefix: str, param: str, rows: list[int], cols: int) -> Linear:
        """Our fused linear `param` [sum(rows), cols] of the layer at `prefix`, from the
        checkpoint's parts (`LAYER_LINEARS`): one tensor per entry of `rows`, or the fused one."""
        names = [f"{prefix}{name}.weight" for name in self.linears[param]]
        shapes = [(r, cols) for r in rows] if len(names) == len(rows) else [(sum(rows), cols)]
        linear = self.take_linear(names, shapes)
        self.drop(names)
        return linear

    def drop(self, names) -> None:
        """With `release`, forget the checkpoint tensors `names` once a parameter is built from
        them, so a part that the build copied (a fused or converted linear) is freed layer by
        layer instead of living beside the model until the load ends (peak RSS)."""
        if self.release:
            for name in names:
                tensor = self.weights.pop(name, None)
                if isinstance(tensor, GGUFQuantTensor) and tensor.qtype in GGUF_QUANT_TYPES:
                    drop_file_pages(tensor.blocks)  # built into arrays of their own
