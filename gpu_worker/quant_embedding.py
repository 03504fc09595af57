"""Token embeddings of quantized checkpoints: a GGUF's Q8_0 table kept in its blocks
(`Q8Embedding`, exact lookups), K-quant ones (`kquant.KQuantEmbedding`), and the lookup the models
call (`embedding`). A tied LM head reads a `Q8Embedding`'s arrays (gpu_worker/quantization.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from laneserve.gpu_worker import kquant
from laneserve.gpu_worker.gguf_blocks import GGUFQuantTensor, dequantize, q8_0_arrays, q8_0_values


class Q8Embedding:
    """An embedding table kept in GGUF Q8_0 blocks; lookups are exact (fp16 scale x int8).

    qs: int8 [V, K]; d: float32 [V, K / 32]. 1.06 bytes per weight instead of 2 (bf16) or 4.
    """

    def __init__(self, t: GGUFQuantTensor, dtype: torch.dtype):
        assert t.qtype == "Q8_0", t.qtype
        self.qs, self.d = q8_0_arrays(t)
        self.dtype = dtype

    def nbytes(self) -> int:
        return self.qs.numel() + self.d.numel() * 4

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """ids int64 [T] -> [T, K] in `dtype`."""
        values = q8_0_values(self.qs.index_select(0, ids), self.d.index_select(0, ids))
        return values.to(self.dtype)


def build_embedding(
    table: torch.Tensor | GGUFQuantTensor, mode: str, dtype: torch.dtype
) -> torch.Tensor | Q8Embedding:
    """The token embedding: Q8_0 blocks stay quantized (exact lookups) unless `mode == "none"`."""
    if mode != "none" and isinstance(table, GGUFQuantTensor) and table.qtype == "Q8_0":
        return Q8Embedding(table, dtype)
    if mode != "none" and kquant.is_kquant(table):
        return kquant.KQuantEmbedding(table, dtype)
    dense = dequantize(table) if isinstance(table, GGUFQuantTensor) else table
    return dense.to(dtype).contiguous()


def embedding(ids: torch.Tensor, table: torch.Tensor | Q8Embedding) -> torch.Tensor:
    """F.embedding for a dense table, the blocks' lookup for a `Q8Embedding` / `KQuantEmbedding`."""
    if not isinstance(table, torch.Tensor):
        return table(ids)
    return F.embedding(ids, table)
