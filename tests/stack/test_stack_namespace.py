"""Installing laneserve adds one top-level name (DESIGN.md "Kernels"): every package is
`laneserve.<name>`, so Hugging Face's `kernels` package (which transformers imports) and a user's
own `db` or `jobs` modules are never shadowed; a checkout imports the same names."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import laneserve
from laneserve.kernels import cpu_ext

ROOT = Path(__file__).resolve().parents[2]

_CHECK = r"""
import json, sys
import kernels  # Hugging Face's
import laneserve, laneserve.kernels, laneserve.db.models, laneserve.jobs.runner
from laneserve.kernels import cpu_ext, reference
from transformers.integrations import hub_kernels  # transformers' own use of theirs
from transformers.utils import is_kernels_available
print(json.dumps({
    "hf_kernels": kernels.__file__, "ours": laneserve.kernels.__file__,
    "laneserve": laneserve.__file__, "hub_kernels": is_kernels_available(),
    "ours_ops": hasattr(reference, "unified_attention"),
    "csrc": all((cpu_ext.CSRC / name).is_file() for name in (*cpu_ext._SOURCES, *cpu_ext._HEADERS)),
}))
"""


def test_every_package_imports_under_laneserve_from_the_checkout():
    for name in laneserve.SUBPACKAGES:
        module = __import__(f"laneserve.{name}", fromlist=["_"])
        assert Path(module.__file__).resolve() == ROOT / name / "__init__.py"
    # from another directory, no top-level name of ours is importable
    names = laneserve.SUBPACKAGES
    code = f"import importlib.util as u; print([n for n in {names!r} if u.find_spec(n)])"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd="/", capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_wheel_installs_one_top_level_name_beside_hugging_faces_kernels(tmp_path):
    wheels = tmp_path / "wheels"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(wheels), str(ROOT)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = wheels.glob("laneserve-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"laneserve"}, tops
    for name in laneserve.SUBPACKAGES:
        assert f"laneserve/{name}/__init__.py" in names, name
    assert "laneserve/db/migrations/env.py" in names  # package data travels
    for name in (*cpu_ext._SOURCES, *cpu_ext._HEADERS):  # the C++ sources travel too
        assert f"laneserve/kernels/csrc/{name}" in names, name
    # a venv that sees this environment's packages (torch, transformers, ...), with the wheel and
    # Hugging Face's `kernels` installed into it
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    from transformers.utils import import_utils  # the `kernels` versions transformers takes

    hf_kernels = f"kernels>={import_utils.KERNELS_MIN_VERSION},<{import_utils.KERNELS_MAX_VERSION}"
    for args in (["--no-deps", str(wheel)], [hf_kernels]):
        proc = subprocess.run(
            [py, "-m", "pip", "install", "-q", *args],
            capture_output=True, text=True, timeout=600, cwd=tmp_path,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [py, "-c", _CHECK], capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert str(venv) in got["laneserve"]  # the wheel, not the checkout
    assert got["hf_kernels"] != got["ours"] and str(venv) in got["ours"]
    assert got["hub_kernels"] is True and got["ours_ops"] is True
    assert got["csrc"] is True  # the C++ sources the CPU kernels build from are installed
    # and laneserve's CLI runs there
    cli = subprocess.run(
        [str(venv / "bin" / "laneserve"), "status", "--help"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env,
    )  # fmt: skip
    assert cli.returncode == 0, cli.stderr[-2000:]
