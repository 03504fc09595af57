"""`ModelConfig`: the shape and numerics of a Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, and
sparse MoE: Mixtral, Qwen3-MoE), the architectures supported, and the config built from a Hugging Face `config.json` dict
(`config_from_hf_dict`; a GGUF's metadata gives one through `gguf_loader.config_from_gguf`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from laneserve.gpu_worker.errors import ModelLoadError

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = {
    # HF `architectures[0]` / GGUF `general.architecture` -> our family name
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3moe": "qwen3_moe",
}
_HF_ARCHITECTURES = {
    family: arch for arch, family in SUPPORTED_ARCHITECTURES.items() if arch[0].isupper()
}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder (sizes in elements, lengths in tokens)."""

    architecture: str  # "llama" | "mistral" | "qwen2" | "qwen3" | "mixtral" | "qwen3_moe"
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
    # sparse MoE (Mixtral, Qwen3-MoE): the layers whose MLP is `num_experts` routed experts
    num_experts: int = 0
    num_experts_per_tok: int = 0  # top-k
    moe_intermediate_size: int = 0  # each expert's intermediate size
    norm_topk_prob: bool = True  # renormalize the top-k routing weights to sum to 1
    moe_layers: tuple[int, ...] = ()

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
        arch = _HF_ARCHITECTURES[self.architecture]
        eos = list(self.eos_token_ids)
        return _moe_hf_fields(self) | {
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


def architecture_family(arch: str, where: Path) -> str:
    """Our family name ("llama", "mistral", "qwen2", "qwen3") for a Hugging Face `architectures[0]` or a
    GGUF `general.architecture`.

    Raises:
        ModelLoadError: an architecture not in `SUPPORTED_ARCHITECTURES`.
    """
    family = SUPPORTED_ARCHITECTURES.get(arch)
    if family is None:
        supported = sorted(k for k in SUPPORTED_ARCHITECTURES if k[0].isupper())
        raise ModelLoadError(
            f"{where}: unsupported architecture {arch!r}; supported: {supported} "
            "(GGUF general.architecture llama, mistral, qwen2, qwen3, qwen3moe)"
        )
    return family


def config_from_hf_dict(cfg: dict[str, Any], where: Path) -> ModelConfig:
    """Build a `ModelConfig` from a Hugging Face `config.json` dict.

    Raises:
        ModelLoadError: unsupported architecture, sliding-window attention, or missing fields.
    """
    arch = (cfg.get("architectures") or [cfg.get("model_type", "?")])[0]
    family = architecture_family(arch, where)
    if (
        family in ("mistral", "qwen2", "qwen3")
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
            qk_norm=family in ("qwen3", "qwen3_moe"),
            rope_scaling=scaling,
            name=str(cfg.get("laneserve_name") or cfg.get("_name_or_path") or where.name),
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
