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


def test_shared_defaults_are_declared_once_and_the_flags_read_them() -> None:
    """`laneserve broker` and `laneserve worker` flags default to `contracts.defaults` /
    `BrokerConfig` (a flag with its own literal would drift from the class it sets)."""
    import argparse

    from laneserve.broker.config import BrokerConfig
    from laneserve.commands import broker, worker
    from laneserve.contracts import defaults

    def parsed(register) -> argparse.Namespace:
        parser = argparse.ArgumentParser()
        sub = parser.add_subparsers(dest="cmd")
        register(sub)
        (name,) = sub.choices
        args = [name, "--model", "m"] if name == "worker" else [name]
        return parser.parse_args(args)

    b = parsed(broker.register)
    config = BrokerConfig(front="f", back="b")
    for flag, field in [("heartbeat_interval", "heartbeat_interval_s"), ("liveness", "liveness"),
                        ("record_resend", "record_resend_s"), ("max_attempts", "max_attempts"),
                        ("record_retention", "record_retention")]:  # fmt: skip
        assert getattr(b, flag) == getattr(config, field), flag
    assert (config.heartbeat_interval_s, config.liveness) == (
        defaults.HEARTBEAT_INTERVAL_S,
        defaults.LIVENESS,
    )
    w = parsed(worker.register)
    assert (w.heartbeat_interval, w.liveness, w.drain_timeout) == (
        defaults.HEARTBEAT_INTERVAL_S,
        defaults.LIVENESS,
        defaults.DRAIN_TIMEOUT_S,
    )
