"""Load a Llama-family model (config, weights, tokenizer) from a GGUF file or a Hugging Face dir.

Both sources end up as one `ModelConfig` plus a dict of tensors in Hugging Face naming
(`model.layers.0.self_attn.q_proj.weight`, ...), so the model code never knows where its weights
came from.

This module holds the entry points (`load_model_files`, `load_tokenizer`, `convert_gguf`) and the
Hugging Face directory readers; reading a GGUF file is gpu_worker/gguf_loader.py, the config
gpu_worker/model_config.py.

Reading a GGUF's tokenizer from its metadata costs seconds, so the first load writes a cached
Hugging Face directory next to the `.gguf` (`<stem>.hf/`: config.json, the tokenizer files and
the tensor index the quantized path maps the file by) and later loads read that directory in
about a second. The weights go into it (float32 `model.safetensors`) only when a load needs
them: the float32 path (`quantization="none"`, CUDA) and callers of `convert_gguf` that want a
Hugging Face directory to hand to another engine. The quantized path reads the weights from the
GGUF itself, so its first load no longer dequantizes a whole K-quant model to float32 to write a
copy it never reads (a 0.8 GB Llama-3.2-1B Q4_K_M: 5.6 GB peak RSS and 40 s before).
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from laneserve.gpu_worker.errors import ModelLoadError
from laneserve.gpu_worker.gguf_blocks import GGUFQuantTensor
from laneserve.gpu_worker.gguf_loader import (
    config_from_gguf,
    load_gguf_tokenizer,
    load_gguf_weights,
    open_gguf,
    read_tensor_index,
    write_tensor_index,
)
from laneserve.gpu_worker.model_config import ModelConfig, config_from_hf_dict
from laneserve.gpu_worker.model_files import (
    WEIGHTS_FILE,
    conversion_current,
    conversion_valid,
    gguf_cache_dir,
    write_conversion_marker,
)

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- HF directories


def load_hf_config(path: Path) -> ModelConfig:
    cfg_path = path / "config.json"
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{cfg_path}: cannot read config: {exc}") from exc
    return config_from_hf_dict(cfg, path)


def load_hf_weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(
            f"{path}: no *.safetensors files (only safetensors weights are supported)"
        )
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            weights.update(load_file(str(file)))
        except Exception as exc:  # safetensors raises SafetensorError on truncated files
            raise ModelLoadError(f"{file}: cannot read safetensors ({exc})") from exc
    return weights


# Tokenizer classes that are transformers' plain `tokenizers` backend: AutoTokenizer would build
# exactly this class, after resolving the model's config through `AutoConfig` (seconds of imports).
_BACKEND_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _backend_tokenizer_class(path: Path) -> bool:
    try:
        cfg = json.loads((path / "tokenizer_config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return (path / "tokenizer.json").is_file() and cfg.get(
        "tokenizer_class"
    ) in _BACKEND_TOKENIZER_CLASSES


def load_hf_tokenizer(path: Path):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    cls = PreTrainedTokenizerFast if _backend_tokenizer_class(path) else AutoTokenizer
    try:
        return cls.from_pretrained(str(path))
    except Exception as exc:
        raise ModelLoadError(f"{path}: cannot load tokenizer files: {exc}") from exc


# --------------------------------------------------------------------------- entry points


@dataclass(slots=True)
class LoadedModel:
    """What a loader returns: config, weights in HF naming (float32 tensors, or GGUF blocks when
    loaded for a quantized path), tokenizer, where it came from."""

    config: ModelConfig
    weights: dict[str, torch.Tensor | GGUFQuantTensor]
    tokenizer: Any
    source: Path
    load_seconds: float = 0.0


def convert_gguf(path: Path, out_dir: Path | None = None, weights: bool = True) -> Path:
    """Convert a GGUF file into a cached Hugging Face directory; return it. With `weights` it
    holds the float32 weights too (a directory transformers or vLLM can load); without, only the
    config, tokenizer and tensor index (the quantized path and torch-free processes: seconds, no
    float32 copy in memory or on disk). A metadata-only directory gains its weights on the first
    call that asks for them.

    Safe under concurrency (file lock, atomic rename). Re-used while the GGUF's size and mtime match.
    """
    from filelock import FileLock
    from safetensors.torch import save_file

    out_dir = out_dir or gguf_cache_dir(path)
    with FileLock(str(out_dir) + ".lock", timeout=600):
        if conversion_current(out_dir, path, weights):
            return out_dir
        if conversion_valid(
            out_dir, path
        ):  # the weights join the directory in place (its readers never see it missing)
            reader = open_gguf(path)
            tensors = load_gguf_weights(reader, config_from_gguf(reader, path), path)
            tmp_file = out_dir / f"{WEIGHTS_FILE}.tmp{os.getpid()}"
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_file))
            os.replace(tmp_file, out_dir / WEIGHTS_FILE)
            return out_dir
        reader = open_gguf(path)
        config = config_from_gguf(reader, path)
        tokenizer = load_gguf_tokenizer(path, config.to_hf_dict()["model_type"])
        tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
        tmp.mkdir(parents=True, exist_ok=True)
        (tmp / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2))
        if weights:
            tensors = load_gguf_weights(reader, config, path)
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / WEIGHTS_FILE))
            del tensors
        tokenizer.save_pretrained(str(tmp))
        write_tensor_index(reader, path, tmp)  # the quantized path maps the file without parsing
        write_conversion_marker(tmp, path)
        if out_dir.exists():
            import shutil

            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    return out_dir


def _check_file(path: Path) -> None:
    if not path.exists():
        raise ModelLoadError(f"model file {path} does not exist")
    if path.is_file() and path.stat().st_size < 32:
        raise ModelLoadError(f"{path}: file is truncated ({path.stat().st_size} bytes)")


def load_model_files(
    path: str | os.PathLike[str], use_cache: bool = True, quantization: str = "none"
) -> LoadedModel:
    """Load config, weights (HF naming) and tokenizer from a `.gguf` file or HF dir.

    With `quantization="none"` every weight is float32 and a `.gguf` is converted once into
    `<stem>.hf/` next to it (when `use_cache`), and read from there. With any other mode a `.gguf`'s
    weights are read from the file itself, Q4_0 / Q4_1 / Q8_0 ones kept as `GGUFQuantTensor`
    blocks for `gpu_worker.quantization` (the tokenizer still comes from the cached directory).

    Raises:
        ModelLoadError: missing/truncated files, unsupported architecture or quant type.
    """
    start = time.perf_counter()
    path = Path(path)
    _check_file(path)
    if path.is_file() and quantization != "none":
        config, reader = _quantized_source(path, use_cache)
        weights = load_gguf_weights(reader, config, path, keep_quantized=True)
        tokenizer = _tokenizer_for_gguf(path, use_cache)
    elif path.is_file():
        if use_cache:
            try:
                path_dir = convert_gguf(path)
            except OSError as exc:  # read-only location: fall back to converting in memory
                logger.warning(
                    "cannot write GGUF cache next to %s (%s); converting in memory", path, exc
                )
                path_dir = None
            if path_dir is not None:
                loaded = load_model_files(path_dir)
                loaded.source = path
                loaded.load_seconds = time.perf_counter() - start
                return loaded
        reader = open_gguf(path)
        config = config_from_gguf(reader, path)
        weights = load_gguf_weights(reader, config, path)
        tokenizer = load_gguf_tokenizer(path, config.to_hf_dict()["model_type"])
    else:
        config = load_hf_config(path)
        weights = load_hf_weights(path)
        tokenizer = load_hf_tokenizer(path)
    if not config.eos_token_ids and getattr(tokenizer, "eos_token_id", None) is not None:
        config = ModelConfig(**{**asdict(config), "eos_token_ids": (tokenizer.eos_token_id,)})
    return LoadedModel(config, weights, tokenizer, path, time.perf_counter() - start)


def _quantized_source(path: Path, use_cache: bool):
    """(config, tensors) of a GGUF for the quantized path: from the cached conversion's config and
    tensor index when both are there and current, else parsed by `gguf.GGUFReader` (and the index
    written for next time)."""
    cache = None
    if use_cache:
        try:
            cache = convert_gguf(path, weights=False)
        except OSError as exc:
            logger.warning("cannot write GGUF cache next to %s (%s)", path, exc)
    if cache is not None:
        indexed = read_tensor_index(path, cache)
        if indexed is not None:
            return load_hf_config(cache), indexed
    reader = open_gguf(path)
    if cache is not None:
        write_tensor_index(reader, path, cache)
    return config_from_gguf(reader, path), reader


def _tokenizer_for_gguf(path: Path, use_cache: bool):
    """From the cached conversion (about a second once it exists), else from GGUF metadata."""
    if use_cache:
        try:
            return load_hf_tokenizer(convert_gguf(path, weights=False))
        except OSError as exc:
            logger.warning("cannot write GGUF cache next to %s (%s)", path, exc)
    return load_gguf_tokenizer(path)


def load_tokenizer(path: str | os.PathLike[str]):
    """The tokenizer alone (from the cached conversion when the source is a `.gguf`)."""
    path = Path(path)
    _check_file(path)
    if path.is_file():
        return load_hf_tokenizer(convert_gguf(path, weights=False))
    return load_hf_tokenizer(path)
