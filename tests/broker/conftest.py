"""Broker/worker test fixtures: real processes on ipc:// sockets in a short temp directory."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness import Stack


@pytest.fixture
def stack() -> Iterator[Stack]:
    tmp = Path(tempfile.mkdtemp(prefix="lsb", dir="/tmp"))
    s = Stack.for_broker(tmp)
    try:
        yield s
    finally:
        s.stop()
        shutil.rmtree(tmp, ignore_errors=True)
