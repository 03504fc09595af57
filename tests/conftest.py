"""Shared fixtures.

- `laneserve_home`: a fresh LANESERVE_HOME for one test (set in the environment).
- `smollm2_gguf`: the bundled SmolLM2-135M-Instruct GGUF, pulled and converted (as `model pull`
  does) once per machine into a shared cache (`LANESERVE_TEST_CACHE`, default `~/.cache/laneserve-test`) so tests don't re-download it.
- `pg_url`: a fresh PostgreSQL database per test session, from `LANESERVE_TEST_PG_URL` (a server
  URL such as `postgresql+psycopg://postgres@127.0.0.1:5432/postgres`).
- `chromium_path`: a headless-capable Chromium binary.
- `netns_rig`: a multi-host rig of network namespaces (tests/netns.py), removed afterwards.

Without PostgreSQL, Chromium or root (network namespaces) the tests that need them skip, unless
`LANESERVE_REQUIRE_ALL=1` (set by `.ci/run`), under which they fail.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads (see gpu_worker/__init__)
os.environ.setdefault("GOMP_SPINCOUNT", "0")  # many processes share 2 cores: never spin


def _no_cuda() -> bool:
    import torch

    return not torch.cuda.is_available()


# Triton kernels forced on CPU run interpreted; triton decides when a kernel is decorated, and some
# other import (transformers) may load triton before kernels.triton does, so decide here, first.
if _no_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")

REQUIRE_ALL = os.environ.get("LANESERVE_REQUIRE_ALL") == "1"


def skip_or_fail(reason: str) -> None:
    """Skip on a developer machine; fail under LANESERVE_REQUIRE_ALL=1 (CI)."""
    if REQUIRE_ALL:
        pytest.fail(f"LANESERVE_REQUIRE_ALL=1 but {reason}")
    pytest.skip(reason)


def test_cache_dir() -> Path:
    path = Path(os.environ.get("LANESERVE_TEST_CACHE") or Path.home() / ".cache" / "laneserve-test")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture
def laneserve_home(tmp_path, monkeypatch) -> Path:
    home = tmp_path / "lshome"
    home.mkdir()
    monkeypatch.setenv("LANESERVE_HOME", str(home))
    monkeypatch.delenv("LANESERVE_DB_URL", raising=False)
    return home


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    from laneserve.gpu_worker.model_files import pull_model
    from laneserve.gpu_worker.model_loader import convert_gguf

    old = os.environ.get("LANESERVE_HOME")
    os.environ["LANESERVE_HOME"] = str(test_cache_dir())
    try:
        path = pull_model("smollm2-135m")
        # The converted cache dir next to the GGUF holds the tokenizer.json that torch-free
        # processes (API, jobs runner) count tokens with (`laneserve model pull` writes it too),
        # and here the float32 weights the tests load as a Hugging Face directory.
        convert_gguf(path)
        return path
    finally:
        if old is None:
            os.environ.pop("LANESERVE_HOME", None)
        else:
            os.environ["LANESERVE_HOME"] = old


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_gguf) -> Path:
    """The bundled model converted once into a cached Hugging Face directory (fast loads)."""
    from laneserve.gpu_worker.model_loader import convert_gguf

    return convert_gguf(smollm2_gguf)


@pytest.fixture(scope="session")
def pg_server_url() -> str:
    url = os.environ.get("LANESERVE_TEST_PG_URL")
    if not url:
        skip_or_fail("no PostgreSQL server: LANESERVE_TEST_PG_URL is not set")
    return url


@contextlib.contextmanager
def fresh_pg_database(server_url: str) -> Iterator[str]:
    """A new, empty PostgreSQL database on `server_url` (its URL), dropped afterwards."""
    import sqlalchemy as sa

    name = f"laneserve_test_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(server_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    except Exception as exc:  # server down or refusing: skip (fail in CI)
        admin.dispose()
        skip_or_fail(f"cannot create a PostgreSQL database at {server_url}: {exc}")
    try:
        yield (
            sa.engine.make_url(server_url).set(database=name).render_as_string(hide_password=False)
        )
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture(scope="session")
def pg_url(pg_server_url) -> Iterator[str]:
    """A fresh, empty PostgreSQL database for this test session (dropped at the end)."""
    with fresh_pg_database(pg_server_url) as url:
        yield url


@pytest.fixture
def own_pg_url(pg_server_url) -> Iterator[str]:
    """A fresh, empty PostgreSQL database for one test, for tests that read global totals."""
    with fresh_pg_database(pg_server_url) as url:
        yield url


@pytest.fixture(scope="session")
def chromium_path() -> str:
    for candidate in (
        os.environ.get("LANESERVE_CHROMIUM"),
        "chromium",
        "chromium-browser",
        "google-chrome",
    ):
        if candidate and shutil.which(candidate):
            return shutil.which(candidate)
    skip_or_fail("no Chromium binary (install Debian's chromium or set LANESERVE_CHROMIUM)")


@pytest.fixture
def netns_rig():
    """A `tests.netns.NetRig` (needs root and iproute2), deleted with its namespaces after."""
    from tests.netns import NetRig, rig_missing

    reason = rig_missing()
    if reason:
        skip_or_fail(reason)
    with NetRig() as rig:
        yield rig
