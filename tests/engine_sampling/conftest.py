"""Fixtures for the sampling/text tests: the real SmolLM2 tokenizer, loaded once per session."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tokenizer(smollm2_dir):
    """The bundled SmolLM2-135M-Instruct tokenizer (byte-level BPE, transformers fast tokenizer)."""
    from laneserve.gpu_worker.model_loader import load_tokenizer

    return load_tokenizer(smollm2_dir)
