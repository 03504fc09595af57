"""Load a Llama-family model (config, weights, tokenizer) from a GGUF file or a Hugging Face dir.

Both sources end up as one `ModelConfig` plus a dict of tensors in Hugging Face naming
(`model.layers.0.self_attn.q_proj.weight`, ...), so the model code never knows where its weights
came from.

GGUF: tensors are dequantized with the `gguf` package (`gguf.quants.dequantize`, which covers F32,
F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K..Q6_K). llama.cpp's converter permutes the rows of
Q and K for `general.architecture == "llama"` (`convert_hf_to_gguf.py`, `LlamaModel.permute`) so
that its rotary kernel can use the interleaved layout; we undo it there, with the KV head count for
K, so the Hugging Face rotate-half rotary embedding applies.

Converting the bundled GGUF costs ~10 s (tokenizer from GGUF metadata + dequantizing). The first
load therefore writes a cached Hugging Face directory next to the `.gguf`
(`<stem>.hf/`: config.json, model.safetensors, tokenizer files), and later loads read that
directory in about a second.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from laneserve.gpu_worker.errors import ModelLoadError
from laneserve.gpu_worker.model_files import (
    conversion_valid,
    gguf_cache_dir,
    gguf_stamp,
    write_conversion_marker,
)
from laneserve.gpu_worker.quantization import GGUF_QUANT_TYPES, GGUFQuantTensor

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = {
    # HF `architectures[0]` / GGUF `general.architecture` -> our family name
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
}
SUPPORTED_GGUF_TYPES = (
    "F32",
    "F16",
    "BF16",
    "Q8_0",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder (sizes in elements, lengths in tokens)."""

    architecture: str  # "llama" | "mistral" | "qwen2"
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_model_len: int  # max_position_embeddings: the longest prompt + output the model knows
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None = None
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    name: str = ""

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache bytes per token in bf16: 2 (K and V) x layers x kv_heads x head_dim x 2 bytes."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * 2

    def to_hf_dict(self) -> dict[str, Any]:
        """A Hugging Face `config.json` describing this model."""
        arch = {
            "llama": "LlamaForCausalLM",
            "mistral": "MistralForCausalLM",
            "qwen2": "Qwen2ForCausalLM",
        }[self.architecture]
        eos = list(self.eos_token_ids)
        return {
            "architectures": [arch],
            "model_type": self.architecture,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_model_len,
            "eos_token_id": eos[0] if len(eos) == 1 else eos,
            "bos_token_id": self.bos_token_id,
            "attention_bias": self.attention_bias,
            "hidden_act": "silu",
            "torch_dtype": "float32",
            "laneserve_name": self.name,
        }


def _family(arch: str, where: Path) -> str:
    family = SUPPORTED_ARCHITECTURES.get(arch)
    if family is None:
        supported = sorted(k for k in SUPPORTED_ARCHITECTURES if k[0].isupper())
        raise ModelLoadError(
            f"{where}: unsupported architecture {arch!r}; supported: {supported} "
            "(GGUF general.architecture llama, mistral, qwen2)"
        )
    return family


def config_from_hf_dict(cfg: dict[str, Any], where: Path) -> ModelConfig:
    """Build a `ModelConfig` from a Hugging Face `config.json` dict.

    Raises:
        ModelLoadError: unsupported architecture, sliding-window attention, or missing fields.
    """
    arch = (cfg.get("architectures") or [cfg.get("model_type", "?")])[0]
    family = _family(arch, where)
    if (
        family in ("mistral", "qwen2")
        and cfg.get("sliding_window")
        and cfg.get("use_sliding_window", family == "mistral")
    ):
        window = cfg["sliding_window"]
        if window < cfg.get("max_position_embeddings", 0):
            logger.warning(
                "%s: sliding window %s not supported; max_model_len capped to it", where, window
            )
            cfg = {**cfg, "max_position_embeddings": window}
    try:
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        scaling = cfg.get("rope_scaling") or None
        rope_theta = cfg.get("rope_theta")
        if rope_theta is None and isinstance(cfg.get("rope_parameters"), dict):
            rope_theta = cfg["rope_parameters"].get("rope_theta")
        return ModelConfig(
            architecture=family,
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_model_len=int(cfg.get("max_position_embeddings", 2048)),
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            attention_bias=bool(cfg.get("attention_bias", family == "qwen2")),
            rope_scaling=scaling,
            name=str(cfg.get("laneserve_name") or cfg.get("_name_or_path") or where.name),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"{where}/config.json: missing or bad field: {exc}") from exc


# --------------------------------------------------------------------------- GGUF


def _open_gguf(path: Path):
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except Exception as exc:  # gguf raises ValueError/struct.error/OSError on bad files
        raise ModelLoadError(
            f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})"
        ) from exc


def _field(reader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def config_from_gguf(reader, path: Path) -> ModelConfig:
    arch = _field(reader, "general.architecture", "?")
    family = _family(arch, path)

    def get(key: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    vocab = get("vocab_size")
    if vocab is None:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    names = {t.name for t in reader.tensors}
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    scaling = None
    if get("rope.scaling.type") not in (None, "none"):
        scaling = {"rope_type": get("rope.scaling.type"), "factor": get("rope.scaling.factor")}
    return ModelConfig(
        architecture=family,
        num_hidden_layers=int(get("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(get("rope.dimension_count") or hidden // heads),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        vocab_size=int(vocab),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        tie_word_embeddings="output.weight" not in names,
        max_model_len=int(get("context_length", 2048)),
        eos_token_ids=(int(eos),) if eos is not None else (),
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        attention_bias="blk.0.attn_q.bias" in names,
        rope_scaling=scaling,
        name=str(_field(reader, "general.name", path.stem)),
    )


_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def gguf_to_hf_name(name: str) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None if unknown."""
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    if name.startswith("blk."):
        _, idx, rest = name.split(".", 2)
        if rest in _GGUF_LAYER_NAMES:
            return f"model.layers.{idx}.{_GGUF_LAYER_NAMES[rest]}"
    return None


def reverse_llama_permute(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's `permute(w, n_head)` on the rows of a Q or K projection (or bias).

    llama.cpp stores row pairs interleaved per head ([n_head, 2, dim/2] -> [n_head, dim/2, 2]);
    this swaps them back so rotate-half rotary embeddings apply.
    """
    dim = weight.shape[0] // n_head // 2
    w = weight.reshape(n_head, dim, 2, *weight.shape[1:])
    return np.ascontiguousarray(w.swapaxes(2, 1).reshape(weight.shape))


def dequantize_gguf_tensor(tensor, path: Path) -> np.ndarray:
    """Dequantize one `gguf.ReaderTensor` to float32 numpy in HF layout ([out, in]).

    Raises:
        ModelLoadError: the quantization type is not supported.
    """
    from gguf import quants

    qtype = tensor.tensor_type.name
    if qtype not in SUPPORTED_GGUF_TYPES:
        raise ModelLoadError(
            f"{path}: tensor {tensor.name} has unsupported quant type {qtype}; "
            f"supported: {', '.join(SUPPORTED_GGUF_TYPES)}"
        )
    try:
        data = quants.dequantize(tensor.data, tensor.tensor_type)
    except (NotImplementedError, ValueError) as exc:
        raise ModelLoadError(f"{path}: cannot dequantize {tensor.name} ({qtype}): {exc}") from exc
    return np.asarray(data, dtype=np.float32).reshape(tuple(reversed(tensor.shape.tolist())))


def _is_llama_qk(config: ModelConfig, hf_name: str) -> int | None:
    """Head count to undo llama.cpp's Q/K row permutation with, or None for other tensors."""
    if config.architecture != "llama":
        return None
    if ".q_proj." in hf_name:
        return config.num_attention_heads
    if ".k_proj." in hf_name:
        return config.num_key_value_heads
    return None


def _keep_quantized(tensor, hf_name: str, path: Path) -> bool:
    """Whether a 2-D weight stays in its GGUF blocks (a quantized linear or embedding)."""
    qtype = tensor.tensor_type.name
    if not hf_name.endswith(".weight") or "norm" in hf_name or qtype in ("F32", "F16", "BF16"):
        return False
    if qtype in GGUF_QUANT_TYPES:
        return True
    logger.info(
        "%s: tensor %s has type %s, which has no quantized kernel; dequantized instead",
        path.name,
        tensor.name,
        qtype,
    )
    return False


def load_gguf_weights(
    reader, config: ModelConfig, path: Path, keep_quantized: bool = False
) -> dict[str, torch.Tensor | GGUFQuantTensor]:
    """All tensors of a GGUF file in Hugging Face naming, dequantized to float32, or (with
    `keep_quantized`) Q4_0 / Q4_1 / Q8_0 weights kept as `GGUFQuantTensor` blocks.

    Q/K rows are un-permuted for llama either way (a row is a whole number of blocks).
    """
    weights: dict[str, torch.Tensor | GGUFQuantTensor] = {}
    for tensor in reader.tensors:
        hf_name = gguf_to_hf_name(tensor.name)
        if hf_name is None:
            if tensor.name == "rope_freqs.weight":
                continue  # llama3 rope factors; we recompute them from rope_scaling
            logger.debug("%s: skipping unknown tensor %s", path, tensor.name)
            continue
        n_head = _is_llama_qk(config, hf_name)
        if keep_quantized and _keep_quantized(tensor, hf_name, path):
            blocks = np.asarray(tensor.data)
            if n_head is not None:
                blocks = reverse_llama_permute(blocks, n_head)
            shape = tuple(reversed(tensor.shape.tolist()))
            weights[hf_name] = GGUFQuantTensor(hf_name, tensor.tensor_type.name, blocks, shape)
            continue
        array = dequantize_gguf_tensor(tensor, path)
        if n_head is not None:
            array = reverse_llama_permute(array, n_head)
        if not array.flags.writeable:
            array = array.copy()  # F32 tensors are read-only memmap views of the file
        weights[hf_name] = torch.from_numpy(array)
    return weights


@dataclass(frozen=True, slots=True)
class IndexedTensor:
    """What `load_gguf_weights` reads of a `gguf.ReaderTensor`, rebuilt from a tensor index."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray  # GGUF dims (innermost first), as ReaderTensor.shape
    data: np.ndarray  # read-only memmap view of the file, as ReaderTensor.data


@dataclass(frozen=True, slots=True)
class IndexedGGUF:
    """A GGUF file's tensors without parsing its metadata (`tensors`, as `gguf.GGUFReader`)."""

    tensors: list[IndexedTensor]


_TENSOR_INDEX = "gguf_tensors.json"
_INDEX_FORMAT_VERSION = 1


def write_tensor_index(reader, path: Path, cache: Path) -> None:
    """Record each tensor's name, type, dims and byte offset in `cache`, so a later load maps the
    file without `gguf.GGUFReader` (which parses every tokenizer string in the metadata: ~2 s for
    a 49k-token vocabulary). Written atomically; a failure to write only costs the next load time."""
    index = {
        **gguf_stamp(path, _INDEX_FORMAT_VERSION),
        "tensors": [
            [t.name, int(t.tensor_type), [int(d) for d in t.shape], int(t.data_offset)]
            for t in reader.tensors
        ],
    }
    tmp = cache / f"{_TENSOR_INDEX}.tmp{os.getpid()}"
    try:
        tmp.write_text(json.dumps(index))
        os.replace(tmp, cache / _TENSOR_INDEX)
    except OSError as exc:
        logger.warning("cannot write the GGUF tensor index in %s (%s)", cache, exc)


def read_tensor_index(path: Path, cache: Path) -> IndexedGGUF | None:
    """The tensors of `path` mapped through the index in `cache`; None when the index is
    missing, unreadable, or was written for another version of the file."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    try:
        index = json.loads((cache / _TENSOR_INDEX).read_text())
        if {k: index.get(k) for k in ("version", "size", "mtime")} != gguf_stamp(
            path, _INDEX_FORMAT_VERSION
        ):
            return None
        mm = np.memmap(path, dtype=np.uint8, mode="r")
        plain = {  # element-typed views, as GGUFReader gives them; the rest are bytes per row
            "F16": np.float16,
            "F32": np.float32,
            "F64": np.float64,
            "I8": np.int8,
            "I16": np.int16,
            "I32": np.int32,
            "I64": np.int64,
        }
        tensors = []
        for name, type_value, dims, offset in index["tensors"]:
            qtype = GGMLQuantizationType(type_value)
            block, type_size = GGML_QUANT_SIZES[qtype]
            n_elems = int(np.prod(dims))
            n_bytes = n_elems * type_size // block
            np_dims = tuple(reversed(dims))
            raw = mm[offset : offset + n_bytes]
            if raw.size != n_bytes:
                return None
            dtype = plain.get(qtype.name)
            if dtype is not None:
                data = raw.view(dtype).reshape(np_dims)
            else:
                data = raw.reshape(quant_shape_to_byte_shape(np_dims, qtype))
            tensors.append(IndexedTensor(name, qtype, np.asarray(dims, dtype=np.uint64), data))
        return IndexedGGUF(tensors)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        logger.info("GGUF tensor index in %s not used (%s)", cache, exc)
        return None


def load_gguf_tokenizer(path: Path):
    """Tokenizer from GGUF metadata through transformers' GGUF conversion (~4 s)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as exc:
        raise ModelLoadError(f"{path}: cannot build a tokenizer from GGUF metadata: {exc}") from exc


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


def convert_gguf(path: Path, out_dir: Path | None = None) -> Path:
    """Convert a GGUF file into a cached Hugging Face directory (float32 safetensors); return it.

    Safe under concurrency (file lock, atomic rename). Re-used while the GGUF's size and mtime match.
    """
    from filelock import FileLock
    from safetensors.torch import save_file

    out_dir = out_dir or gguf_cache_dir(path)
    with FileLock(str(out_dir) + ".lock", timeout=600):
        if conversion_valid(out_dir, path):
            return out_dir
        reader = _open_gguf(path)
        config = config_from_gguf(reader, path)
        weights = load_gguf_weights(reader, config, path)
        tokenizer = load_gguf_tokenizer(path)
        tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
        tmp.mkdir(parents=True, exist_ok=True)
        (tmp / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2))
        save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp / "model.safetensors"))
        tokenizer.save_pretrained(str(tmp))
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
        reader = _open_gguf(path)
        config = config_from_gguf(reader, path)
        weights = load_gguf_weights(reader, config, path)
        tokenizer = load_gguf_tokenizer(path)
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
            cache = convert_gguf(path)
        except OSError as exc:
            logger.warning("cannot write GGUF cache next to %s (%s)", path, exc)
    if cache is not None:
        indexed = read_tensor_index(path, cache)
        if indexed is not None:
            return load_hf_config(cache), indexed
    reader = _open_gguf(path)
    if cache is not None:
        write_tensor_index(reader, path, cache)
    return config_from_gguf(reader, path), reader


def _tokenizer_for_gguf(path: Path, use_cache: bool):
    """From the cached conversion (about a second once it exists), else from GGUF metadata."""
    if use_cache:
        try:
            return load_hf_tokenizer(convert_gguf(path))
        except OSError as exc:
            logger.warning("cannot write GGUF cache next to %s (%s)", path, exc)
    return load_gguf_tokenizer(path)


def load_tokenizer(path: str | os.PathLike[str]):
    """The tokenizer alone (from the cached conversion when the source is a `.gguf`)."""
    path = Path(path)
    _check_file(path)
    if path.is_file():
        return load_hf_tokenizer(convert_gguf(path))
    return load_hf_tokenizer(path)
