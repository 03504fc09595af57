"""CUDA-graph capture of a decode step for a ladder of batch sizes (for the model runner).

A decode step launches hundreds of small kernels; on a GPU their launch overhead rivals the work.
:class:`DecodeGraphs` captures ``fn(**static_inputs)`` once per batch size in a ladder (vLLM's
approach: 1, 2, 4, then multiples of 8), and at run time copies the live inputs into the static
buffers of the smallest captured size that fits, pads the remaining rows with harmless values and
replays the graph. Batches larger than the ladder run eagerly.

Usage (model runner)::

    graphs = DecodeGraphs(
        lambda input_ids, positions, slot_mapping, cu_seqlens_q, seq_lens, block_tables:
            model(input_ids, positions, slot_mapping, cu_seqlens_q, seq_lens, block_tables),
        inputs=[
            StaticInput("input_ids", (), torch.int64),
            StaticInput("positions", (), torch.int64),
            StaticInput("slot_mapping", (), torch.int64, pad=-1),  # padded rows write nothing
            StaticInput("cu_seqlens_q", (), torch.int32, pad="arange", extra_rows=1),
            StaticInput("seq_lens", (), torch.int32, pad=1),
            StaticInput("block_tables", (max_blocks_per_seq,), torch.int32, pad=0),
        ],
        batch_sizes=default_ladder(max_num_seqs),
        device=torch.device("cuda"),
        enabled=use_cuda_graphs,          # False on CPU or with --enforce-eager
    )
    graphs.capture()                      # after the KV cache is allocated; no-op when disabled
    logits = graphs(input_ids=..., positions=..., ...)   # rows [:batch]; valid until the next call

The captured function must keep every tensor it reads outside the inputs (weights, KV cache) at a
fixed address, take no host-side decisions from input values, and return one tensor whose first
dimension is the batch. Kernels used inside must not sync with the host (``kernels.triton``'s don't).
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

__all__ = ["StaticInput", "DecodeGraphs", "default_ladder", "pick_batch_size"]


@dataclass(frozen=True, slots=True)
class StaticInput:
    """One graph input: ``[batch + extra_rows, *tail]`` of ``dtype``.

    ``pad`` fills rows past the live batch: a number, or ``"arange"`` (row index; what
    ``cu_seqlens_q`` of a pure-decode batch holds). Tail dimensions may be larger than the live
    tensor's (e.g. ``block_tables`` columns); the live values go in the leading corner.
    """

    name: str
    tail: tuple[int, ...]
    dtype: torch.dtype
    pad: int | float | str = 0
    extra_rows: int = 0


def default_ladder(max_batch_size: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, then every multiple of 8 up to ``max_batch_size``."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    sizes = [s for s in (1, 2, 4) if s <= max_batch_size]
    sizes += list(range(8, max_batch_size + 1, 8))
    if sizes[-1] != max_batch_size:
        sizes.append(max_batch_size)
    return sizes


def pick_batch_size(ladder: list[int], batch: int) -> int | None:
    """Smallest size in the sorted ``ladder`` that holds ``batch`` rows, or ``None`` if none does."""
    i = bisect.bisect_left(ladder, batch)
    return ladder[i] if i < len(ladder) else None


class DecodeGraphs:
    """Captures ``fn`` per batch size and replays it with padded static inputs (CUDA only).

    Args:
        fn: ``fn(**inputs) -> Tensor`` with the batch as the output's first dimension.
        inputs: the static inputs; the first one's rows (less its ``extra_rows``) give the batch.
        batch_sizes: the ladder to capture (see :func:`default_ladder`).
        device: where the static buffers live; must be CUDA when ``enabled``.
        enabled: ``False`` makes calls run ``fn`` eagerly on the given tensors (CPU, debugging).

    Raises:
        RuntimeError: ``enabled`` on a non-CUDA device or without CUDA.
        ValueError: an empty ladder or a non-positive batch size.
    """

    def __init__(
        self,
        fn: Callable[..., torch.Tensor],
        inputs: list[StaticInput],
        batch_sizes: list[int],
        device: torch.device | str = "cuda",
        enabled: bool = True,
    ) -> None:
        device = torch.device(device)
        if enabled and (device.type != "cuda" or not torch.cuda.is_available()):
            raise RuntimeError(
                f"CUDA graphs need a CUDA device, got {device}; pass enabled=False to run eagerly"
            )
        if not batch_sizes or min(batch_sizes) < 1:
            raise ValueError(f"batch_sizes must be positive, got {batch_sizes}")
        self.fn = fn
        self.inputs = {spec.name: spec for spec in inputs}
        self.ladder = sorted(set(batch_sizes))
        self.device = device
        self.enabled = enabled
        max_bs = self.ladder[-1]
        self.buffers = {
            spec.name: torch.zeros(
                (max_bs + spec.extra_rows, *spec.tail), dtype=spec.dtype, device=device
            )
            for spec in inputs
        }
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def stage(self, batch_size: int, **tensors: torch.Tensor) -> dict[str, torch.Tensor]:
        """Copy live ``tensors`` into the static buffers, pad rows up to ``batch_size``.

        Returns views ``[batch_size + extra_rows, *tail]`` of the static buffers.

        Raises:
            ValueError: a missing/unknown input, or a tensor larger than its buffer.
        """
        if set(tensors) != set(self.inputs):
            raise ValueError(f"expected inputs {sorted(self.inputs)}, got {sorted(tensors)}")
        views = {}
        for name, src in tensors.items():
            spec = self.inputs[name]
            view = self.buffers[name][: batch_size + spec.extra_rows]
            rows = src.shape[0]
            if src.dim() != view.dim() or rows > view.shape[0]:
                raise ValueError(
                    f"{name} of shape {tuple(src.shape)} does not fit buffer {tuple(view.shape)}"
                )
            if any(s > b for s, b in zip(src.shape[1:], view.shape[1:], strict=True)):
                raise ValueError(f"{name} of shape {tuple(src.shape)} exceeds tail {spec.tail}")
            if tuple(src.shape[1:]) != tuple(view.shape[1:]):
                view[:rows].fill_(0 if spec.pad == "arange" else spec.pad)
            view[(slice(0, rows), *(slice(0, s) for s in src.shape[1:]))].copy_(src)
            if rows < view.shape[0]:
                if spec.pad == "arange":
                    pad = torch.arange(rows, view.shape[0], device=view.device, dtype=view.dtype)
                    view[rows:] = pad.view(-1, *([1] * len(spec.tail)))
                else:
                    view[rows:].fill_(spec.pad)
            views[name] = view
        return views

    def capture(self, warmup_iters: int = 2) -> None:
        """Capture one graph per ladder size, largest first, sharing one memory pool.

        No-op when disabled. Call after the weights and KV cache are allocated.
        """
        if not self.enabled:
            return
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        for bs in reversed(self.ladder):
            views = {
                name: buf[: bs + self.inputs[name].extra_rows] for name, buf in self.buffers.items()
            }
            self._fill_padding(views)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(warmup_iters):
                    self.fn(**views)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bs] = self.fn(**views)
            self.graphs[bs] = graph
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs for batch sizes %s", self.ladder)

    def _fill_padding(self, views: dict[str, torch.Tensor]) -> None:
        for name, view in views.items():
            pad = self.inputs[name].pad
            if pad == "arange":
                idx = torch.arange(view.shape[0], device=view.device, dtype=view.dtype)
                view.copy_(idx.view(-1, *([1] * (view.dim() - 1))).expand_as(view))
            else:
                view.fill_(pad)

    def __call__(self, **tensors: torch.Tensor) -> torch.Tensor:
        """Run one step; returns rows ``[:batch]`` of the output (a view valid until the next call)."""
        name, spec = next(iter(self.inputs.items()))
        batch = tensors[name].shape[0] - spec.extra_rows
        bs = pick_batch_size(self.ladder, batch) if self.enabled else None
        if bs is None or bs not in self.graphs:
            return self.fn(**tensors)
        self.stage(bs, **tensors)
        self.graphs[bs].replay()
        return self.outputs[bs][:batch]
