"""Kernel test setup: run Triton kernels in the interpreter on machines without a GPU.

TRITON_INTERPRET must be set before ``kernels.triton`` is imported (triton reads it when the
kernels are decorated), so it is set here, at collection time.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = (
    "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
)


@pytest.fixture
def device() -> str:
    """Device for kernel tests: CUDA when available (compiled Triton), else CPU (interpreted)."""
    return DEVICE


@pytest.fixture
def gen() -> torch.Generator:
    """A seeded CPU generator so every test draws the same inputs."""
    return torch.Generator().manual_seed(1234)
