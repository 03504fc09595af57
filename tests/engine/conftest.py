from __future__ import annotations

import pytest

from laneserve.gpu_worker import LLM


@pytest.fixture(scope="session")
def make_llm(smollm2_dir):
    """Build an LLM on the bundled model in float32 (exactness) with small KV pools. The factory
    keeps no reference: an LLM lives as long as the test or fixture that holds it (the whole
    session's models kept alive together exhausted memory)."""

    def make(**kwargs) -> LLM:
        kwargs.setdefault("dtype", "float32")
        kwargs.setdefault("max_model_len", 1024)
        kwargs.setdefault("num_blocks", 1024 // kwargs.get("block_size", 16) * 8)
        return LLM(model=str(smollm2_dir), **kwargs)

    return make


@pytest.fixture(scope="session")
def base_llm(make_llm):
    return make_llm()


@pytest.fixture(autouse=True)
def _integrity_after(request):
    """check_integrity() holds after every test that ran an engine (DESIGN / issue 3)."""
    yield
    for name in ("base_llm", "llm"):
        if name in request.fixturenames:
            request.getfixturevalue(name).check_integrity()
