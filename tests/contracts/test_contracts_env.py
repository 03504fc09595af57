"""The environment registry (contracts.env): parsing, defaults, errors, and no stray reads."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from laneserve.contracts import env

ROOT = Path(__file__).resolve().parents[2]
PRODUCT_PACKAGES = (
    "contracts",
    "broker",
    "gpu_worker",
    "kernels",
    "jobs",
    "db",
    "dashboard",
    "laneserve",
)


def test_home_default_and_expanduser():
    assert env.laneserve_home({}) == Path.home() / ".laneserve"
    assert env.laneserve_home({"LANESERVE_HOME": "~/x"}) == Path.home() / "x"
    assert env.laneserve_home({"LANESERVE_HOME": "  "}) == Path.home() / ".laneserve"


def test_typed_values_and_defaults():
    assert env.get("LANESERVE_MALLOC_TUNING", {}) is True
    assert env.get("LANESERVE_MALLOC_TUNING", {"LANESERVE_MALLOC_TUNING": "0"}) is False
    assert env.get("LANESERVE_RETENTION_DAYS", {"LANESERVE_RETENTION_DAYS": "2.5"}) == 2.5
    assert env.get("LANESERVE_DB_URL", {}) is None


def test_bad_value_is_a_clear_error():
    with pytest.raises(env.EnvError, match="LANESERVE_CPU_SINGLE_THREAD_TOKENS='many'"):
        env.get(
            "LANESERVE_CPU_SINGLE_THREAD_TOKENS", {"LANESERVE_CPU_SINGLE_THREAD_TOKENS": "many"}
        )


def test_unregistered_name_is_refused():
    with pytest.raises(KeyError):
        env.get("LANESERVE_NOT_A_THING", {})


def _environ_reads(tree: ast.AST) -> set[str]:
    """What os.environ.get / os.getenv / os.environ[...] loads read (the name, or its expression)."""
    names = set()
    for node in ast.walk(tree):
        target = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if ast.unparse(node.func) in ("os.environ.get", "os.getenv") and node.args:
                target = node.args[0]
        elif isinstance(node, ast.Subscript) and ast.unparse(node.value) == "os.environ":
            if isinstance(node.ctx, ast.Load):
                target = node.slice
        if target is not None:
            names.add(ast.unparse(target))
    return names


def test_product_code_reads_the_environment_only_through_the_registry():
    stray = {}
    for package in PRODUCT_PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if path.parts[-2:] == ("contracts", "env.py"):
                continue
            names = _environ_reads(ast.parse(path.read_text()))
            if names:
                stray[str(path.relative_to(ROOT))] = sorted(names)
    assert stray == {}, f"read these through contracts.env instead: {stray}"
