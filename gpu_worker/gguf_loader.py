"""Read a GGUF file: its `ModelConfig` (`config_from_gguf`), its tensors in Hugging Face naming
(`load_gguf_weights`: dequantized to float32, or Q4_0 / Q4_1 / Q8_0 weights kept in their blocks
as `GGUFQuantTensor`), a tensor index that maps the file again without parsing its metadata
(`write_tensor_index` / `read_tensor_index`), and its tokenizer (`load_gguf_tokenizer`).

Tensors are dequantized with the `gguf` package (`gguf.quants.dequantize`, which covers F32,
F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K..Q6_K). llama.cpp's converter permutes the rows of
Q and K for `general.architecture == "llama"` (Mixtral too: llama with `expert_count`;
`convert_hf_to_gguf.py`, `LlamaModel.permute`) so
that its rotary kernel can use the interleaved layout; we undo it there, with the KV head count for
K, so the Hugging Face rotate-half rotary embedding applies.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from laneserve.gpu_worker.errors import ModelLoadError
from laneserve.gpu_worker.gguf_blocks import (
    GGUF_QUANT_TYPES,
    K_QUANT_TYPES,
    GGUFQuantTensor,
    drop_file_pages,
)
from laneserve.gpu_worker.gguf_header import GGUFHeader, map_tensors, read_gguf_header
from laneserve.gpu_worker.model_config import ModelConfig, architecture_family
from laneserve.gpu_worker.model_files import gguf_stamp

logger = logging.getLogger(__name__)

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


def open_gguf(path: Path) -> GGUFHeader:
    """The metadata and tensors of the GGUF at `path` (`gguf_header.read_gguf_header`: one pass
    over the header, the vocabulary's strings skipped; `gguf.GGUFReader` took ~8 s for a
    128k-token one).

    Raises:
        ModelLoadError: not a readable GGUF file.
    """
    try:
        return read_gguf_header(path)
    except Exception as exc:  # ValueError/struct.error/OSError on bad files
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
    family = architecture_family(arch, path)

    def get(key: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    if family == "llama" and get("expert_count"):
        family = "mixtral"  # llama.cpp writes Mixtral as llama with experts

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
    head_dim = int(
        get("attention.key_length")
        or (family != "phi3" and get("rope.dimension_count"))
        or hidden // heads
    )
    ctx = int(get("context_length", 2048))
    extra = _family_fields(reader, family, get, head_dim, ctx, path)
    return ModelConfig(
        architecture=family,
        num_hidden_layers=int(get("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(get("attention.head_count_kv", heads)),
        head_dim=head_dim,
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        vocab_size=int(vocab),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        tie_word_embeddings="output.weight" not in names,
        max_model_len=ctx,
        max_position_embeddings=ctx,
        eos_token_ids=(int(eos),) if eos is not None else (),
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        attention_bias="blk.0.attn_q.bias" in names,
        qk_norm=family in ("qwen3", "gemma3", "qwen3_moe"),
        rope_scaling=extra.pop("rope_scaling", scaling),
        name=str(_field(reader, "general.name", path.stem)),
        **extra,  # sliding_window: llama.cpp's key, where the file has it
        **_moe_fields(get, names),
    )


def _moe_fields(get, names: set[str]) -> dict[str, Any]:
    """`ModelConfig`'s MoE fields from llama.cpp's `expert_*` keys (none without experts): the
    sparse layers are those with a router (`ffn_gate_inp`); the top-k weights are renormalized
    unless `expert_weights_norm` says otherwise, as llama.cpp's llama (Mixtral) and qwen3moe
    graphs do."""
    experts = int(get("expert_count") or 0)
    if not experts:
        return {}
    layers = range(int(get("block_count")))
    return {
        "num_experts": experts,
        "num_experts_per_tok": int(get("expert_used_count")),
        "moe_intermediate_size": int(
            get("expert_feed_forward_length") or get("feed_forward_length")
        ),
        "norm_topk_prob": bool(get("expert_weights_norm", True)),
        "moe_layers": tuple(i for i in layers if f"blk.{i}.ffn_gate_inp.weight" in names),
    }


_ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def _tensor_values(reader, name: str) -> list[float]:
    tensor = next(t for t in reader.tensors if t.name == name)
    return [float(v) for v in np.asarray(tensor.data, dtype=np.float32).reshape(-1)]


def _family_fields(reader, family: str, get, head_dim: int, ctx: int, path: Path) -> dict:
    """The ModelConfig fields llama.cpp keeps per family: llama3 rope scaling (`rope_freqs`:
    the divisor of each rotated pair's frequency, `rope_scaling["freq_factors"]`), Phi-3's partial rotary and LongRoPE
    factors (tensors `rope_factors_short` / `rope_factors_long`), Gemma 3's attention kinds,
    local RoPE base, window and scale (llama.cpp: query_pre_attn_scalar = head_dim; every 6th
    layer global unless `attention.sliding_window_pattern` lists them)."""
    names = {t.name for t in reader.tensors}
    window = get("attention.sliding_window")
    out: dict[str, Any] = {"sliding_window": int(window) if window else None}
    if "rope_freqs.weight" in names:  # llama3 scaling as llama.cpp's converter writes it
        factors = _tensor_values(reader, "rope_freqs.weight")
        out["rope_scaling"] = {"rope_type": "llama3", "freq_factors": factors}
    if family == "phi3":
        out["partial_rotary_factor"] = int(get("rope.dimension_count") or head_dim) / head_dim
        if "rope_factors_long.weight" in names:
            out["rope_scaling"] = {
                "rope_type": "longrope",
                "short_factor": _tensor_values(reader, "rope_factors_short.weight"),
                "long_factor": _tensor_values(reader, "rope_factors_long.weight"),
                "original_max_position_embeddings": int(
                    get("rope.scaling.original_context_length", ctx)
                ),
                "attention_factor": get("rope.scaling.attn_factor"),
            }
    elif family == "gemma3":
        layers = int(get("block_count"))
        pattern = get("attention.sliding_window_pattern")
        if not isinstance(pattern, list):
            pattern = [(i + 1) % 6 != 0 for i in range(layers)]
        out |= {
            "hidden_act": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": head_dim,
            "layer_types": tuple("sliding_attention" if s else "full_attention" for s in pattern),
            "rope_local_base_freq": float(get("rope.freq_base_swa", 10000.0)),
            "final_logit_softcapping": get("final_logit_softcapping"),
        }
    return out


_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",  # MoE router [E, H]
    # MoE experts, 3-D [E, N, K]: one tensor per expert in Hugging Face naming ({e})
    "ffn_gate_exps.weight": "mlp.experts.{e}.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.{e}.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.{e}.down_proj.weight",
}
# where llama.cpp names a family's tensors otherwise (convert_hf_to_gguf.py, llama-arch.cpp):
# Phi-3 keeps q/k/v and gate/up fused; Gemma 3 has norms after attention and the MLP too
_FAMILY_LAYER_NAMES = {
    "phi3": {
        "attn_qkv.weight": "self_attn.qkv_proj.weight",
        "ffn_up.weight": "mlp.gate_up_proj.weight",
    },
    "gemma3": {
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "ffn_norm.weight": "pre_feedforward_layernorm.weight",
        "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    },
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _layer_names(family: str) -> dict[str, str]:
    return {**_GGUF_LAYER_NAMES, **_FAMILY_LAYER_NAMES.get(family, {})}


def hf_to_gguf_name(name: str, family: str = "llama") -> str | None:
    """`model.layers.3.self_attn.q_proj.weight` -> `blk.3.attn_q.weight` (llama.cpp's tensor
    names for `family`; the inverse of `gguf_to_hf_name`); None if llama.cpp has no such tensor."""
    for gguf_name, hf_name in _GGUF_GLOBAL_NAMES.items():
        if name == hf_name:
            return gguf_name
    if name.startswith("model.layers."):
        _, _, idx, rest = name.split(".", 3)
        for gguf_name, hf_name in _layer_names(family).items():
            if rest == hf_name:
                return f"blk.{idx}.{gguf_name}"
    return None


def gguf_to_hf_name(name: str, family: str = "llama") -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None if unknown."""
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    if name.startswith("blk."):
        _, idx, rest = name.split(".", 2)
        layer_names = _layer_names(family)
        if rest in layer_names:
            return f"model.layers.{idx}.{layer_names[rest]}"
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
    if config.architecture not in ("llama", "mixtral"):
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
    if qtype in GGUF_QUANT_TYPES or qtype in K_QUANT_TYPES:
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
    `keep_quantized`) Q4_0 / Q4_1 / Q8_0 and Q4_K / Q5_K / Q6_K weights kept as `GGUFQuantTensor`
    blocks (views of the mapped file where no permutation copies them).

    Q/K rows are un-permuted for llama either way (a row is a whole number of blocks).
    """
    weights: dict[str, torch.Tensor | GGUFQuantTensor] = {}
    for tensor in reader.tensors:
        hf_name = gguf_to_hf_name(tensor.name, config.architecture)
        if hf_name is None:
            if tensor.name in _ROPE_TENSORS:
                continue  # rope factors: read into the config's rope_scaling
            logger.debug("%s: skipping unknown tensor %s", path, tensor.name)
            continue
        if "{e}" in hf_name:
            weights.update(_expert_tensors(tensor, hf_name, path, keep_quantized))
            continue
        n_head = _is_llama_qk(config, hf_name)
        if keep_quantized and _keep_quantized(tensor, hf_name, path):
            blocks = np.asarray(tensor.data)
            if n_head is not None:
                blocks = reverse_llama_permute(blocks, n_head)
                drop_file_pages(np.asarray(tensor.data))  # copied: its pages are not read again
            shape = tuple(reversed(tensor.shape.tolist()))
            weights[hf_name] = GGUFQuantTensor(hf_name, tensor.tensor_type.name, blocks, shape)
            continue
        array = dequantize_gguf_tensor(tensor, path)
        if not array.flags.writeable:
            array = array.copy()  # F32 tensors are read-only memmap views of the file
        drop_file_pages(np.asarray(tensor.data))
        if n_head is not None:
            array = reverse_llama_permute(array, n_head)
        if config.architecture == "gemma3" and hf_name.endswith("norm.weight"):
            array = array - 1.0  # llama.cpp stores Gemma's (1 + w); the model folds the 1 itself
        weights[hf_name] = torch.from_numpy(array)
    return weights


def _expert_tensors(
    tensor, hf_name: str, path: Path, keep_quantized: bool
) -> dict[str, torch.Tensor | GGUFQuantTensor]:
    """A 3-D experts tensor (`ffn_*_exps`) as one 2-D tensor per expert: views of its blocks
    where they stay quantized, else dequantized to float32."""
    num, n, k = (int(d) for d in reversed(tensor.shape.tolist()))
    names = [hf_name.format(e=e) for e in range(num)]
    if keep_quantized and _keep_quantized(tensor, names[0], path):
        blocks = np.asarray(tensor.data).reshape(num, n, -1)
        qtype = tensor.tensor_type.name
        return {
            name: GGUFQuantTensor(name, qtype, blocks[e], (n, k)) for e, name in enumerate(names)
        }
    array = dequantize_gguf_tensor(tensor, path)
    if not array.flags.writeable:
        array = array.copy()
    drop_file_pages(np.asarray(tensor.data))
    experts = torch.from_numpy(array)  # one copy each: safetensors saves no shared storage
    return {name: experts[e].clone() for e, name in enumerate(names)}


_TENSOR_INDEX = "gguf_tensors.json"
_INDEX_FORMAT_VERSION = 1


def write_tensor_index(reader, path: Path, cache: Path) -> None:
    """Record each tensor's name, type, dims and byte offset in `cache`, so a later load maps the
    file without reading its metadata again. Written atomically; a failure to write only costs
    the next load time."""
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


def read_tensor_index(path: Path, cache: Path) -> GGUFHeader | None:
    """The tensors of `path` mapped through the index in `cache` (no metadata); None when the
    index is missing, unreadable, or was written for another version of the file."""
    try:
        index = json.loads((cache / _TENSOR_INDEX).read_text())
        if {k: index.get(k) for k in ("version", "size", "mtime")} != gguf_stamp(
            path, _INDEX_FORMAT_VERSION
        ):
            return None
        mm = np.memmap(path, dtype=np.uint8, mode="r")
        return GGUFHeader({}, map_tensors(mm, [tuple(t) for t in index["tensors"]]))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        logger.info("GGUF tensor index in %s not used (%s)", cache, exc)
        return None


# The classes `gguf_tokenizer_class` builds directly: transformers' `tokenizers` backend and its
# subclasses for the families laneserve loads, each taking `gguf_file` as AutoTokenizer passes it
# (tests/model/test_model_loaders.py compares them with AutoTokenizer's). Any other mapping (a
# `MistralCommonBackend` where mistral-common is installed, transformers 4's (slow, fast) pairs)
# goes through AutoTokenizer.
_DIRECT_TOKENIZER_CLASSES = ("TokenizersBackend", "Qwen2Tokenizer", "GemmaTokenizer")


def gguf_tokenizer_class(model_type: str):
    """The tokenizer class `AutoTokenizer` maps a config's `model_type` to (transformers'
    `TOKENIZER_MAPPING_NAMES`; a type it does not list, as `llama`, gets `TokenizersBackend`),
    or None where it is not one of `_DIRECT_TOKENIZER_CLASSES`."""
    from transformers.models.auto.tokenization_auto import (
        TOKENIZER_MAPPING_NAMES,
        tokenizer_class_from_name,
    )

    name = TOKENIZER_MAPPING_NAMES.get(model_type) or "TokenizersBackend"
    if name not in _DIRECT_TOKENIZER_CLASSES:
        return None
    return tokenizer_class_from_name(name)


def load_gguf_tokenizer(path: Path, model_type: str | None = None):
    """Tokenizer from GGUF metadata through transformers' GGUF conversion. Given the config's
    `model_type`, the class `AutoTokenizer` would pick is built directly (`gguf_tokenizer_class`):
    `AutoTokenizer` first parses the whole metadata again for the config, 6.2 s of its 6.7 s for a
    Llama-3.2-1B's 128k-token vocabulary, and then builds that same class."""
    from transformers import AutoTokenizer

    cls = None
    if model_type:
        try:
            cls = gguf_tokenizer_class(model_type)
        except Exception:  # another transformers' mapping: AutoTokenizer resolves it
            logger.debug("no direct tokenizer class for %s", model_type, exc_info=True)
    try:
        return (cls or AutoTokenizer).from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as exc:
        raise ModelLoadError(f"{path}: cannot build a tokenizer from GGUF metadata: {exc}") from exc
