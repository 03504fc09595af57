"""`ModelConfig`: the shape and numerics of a Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, and
sparse MoE: Mixtral, Qwen3-MoE), the architectures supported, and the config built from a Hugging
Face `config.json` dict (`config_from_hf_dict`; a GGUF's metadata gives one through
`gguf_loader.config_from_gguf`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from laneserve.gpu_worker.errors import ModelLoadError
from laneserve.gpu_worker.models import rope

logger = logging.getLogger(__name__)

# HF `architectures[0]` -> our family name, and the HF class of each family
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "Gemma3ForCausalLM": "gemma3",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
HF_CLASS = {family: arch for arch, family in HF_ARCHITECTURES.items()}
# GGUF `general.architecture` (llama.cpp's names) -> our family name
GGUF_ARCHITECTURES = {
    "llama": "llama",  # Mixtral too: llama with experts (`gguf_loader.config_from_gguf`)
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "phi3": "phi3",
    "gemma3": "gemma3",
    "qwen3moe": "qwen3_moe",
}
SUPPORTED_ARCHITECTURES = {**HF_ARCHITECTURES, **GGUF_ARCHITECTURES}
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # the gated MLP's
_MODEL_TYPE = {"gemma3": "gemma3_text"}  # HF `model_type` where it is not the family name


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder (sizes in elements, lengths in tokens)."""

    architecture: str  # a family of SUPPORTED_ARCHITECTURES: "llama", "qwen3", "gemma3", ...
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
    qk_norm: bool = False  # RMSNorm over each q and k head's D features before RoPE (Qwen3)
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    name: str = ""
    partial_rotary_factor: float = 1.0  # RoPE on the first head_dim x this features (Phi-4-mini)
    hidden_act: str = "silu"  # the gated MLP's activation: "silu" or "gelu_pytorch_tanh" (Gemma)
    # Gemma 3: softmax scale query_pre_attn_scalar ** -0.5 (None: head_dim ** -0.5); its
    # "sliding_attention" layers (`layer_types`) attend the last `sliding_window` keys, with
    # RoPE base `rope_local_base_freq`; logits soft-capped as cap * tanh(logits / cap)
    query_pre_attn_scalar: float | None = None
    rope_local_base_freq: float | None = None
    final_logit_softcapping: float | None = None
    # the config's own, from which yarn / longrope scale (max_model_len may be capped below it)
    max_position_embeddings: int | None = None
    # sparse MoE (Mixtral, Qwen3-MoE): the layers whose MLP is `num_experts` routed experts
    num_experts: int = 0
    num_experts_per_tok: int = 0  # top-k
    moe_intermediate_size: int = 0  # each expert's intermediate size
    norm_topk_prob: bool = True  # renormalize the top-k routing weights to sum to 1
    moe_layers: tuple[int, ...] = ()

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    # Sliding-window attention (Mistral, Phi-3; Qwen2/Qwen3 with `use_sliding_window`; Gemma 3's
    # local layers): a query at position i sees keys i - W < j <= i in the layers whose
    # `layer_types` entry is "sliding_attention" (transformers' names; empty: every layer).
    # None: full attention everywhere.
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()

    def layer_sliding_window(self, layer: int) -> int | None:
        """The sliding window (tokens) layer ``layer`` attends within, or None (full attention)."""
        if self.sliding_window is None:
            return None
        if self.layer_types and self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    @property
    def kv_sliding_window(self) -> int | None:
        """The window every layer attends within (the widest of them), or None when some
        layer attends every key (Gemma 3's global layers): KV outside it is never read again."""
        windows = [self.layer_sliding_window(i) for i in range(self.num_hidden_layers)]
        if not windows or None in windows:
            return None
        return max(windows)

    def __post_init__(self) -> None:
        if self.moe_layers and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ModelLoadError(
                f"{self.name}: num_experts_per_tok {self.num_experts_per_tok} must be 1.."
                f"num_experts ({self.num_experts})"
            )

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache bytes per token in bf16: 2 (K and V) x layers x kv_heads x head_dim x 2 bytes."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * 2

    def to_hf_dict(self) -> dict[str, Any]:
        """A Hugging Face `config.json` describing this model."""
        arch = HF_CLASS[self.architecture]
        eos = list(self.eos_token_ids)
        return _moe_hf_fields(self) | {
            "architectures": [arch],
            "model_type": _MODEL_TYPE.get(self.architecture, self.architecture),
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
            "max_position_embeddings": self.max_position_embeddings or self.max_model_len,
            "eos_token_id": eos[0] if len(eos) == 1 else eos,
            "bos_token_id": self.bos_token_id,
            "attention_bias": self.attention_bias,
            "hidden_act": self.hidden_act,
            "torch_dtype": "float32",
            "laneserve_name": self.name,
            "partial_rotary_factor": self.partial_rotary_factor,
            "query_pre_attn_scalar": self.query_pre_attn_scalar,
            "sliding_window": self.sliding_window,
            "use_sliding_window": self.sliding_window is not None,
            **({"layer_types": list(self.layer_types)} if self.layer_types else {}),
            "rope_local_base_freq": self.rope_local_base_freq,
            "final_logit_softcapping": self.final_logit_softcapping,
        }


def architecture_family(arch: str, where: Path) -> str:
    """Our family name ("llama", "qwen3", ...) for a Hugging Face `architectures[0]` or a GGUF
    `general.architecture`.

    Raises:
        ModelLoadError: an architecture not in `SUPPORTED_ARCHITECTURES`.
    """
    family = SUPPORTED_ARCHITECTURES.get(arch)
    if family is None:
        raise ModelLoadError(
            f"{where}: unsupported architecture {arch!r}; supported: {sorted(HF_ARCHITECTURES)} "
            f"(GGUF general.architecture {', '.join(GGUF_ARCHITECTURES)})"
        )
    return family


def sliding_window_from_hf_dict(
    cfg: dict[str, Any], family: str
) -> tuple[int | None, tuple[str, ...]]:
    """``(sliding_window, layer_types)`` as transformers reads them: Mistral's, Mixtral's and
    Phi-3's window applies to every layer; Qwen3-MoE's to every layer with
    ``use_sliding_window``; Qwen2's and Qwen3's only with ``use_sliding_window``, to the layers
    from ``max_window_layers`` on (or as ``layer_types`` lists them); Gemma 3's to the layers
    ``layer_types`` names "sliding_attention" (older configs: all but every
    ``sliding_window_pattern``-th)."""
    window = cfg.get("sliding_window")
    if family == "llama" or not window:
        return None, ()
    always = family in ("phi3", "gemma3", "mixtral")
    if not always and not cfg.get("use_sliding_window", family == "mistral"):
        return None, ()
    n = int(cfg["num_hidden_layers"])
    layer_types = cfg.get("layer_types")
    if family in ("qwen2", "qwen3") and layer_types is None:
        first = int(cfg.get("max_window_layers", 28))
        layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
    if family == "gemma3" and not layer_types:
        pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
        layer_types = [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)
        ]
    return int(window), tuple(layer_types or ())


def _rope(cfg: dict[str, Any], family: str, where: Path) -> tuple[float, dict | None, float | None]:
    """(rope_theta, rope scaling parameters or None, Gemma 3's local base) from either config
    style: transformers 4 (`rope_theta`, `rope_scaling`, `rope_local_base_freq`) or 5
    (`rope_parameters`, per layer type for Gemma 3).

    Raises:
        ModelLoadError: a rope type `models.rope` does not compute.
    """
    params = dict(cfg.get("rope_scaling") or {})
    local = cfg.get("rope_local_base_freq")
    new_style = cfg.get("rope_parameters")
    if isinstance(new_style, dict) and isinstance(new_style.get("full_attention"), dict):
        local = (new_style.get("sliding_attention") or {}).get("rope_theta", local)
        new_style = new_style["full_attention"]
    if isinstance(new_style, dict):
        params = {**new_style, **params}
    theta = cfg.get("rope_theta", params.get("rope_theta"))
    if "original_max_position_embeddings" in cfg:  # Phi-3 keeps it beside rope_scaling
        params.setdefault(
            "original_max_position_embeddings", cfg["original_max_position_embeddings"]
        )
    rope.check_rope_type(params, f"{where}/config.json")
    kind = rope.rope_type(params)
    scaling = None if kind == "default" else {**params, "rope_type": kind}
    theta = float(theta if theta is not None else 10000.0)
    if family == "gemma3" and local is None:
        local = 10000.0
    return theta, scaling, (float(local) if local is not None else None)


def config_from_hf_dict(cfg: dict[str, Any], where: Path) -> ModelConfig:
    """Build a `ModelConfig` from a Hugging Face `config.json` dict (transformers 4 or 5 style).

    Raises:
        ModelLoadError: unsupported architecture, rope type or attention variant, or missing
            fields; nothing has read a weight yet.
    """
    arch = (cfg.get("architectures") or [cfg.get("model_type", "?")])[0]
    family = architecture_family(arch, where)
    if cfg.get("use_bidirectional_attention"):
        raise ModelLoadError(
            f"{where}/config.json: bidirectional attention is not supported; supported: causal"
        )
    if cfg.get("attn_logit_softcapping"):
        raise ModelLoadError(
            f"{where}/config.json: attention logit soft-capping (attn_logit_softcapping="
            f"{cfg['attn_logit_softcapping']}) is not supported; supported: none"
        )
    act = str(cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu")
    if act not in SUPPORTED_ACTIVATIONS:
        raise ModelLoadError(
            f"{where}/config.json: unsupported hidden_act {act!r}; supported: "
            + ", ".join(SUPPORTED_ACTIVATIONS)
        )
    try:
        sliding_window, layer_types = sliding_window_from_hf_dict(cfg, family)
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        layers = int(cfg["num_hidden_layers"])
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        theta, scaling, local_theta = _rope(cfg, family, where)
        partial = (scaling or {}).get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
        gemma = family == "gemma3"
        return ModelConfig(
            architecture=family,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            rope_theta=theta,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
            max_model_len=int(cfg.get("max_position_embeddings", 2048)),
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            attention_bias=bool(cfg.get("attention_bias", family == "qwen2")),
            qk_norm=family in ("qwen3", "gemma3", "qwen3_moe"),
            rope_scaling=scaling,
            name=str(cfg.get("laneserve_name") or cfg.get("_name_or_path") or where.name),
            partial_rotary_factor=float(partial or 1.0),
            hidden_act=act,
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar", 256) if gemma else None,
            sliding_window=sliding_window,
            layer_types=layer_types,
            rope_local_base_freq=local_theta,
            final_logit_softcapping=cfg.get("final_logit_softcapping"),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            **_moe_fields(cfg, family),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"{where}/config.json: missing or bad field: {exc}") from exc


def _moe_fields(cfg: dict[str, Any], family: str) -> dict[str, Any]:
    """The MoE fields of a Mixtral / Qwen3-MoE `config.json` (none for dense families): Qwen3-MoE
    layer i is sparse unless in `mlp_only_layers` and when (i + 1) % `decoder_sparse_step` == 0
    (transformers' `Qwen3MoeDecoderLayer`); Mixtral's every layer is, renormalizing its top-k."""
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    if family not in ("mixtral", "qwen3_moe") or experts == 0:
        return {}
    layers = range(int(cfg["num_hidden_layers"]))
    if family == "qwen3_moe":
        step = int(cfg.get("decoder_sparse_step") or 1)
        dense = set(cfg.get("mlp_only_layers") or ())
        layers = [i for i in layers if i not in dense and (i + 1) % step == 0]
    return {
        "num_experts": experts,
        "num_experts_per_tok": int(cfg["num_experts_per_tok"]),
        "moe_intermediate_size": int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]),
        "norm_topk_prob": family == "mixtral" or bool(cfg.get("norm_topk_prob", False)),
        "moe_layers": tuple(layers),
    }


def _moe_hf_fields(config: ModelConfig) -> dict[str, Any]:
    """`config.json` fields that give `_moe_fields` this config's MoE layers back."""
    if not config.num_experts:
        return {}
    dense = [i for i in range(config.num_hidden_layers) if i not in config.moe_layers]
    return {
        "num_experts": config.num_experts,
        "num_local_experts": config.num_experts,
        "num_experts_per_tok": config.num_experts_per_tok,
        "moe_intermediate_size": config.moe_intermediate_size,
        "norm_topk_prob": config.norm_topk_prob,
        "decoder_sparse_step": 1,
        "mlp_only_layers": dense,
    }
