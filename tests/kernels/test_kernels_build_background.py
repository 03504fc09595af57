"""The C++ CPU kernels' build never blocks a worker (kernels/cpu_ext.py): a build folder left
stale (its ``build.ninja`` rewritten by another virtual environment) is rebuilt in the background
while the worker attaches to the broker and serves on the PyTorch path."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from harness import Stack, wait_for

from laneserve.kernels import cpu_ext

# stands in for the C++ compiler: records that a build started, then waits like a long build
_SLOW_COMPILER = """#!/bin/sh
echo $$ >> "{marker}"
exec sleep 300
"""


def _stale_build_folder(build_dir: Path) -> None:
    """A finished build's folder whose build.ninja another process then rewrote."""
    build_dir.mkdir(parents=True)
    (build_dir / "build.ninja").write_text("# this venv's build\n")
    (build_dir / f"{build_dir.name}.so").write_bytes(b"\x7fELF not a library")
    (build_dir / cpu_ext._STAMP).write_text(cpu_ext._file_digest(build_dir / "build.ninja"))
    assert cpu_ext.is_built()  # the finished build, as its stamp says
    (build_dir / "build.ninja").write_text("# another venv's include paths\n")
    assert not cpu_ext.is_built()


def test_build_key_separates_venvs_and_compilers(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    first = cpu_ext.build_directory()
    assert first.parent == tmp_path and first.name.startswith("laneserve_cpu_")
    monkeypatch.setenv("CXX", "clang++")
    assert cpu_ext.build_directory() != first  # another compiler is another build folder
    import torch.utils.cpp_extension as cpp_extension

    monkeypatch.setattr(cpp_extension, "include_paths", lambda *a, **k: ["/other/venv/include"])
    assert "/other/venv/include" in cpu_ext.build_key()


def test_worker_with_a_stale_build_attaches_while_it_rebuilds(tmp_path, monkeypatch, smollm2_dir):
    marker = tmp_path / "compiler-started"
    compiler = tmp_path / "slow-c++"
    compiler.write_text(_SLOW_COMPILER.format(marker=marker))
    compiler.chmod(0o755)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setenv("CXX", str(compiler))
    _stale_build_folder(cpu_ext.build_directory())

    stack = Stack.for_broker(tmp_path)
    stack.wait_s = 120.0  # bounded below; the wait only fails with the logs
    env = dict(stack.env, TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"), CXX=str(compiler))
    env["LANESERVE_CPU_KERNELS"] = "1"
    try:
        stack.start_broker()
        started = time.monotonic()
        stack.start_worker(
            "w1", "--no-slo-control", "--kv-cache-memory", "64MiB", "--max-num-seqs", "4",
            model=str(smollm2_dir), env=env, lanes="interactive",
        )  # fmt: skip
        stack.wait_workers({"w1"})
        attached_s = time.monotonic() - started
        # the build had started and was still running (the compiler sleeps 300 s) when the
        # worker attached: it did not wait for it
        compilers = wait_for(lambda: marker.exists() and marker.read_text().split(), 30, "a build")
        os.kill(int(compilers[0]), 0)  # still compiling (raises once the compiler has exited)
        assert "building the C++ CPU kernels in the background" in stack.log("worker-w1")
        assert attached_s < 60, attached_s  # the model's load; a real build takes 1-5 minutes
    finally:
        stack.stop()
        for pid in marker.read_text().split() if marker.exists() else []:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert compilers
