"""kernels.cuda_graphs: ladder selection, input staging/padding, and the CPU (disabled) path.

Capture and replay need a GPU; they run in scripts/bench_kernels.py.
"""

from __future__ import annotations

import pytest
import torch

from laneserve.kernels.cuda_graphs import DecodeGraphs, StaticInput, default_ladder, pick_batch_size

INPUTS = [
    StaticInput("input_ids", (), torch.int64),
    StaticInput("slot_mapping", (), torch.int64, pad=-1),
    StaticInput("cu_seqlens_q", (), torch.int32, pad="arange", extra_rows=1),
    StaticInput("block_tables", (4,), torch.int32, pad=0),
]


def _step(input_ids, slot_mapping, cu_seqlens_q, block_tables):
    return input_ids * 10 + block_tables.sum(1)


def test_ladder_and_pick():
    assert default_ladder(20) == [1, 2, 4, 8, 16, 20]
    assert default_ladder(3) == [1, 2, 3]
    assert pick_batch_size([1, 2, 4, 8], 3) == 4
    assert pick_batch_size([1, 2, 4, 8], 8) == 8
    assert pick_batch_size([1, 2, 4, 8], 9) is None
    with pytest.raises(ValueError):
        default_ladder(0)


def test_stage_pads_rows_and_columns():
    graphs = DecodeGraphs(_step, INPUTS, [1, 2, 4, 8], device="cpu", enabled=False)
    views = graphs.stage(
        4,
        input_ids=torch.tensor([7, 8, 9]),
        slot_mapping=torch.tensor([3, 4, 5]),
        cu_seqlens_q=torch.tensor([0, 1, 2, 3], dtype=torch.int32),
        block_tables=torch.tensor([[1, 2], [3, 4], [5, 6]], dtype=torch.int32),
    )
    assert views["input_ids"].tolist() == [7, 8, 9, 0]
    assert views["slot_mapping"].tolist() == [3, 4, 5, -1]  # padded rows write no KV
    assert views["cu_seqlens_q"].tolist() == [0, 1, 2, 3, 4]
    assert views["block_tables"].tolist() == [[1, 2, 0, 0], [3, 4, 0, 0], [5, 6, 0, 0], [0] * 4]
    with pytest.raises(ValueError, match="block_tables"):
        graphs.stage(
            4,
            input_ids=torch.tensor([7]),
            slot_mapping=torch.tensor([3]),
            cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32),
            block_tables=torch.zeros(1, 5, dtype=torch.int32),
        )


def test_disabled_runs_eagerly_and_enabled_needs_cuda():
    graphs = DecodeGraphs(_step, INPUTS, [1, 2], device="cpu", enabled=False)
    graphs.capture()  # no-op when disabled
    out = graphs(
        input_ids=torch.tensor([1, 2]),
        slot_mapping=torch.tensor([0, 1]),
        cu_seqlens_q=torch.tensor([0, 1, 2], dtype=torch.int32),
        block_tables=torch.tensor([[1, 1], [2, 0]], dtype=torch.int32),
    )
    assert out.tolist() == [12, 22]
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA graphs need a CUDA device"):
            DecodeGraphs(_step, INPUTS, [1, 2], device="cpu", enabled=True)
