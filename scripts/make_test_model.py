#!/usr/bin/env python
"""Make a random-weight model of a named real shape, since nothing can be downloaded here.

Usage: ``python scripts/make_test_model.py FAMILY SHAPE OUT [--dtype bfloat16] [--gguf PATH]``

Writes a Hugging Face directory OUT (config.json, model.safetensors, the bundled SmolLM2
tokenizer's files with its chat template) of transformers' own class for FAMILY with SHAPE's
sizes, and, where laneserve and llama.cpp read the family from GGUF (llama, qwen3, phi3, gemma3),
the same weights as an F32 GGUF in llama.cpp's tensor layout and metadata keys (`--gguf`, default
OUT.gguf; as `convert_hf_to_gguf.py` writes them: Q/K rows permuted for llama, Gemma's norms as
1 + w, Phi-3's LongRoPE factors as tensors; the bundled GGUF's tokenizer metadata).

Shapes are the public configs' sizes (written from the model cards, not downloaded); `tiny` of
each is what the tests use (CPU float32 parity against transformers in seconds). Phi-4-mini's
LongRoPE short/long factors are smooth stand-ins of the real lists' length and range; the MoE
shapes are scaled down (qwen3_moe `scaled`: ~1.0B total / ~0.34B active parameters).
`python scripts/make_test_model.py --list` prints the table.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np
import torch

# family -> (transformers config class, model class)
CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
}
# written as GGUF too, under llama.cpp's `general.architecture` (Mixtral: llama with experts)
GGUF_ARCHITECTURES = {
    "llama": "llama",
    "qwen3": "qwen3",
    "phi3": "phi3",
    "gemma3": "gemma3",
    "qwen3_moe": "qwen3moe",
    "mixtral": "llama",
}
GGUF_FAMILIES = tuple(GGUF_ARCHITECTURES)


def _longrope(rot_dim: int, long_max: float) -> dict:
    """LongRoPE factors of Phi-3/4's form: one per rotated pair, rising with wavelength."""
    n = rot_dim // 2
    ramp = np.linspace(0.0, 1.0, n)
    return {
        "rope_type": "longrope",
        "short_factor": (1.0 + 0.5 * ramp**2).round(4).tolist(),
        "long_factor": (1.0 + (long_max - 1.0) * ramp**2).round(4).tolist(),
    }


def _tiny(**extra) -> dict:
    """The tests' shape: 2 layers, GQA 4/2, 64 wide, the bundled tokenizer's 49,152 tokens (so
    text prompts work end to end)."""
    base = dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=49152,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    return {**base, **extra}


_QWEN3_06B = dict(
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=151936,
    max_position_embeddings=40960,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)

SHAPES: dict[str, dict[str, dict]] = {
    "llama": {
        "3.2-1b": dict(
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            vocab_size=128256,
            max_position_embeddings=131072,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
        ),
        "tiny": _tiny(
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    },
    "qwen3": {
        "0.6b": _QWEN3_06B,
        "1.7b": {**_QWEN3_06B, "hidden_size": 2048, "intermediate_size": 6144},
        # head_dim 32, not hidden / heads = 16: the config's head_dim must be the one used
        "tiny": _tiny(head_dim=32, rope_theta=1000000.0),
        # ~50M parameters (200 MB float32): big enough that a second copy of the weights shows
        # in the load's peak RSS, small enough to write and load in seconds
        "small": {
            **_QWEN3_06B,
            "hidden_size": 512,
            "intermediate_size": 1536,
            "vocab_size": 49152,
            "num_hidden_layers": 8,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "head_dim": 64,
            "max_position_embeddings": 512,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "pad_token_id": 0,
        },
    },
    "phi3": {
        "mini": dict(  # Phi-3-mini-4k-instruct
            hidden_size=3072,
            intermediate_size=8192,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=32,
            vocab_size=32064,
            max_position_embeddings=4096,
            original_max_position_embeddings=4096,
            sliding_window=2047,
            rope_theta=10000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            bos_token_id=1,
            eos_token_id=32000,
            pad_token_id=32000,
        ),
        "phi4-mini": dict(  # Phi-4-mini-instruct: partial rotary 0.75 of head 128, LongRoPE
            hidden_size=3072,
            intermediate_size=8192,
            num_hidden_layers=32,
            num_attention_heads=24,
            num_key_value_heads=8,
            vocab_size=200064,
            max_position_embeddings=131072,
            original_max_position_embeddings=4096,
            partial_rotary_factor=0.75,
            rope_scaling=_longrope(96, 50.0),
            rope_theta=10000.0,
            sliding_window=262144,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
            bos_token_id=199999,
            eos_token_id=199999,
            pad_token_id=199999,
        ),
        # head 16, partial 0.75: 12 rotated features, 6 factors; the sequences stay below the
        # original length, where transformers and laneserve both use the short factors, and
        # outgrow the window
        "tiny": _tiny(
            original_max_position_embeddings=128,
            partial_rotary_factor=0.75,
            rope_scaling=_longrope(12, 4.0),
            sliding_window=40,
        ),
    },
    "gemma3": {
        "1b": dict(  # gemma-3-1b-it
            hidden_size=1152,
            intermediate_size=6912,
            num_hidden_layers=26,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=256,
            vocab_size=262144,
            max_position_embeddings=32768,
            query_pre_attn_scalar=256,
            sliding_window=512,
            layer_types=[
                "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(26)
            ],
            rope_theta=1000000.0,
            rope_local_base_freq=10000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            bos_token_id=2,
            eos_token_id=[1, 106],
            pad_token_id=0,
        ),
        "tiny": _tiny(
            num_hidden_layers=3,
            head_dim=32,
            query_pre_attn_scalar=24,
            sliding_window=24,  # shorter than the tests' sequences, longer than a 16-token block
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_theta=1000000.0,
            rope_local_base_freq=10000.0,
            final_logit_softcapping=3.0,
            tie_word_embeddings=True,
        ),
    },
    "qwen3_moe": {
        "scaled": dict(  # Qwen3-30B-A3B's form at ~1.0B total / ~0.34B active
            hidden_size=1024,
            intermediate_size=3072,
            moe_intermediate_size=512,
            num_hidden_layers=16,
            num_attention_heads=16,
            num_key_value_heads=4,
            head_dim=128,
            num_experts=32,
            num_experts_per_tok=4,
            norm_topk_prob=True,
            vocab_size=151936,
            max_position_embeddings=40960,
            rope_theta=1000000.0,
            tie_word_embeddings=True,
        ),
        "tiny": _tiny(
            head_dim=32,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,  # as Qwen3-30B-A3B (and llama.cpp's qwen3moe graph)
        ),
    },
    "mixtral": {
        "scaled": dict(  # Mixtral-8x7B's form (8 experts, top 2) at ~0.8B total / ~0.25B active
            hidden_size=1024,
            intermediate_size=3584,
            num_hidden_layers=8,
            num_attention_heads=16,
            num_key_value_heads=4,
            num_local_experts=8,
            num_experts_per_tok=2,
            vocab_size=32000,
            max_position_embeddings=32768,
            rope_theta=1000000.0,
            sliding_window=None,
            tie_word_embeddings=False,
        ),
        "tiny": _tiny(num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
    },
}


def make_config(family: str, shape: str, **overrides):
    """transformers' config object of `family` at `shape`, with `overrides` (KeyError names the
    choices)."""
    import transformers

    if shape not in SHAPES.get(family, {}):
        raise KeyError(f"no shape {family}/{shape}; have {_table()}")
    kwargs = {**SHAPES[family][shape], **overrides}
    config = getattr(transformers, CLASSES[family][0])(**kwargs)
    config.architectures = [CLASSES[family][1]]
    return config


def make_model(family: str, shape: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """A random-weight transformers model (float32, eval): transformers' own init, then every
    norm weight drawn from U(0.5, 1.5) (Gemma's (1 + w) ones from U(-0.5, 0.5)), so a norm that
    is skipped or misplaced changes the output."""
    import transformers

    torch.manual_seed(seed)
    config = make_config(family, shape, **overrides)
    model = getattr(transformers, CLASSES[family][1])(config).eval()
    offset = 1.0 if family == "gemma3" else 0.0
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5 - offset, 1.5 - offset)
    return model


def bundled_tokenizer_dir() -> Path:
    """The bundled SmolLM2's converted directory (tokenizer.json, tokenizer_config.json with its
    chat template), pulled and converted as `laneserve model pull` does."""
    from laneserve.gpu_worker.model_files import pull_model
    from laneserve.gpu_worker.model_loader import convert_gguf

    return convert_gguf(pull_model())


def save_hf(model, out: Path, tokenizer_dir: Path, dtype: torch.dtype = torch.float32) -> Path:
    """`model` as a Hugging Face directory with the tokenizer of `tokenizer_dir`."""
    from transformers import AutoTokenizer

    out.mkdir(parents=True, exist_ok=True)
    model.to(dtype).save_pretrained(out, safe_serialization=True)
    model.to(torch.float32)
    AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(out)
    return out


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py `LlamaModel.permute` (Q/K rows to the interleaved layout)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _copy_tokenizer_fields(writer, tokenizer_gguf: Path, vocab_size: int) -> None:
    """The `tokenizer.*` metadata of a GGUF that llama.cpp wrote, copied, its token list padded
    to the model's `vocab_size` with unused `[PAD{i}]` tokens as llama.cpp's converter pads a
    tokenizer smaller than its embedding (llama.cpp takes the vocabulary size from the list)."""
    import gguf

    reader = gguf.GGUFReader(str(tokenizer_gguf))
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        kind = field.types[0]
        sub = field.types[1] if kind == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        pad = vocab_size - len(value) if kind == gguf.GGUFValueType.ARRAY else 0
        if key == "tokenizer.ggml.tokens" and pad > 0:
            value = [*value, *(f"[PAD{i}]" for i in range(len(value), vocab_size))]
        elif key == "tokenizer.ggml.token_type" and pad > 0:
            value = [*value, *[int(gguf.TokenType.UNUSED)] * pad]
        elif key == "tokenizer.ggml.scores" and pad > 0:
            value = [*value, *[0.0] * pad]
        writer.add_key_value(key, value, kind, sub)


def llama3_rope_freqs(rope: dict, head_dim: int) -> np.ndarray:
    """The `rope_freqs.weight` tensor llama.cpp's converter writes for llama3 rope scaling
    (`LlamaModel.generate_extra_tensors`): per rotated pair, the divisor of its frequency
    (1 for short wavelengths, `factor` for long ones, smoothed in between)."""
    base, factor = rope["rope_theta"], rope["factor"]
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_len = rope.get("original_max_position_embeddings", 8192)
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old_len / high:
            out.append(1.0)
        elif wavelen > old_len / low:
            out.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append(1.0 / ((1.0 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


def _family_metadata(writer, model, family: str, head_dim: int) -> dict[str, np.ndarray]:
    """The metadata llama.cpp's converter writes for Phi-3 and Gemma 3, and the extra tensors
    (Phi-3's LongRoPE factors, llama3's `rope_freqs`).

    Raises:
        ValueError: a Gemma 3 whose query_pre_attn_scalar is not head_dim (llama.cpp assumes it).
    """
    cfg, extra = model.config, {}
    window = getattr(cfg, "sliding_window", None)
    if window and getattr(cfg, "use_sliding_window", True):
        writer.add_sliding_window(window)
    experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
    if experts:  # llama.cpp's qwen3moe / llama (Mixtral) keys; qwen3moe always renormalizes
        if family == "qwen3_moe" and not cfg.norm_topk_prob:
            raise ValueError("llama.cpp's qwen3moe renormalizes the top-k: norm_topk_prob=True")
        writer.add_expert_count(experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        if family == "qwen3_moe":
            writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if family == "phi3":
        rope = cfg.rope_parameters
        rot_dim = int(head_dim * rope.get("partial_rotary_factor", 1.0))
        writer.add_rope_dimension_count(rot_dim)
        if rope.get("rope_type") == "longrope":
            orig = rope["original_max_position_embeddings"]
            scale = cfg.max_position_embeddings / orig
            attn = math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1 else 1.0
            writer.add_rope_scaling_orig_ctx_len(orig)
            writer.add_rope_scaling_attn_factors(attn)
            extra["rope_factors_long.weight"] = np.asarray(rope["long_factor"], np.float32)
            extra["rope_factors_short.weight"] = np.asarray(rope["short_factor"], np.float32)
    elif family == "gemma3":
        if cfg.query_pre_attn_scalar != head_dim:
            raise ValueError("llama.cpp's Gemma 3 takes query_pre_attn_scalar = head_dim")
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_rope_freq_base(cfg.rope_parameters["full_attention"]["rope_theta"])
        writer.add_rope_freq_base_swa(cfg.rope_parameters["sliding_attention"]["rope_theta"])
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
        if cfg.final_logit_softcapping:
            writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    else:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_rope_dimension_count(head_dim)
        rope = cfg.rope_parameters
        if rope.get("rope_type") == "llama3":  # no scaling keys: the factors are a tensor
            extra["rope_freqs.weight"] = llama3_rope_freqs(rope, head_dim)
    if family != "gemma3":
        writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    return extra


def _gguf_tensors(model, family: str):
    """(name, float32 array) of every weight, Hugging Face names except the MoE experts, which
    transformers 5 holds fused ([E, 2I, H] gate_up, [E, H, I] down) and llama.cpp stores as 3-D
    `blk.{i}.ffn_gate_exps` / `ffn_up_exps` ([E, I, H]) and `ffn_down_exps` ([E, H, I])."""
    for name, tensor in model.state_dict().items():
        array = tensor.float().numpy()
        if name.endswith("experts.gate_up_proj"):
            i = name.split(".")[2]
            gate, up = np.split(array, 2, axis=1)
            yield f"blk.{i}.ffn_gate_exps.weight", gate
            yield f"blk.{i}.ffn_up_exps.weight", up
        elif name.endswith("experts.down_proj"):
            yield f"blk.{name.split('.')[2]}.ffn_down_exps.weight", array
        else:
            yield name, array


def write_gguf(
    model,
    family: str,
    path: Path,
    tokenizer_gguf: Path | None = None,
    expert_type: str = "F32",
    linear_type: str = "F32",
) -> Path:
    """`model`'s weights (float32) as a GGUF in llama.cpp's layout and metadata keys (llama: Q/K
    rows permuted; Gemma 3: norm weights stored as 1 + w; Phi-3: LongRoPE factors as tensors;
    MoE experts as 3-D tensors, of `expert_type`; the other 2-D weights, the embedding among
    them, of `linear_type`, quantized by gguf-py: e.g. Q8_0).

    Raises:
        ValueError: a family laneserve does not read from GGUF, or a config llama.cpp cannot say.
    """
    import gguf

    from laneserve.gpu_worker.gguf_loader import hf_to_gguf_name

    if family not in GGUF_FAMILIES:
        raise ValueError(f"no GGUF layout for {family}; have {GGUF_FAMILIES}")
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    arch = GGUF_ARCHITECTURES[family]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"{family}-random")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    extra = _family_metadata(writer, model, family, head_dim)
    if tokenizer_gguf is not None:
        _copy_tokenizer_fields(writer, tokenizer_gguf, cfg.vocab_size)
    else:
        writer.add_eos_token_id(int(np.atleast_1d(cfg.eos_token_id)[0]))
    for name, array in extra.items():
        writer.add_tensor(name, array)
    for name, array in _gguf_tensors(model, family):
        gname = hf_to_gguf_name(name, family) or name
        if gname.startswith("model.") or (name == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        if arch == "llama" and gname.endswith(("attn_q.weight", "attn_k.weight")):
            heads = cfg.num_attention_heads if "attn_q" in gname else cfg.num_key_value_heads
            array = llama_cpp_permute(array, heads)
        if family == "gemma3" and gname.endswith("norm.weight"):
            array = array + 1.0
        kind = expert_type if "_exps." in gname else linear_type if array.ndim == 2 else "F32"
        if kind != "F32" and "norm" not in gname:  # quantized (Q8_0, Q4_0, ...)
            qtype = gguf.GGMLQuantizationType[kind]
            writer.add_tensor(gname, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
            continue
        writer.add_tensor(gname, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _table() -> str:
    return ", ".join(f"{f}: {'/'.join(SHAPES[f])}" for f in SHAPES)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("family", nargs="?", choices=sorted(SHAPES))
    parser.add_argument("shape", nargs="?")
    parser.add_argument("out", nargs="?", type=Path)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--gguf", type=Path, help="GGUF path (default OUT.gguf where supported)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--list", action="store_true", help="print the shapes and exit")
    args = parser.parse_args(argv)
    if args.list or not (args.family and args.shape and args.out):
        print(_table())
        return 0 if args.list else 2
    if args.shape not in SHAPES[args.family]:
        parser.error(f"no shape {args.shape!r} for {args.family}; have {_table()}")
    model = make_model(args.family, args.shape, args.seed)
    tokenizer_dir = bundled_tokenizer_dir()
    save_hf(model, args.out, tokenizer_dir, getattr(torch, args.dtype))
    print(f"wrote {args.out}")
    if args.family in GGUF_FAMILIES:
        from laneserve.gpu_worker.model_files import pull_model

        gguf_path = args.gguf or args.out.with_name(
            args.out.name + ".gguf"
        )  # "llama-3.2-1b" keeps its ".2-1b"
        write_gguf(model, args.family, gguf_path, pull_model())
        print(f"wrote {gguf_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
