"""scripts/gpu_checks.py: every step's imports work, and without a GPU each step says it skipped."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_checks.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the script runs for real")
def test_every_step_reports_a_skip_reason_without_a_gpu(tmp_path):
    out = tmp_path / "gpu_checks.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert json.loads(out.read_text()) == report
    expected = [
        "kernel_tests",
        "parity",
        "cuda_graphs",
        "throughput",
        "int4",
        "decode_attention",
        "stack",
    ]
    assert list(report["steps"]) == expected
    for name, figures in report["steps"].items():
        assert "no CUDA device" in figures["skipped"], name


def test_unknown_step_is_refused():
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--only", "parity,warp_drive"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "warp_drive" in proc.stderr
