"""Fixtures for the whole-stack tests: a LANESERVE_HOME with the bundled model linked in, so no
test downloads or converts it again."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.harness import link_model


@pytest.fixture(scope="module")
def model_home(tmp_path_factory, smollm2_dir, smollm2_gguf) -> Path:
    home = tmp_path_factory.mktemp("lsstack")
    link_model(home, smollm2_gguf, smollm2_dir)
    return home
