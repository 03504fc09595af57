"""One host-to-device upload per step for the varlen batch's index arrays.

A step's inputs are six small integer arrays built on the host (input ids, positions, slot
mapping, cu_seqlens_q, seq_lens, block tables, plus the logits indices). Copying each from
pageable memory costs a synchronous staging copy per array on CUDA. :class:`StepUploader` packs
them into one page-locked (pinned) byte buffer at 64-byte aligned offsets and sends it with one
``non_blocking`` copy; the device tensors are typed views into the uploaded bytes. Two host
buffers alternate, and a buffer is only rewritten after the CUDA event recorded behind its last
copy has completed, so a copy still in flight is never overwritten.

On the CPU the arrays are wrapped without a copy (``torch.from_numpy``), unless ``pack=True``
forces the packed path (tests use it to check the packing on machines without a GPU).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

ALIGN = 64  # bytes: every view starts at a multiple of any element size


def _layout(arrays: Sequence[np.ndarray]) -> tuple[list[int], int]:
    offsets, total = [], 0
    for a in arrays:
        offsets.append(total)
        total += -(-a.nbytes // ALIGN) * ALIGN
    return offsets, max(total, ALIGN)


class StepUploader:
    def __init__(self, device: torch.device, pack: bool | None = None) -> None:
        self.device = device
        self.pack = device.type != "cpu" if pack is None else pack
        self._pin = device.type == "cuda"
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._events: list[object | None] = [None, None]
        self._next = 0
        self.uploads = 0  # host-to-device copies issued (one per packed step)

    def upload(self, arrays: Sequence[np.ndarray]) -> list[torch.Tensor]:
        """Device tensors equal to ``arrays`` (same dtypes and shapes), in order."""
        arrays = [np.ascontiguousarray(a) for a in arrays]
        if not self.pack:
            return [torch.from_numpy(a).to(self.device) for a in arrays]
        offsets, total = _layout(arrays)
        i = self._next
        self._next = 1 - i
        if self._events[i] is not None:
            self._events[i].synchronize()  # the copy that last read this buffer has finished
        buf = self._buffers[i]
        if buf is None or buf.numel() < total:
            buf = torch.empty(2 * total, dtype=torch.uint8, pin_memory=self._pin)
            self._buffers[i] = buf
        host = buf.numpy()
        for a, off in zip(arrays, offsets, strict=True):
            host[off : off + a.nbytes] = a.reshape(-1).view(np.uint8)
        if self.device.type == "cuda":
            dev = buf[:total].to(self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._events[i] = event
        else:
            dev = buf[:total].to(self.device, copy=True)  # the host buffer is reused next step
        self.uploads += 1
        out = []
        for a, off in zip(arrays, offsets, strict=True):
            dtype = torch.from_numpy(a[:0]).dtype
            out.append(dev[off : off + a.nbytes].view(dtype).view(a.shape))
        return out
