"""laneserve: an LLM inference server with interactive and batch lanes.

Every package is imported as ``laneserve.<name>`` (``laneserve.kernels``, ``laneserve.db``, ...),
so installing laneserve adds this one top-level name (Hugging Face's ``kernels`` and a user's own
``db`` or ``jobs`` stay theirs). The folders stay at the repository root (docs/architecture.md):
an install maps them into this package (setuptools' ``package-dir`` in pyproject.toml, editable
installs too), and in a checkout run without an install this package's path extends to the root.
"""

from __future__ import annotations

from pathlib import Path

SUBPACKAGES = ("contracts", "broker", "gpu_worker", "kernels", "jobs", "db", "dashboard")

_ROOT = Path(__file__).resolve().parent.parent
if (_ROOT / "pyproject.toml").is_file() and all(
    (_ROOT / name / "__init__.py").is_file() for name in SUBPACKAGES
):  # a checkout (or an editable install of one): laneserve.<name> is the folder <name>
    __path__.append(str(_ROOT))
