"""API test fixtures: real broker, worker, recorder and gateway processes (module scope: the
gateway loads the SmolLM2 tokenizer at start-up, which takes seconds on a small CPU)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness import Stack, real_model_stack


@pytest.fixture(scope="module")
def synth_stack(smollm2_gguf, smollm2_dir) -> Iterator[Stack]:
    """Broker + recorder (SQLite) + one synthetic worker (interactive lane only, 10 ms steps,
    capacity 8) + gateway with an API key and the real SmolLM2 tokenizer."""
    tmp = Path(tempfile.mkdtemp(prefix="lsa", dir="/tmp"))
    home = tmp / "home"
    home.mkdir()
    stack = Stack.for_api(tmp, home)
    try:
        stack.start_recorder()
        stack.start_broker("--max-interactive-queue", "24", "--recorder", stack.recorder_addr)
        stack.start_worker(
            "synth", "--synthetic", "--capacity", "8", "--max-num-seqs", "8", lanes="interactive"
        )
        stack.start_api("--model", str(smollm2_gguf), "--served-model-name", "smollm2")
        stack.wait_workers({"synth"})
        stack.wait_api()
        yield stack
    finally:
        stack.stop()
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def real_stack(smollm2_gguf, smollm2_dir) -> Iterator[Stack]:
    """Broker + one real SmolLM2 worker (float32, up to 16 sequences) + gateway with a key."""
    with real_model_stack(smollm2_gguf) as stack:
        yield stack
