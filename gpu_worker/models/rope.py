"""Rotary position embeddings: the `[max_positions, rot_dim]` cos/sin cache a model's layers read.

The inverse frequencies follow Hugging Face's `modeling_rope_utils.py` for the rope types here;
the attention factor that `yarn` and `longrope` apply to cos and sin is folded into the cache.
A GGUF's `rope_freqs` tensor (llama.cpp's form of llama3 scaling) arrives as
`params["freq_factors"]`: each pair's base frequency divided by its factor, as llama.cpp's rope does.
`partial_rotary_factor` (Phi-4-mini) rotates only the first `rot_dim = head_dim * factor` features
(the kernels take a cache narrower than the head).

`longrope` (Phi-3 "su"): transformers switches every position to the long factors once a
sequence grows past `original_max_position_embeddings`; a paged cache cannot re-rotate the keys it
already holds, so here positions below that length use the short factors and positions from it on
the long ones: identical to transformers for sequences up to the original length.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from laneserve.gpu_worker.errors import ModelLoadError

# Hugging Face `rope_type` names we compute ("su" is Phi-3's old name for longrope); `dynamic` NTK
# changes nothing within `max_position_embeddings`, which bounds `max_model_len`.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "dynamic", "yarn", "longrope", "su")


def rope_type(params: dict[str, Any] | None) -> str:
    params = params or {}
    return str(params.get("rope_type", params.get("type", "default")))


def check_rope_type(params: dict[str, Any] | None, where: object) -> None:
    """Raises ModelLoadError naming an unsupported rope type and the supported ones."""
    kind = rope_type(params)
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"{where}: unsupported rope_scaling type {kind!r}; supported: "
            + ", ".join(SUPPORTED_ROPE_TYPES)
        )


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3(inv_freq: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    factor = float(p["factor"])
    low_freq_factor = float(p.get("low_freq_factor", 1.0))
    high_freq_factor = float(p.get("high_freq_factor", 4.0))
    old_len = float(p.get("original_max_position_embeddings", 8192))
    low_freq_wavelen = old_len / low_freq_factor
    high_freq_wavelen = old_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


def _yarn(base: float, dim: int, p: dict[str, Any], max_pos: int) -> tuple[torch.Tensor, float]:
    """YaRN (Peng et al. 2023), as `_compute_yarn_parameters`."""
    old_len = int(p.get("original_max_position_embeddings") or max_pos)
    factor = float(p.get("factor") or max_pos / old_len)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        attention_factor = (
            mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
        )

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(p.get("beta_fast") or 32), correction_dim(p.get("beta_slow") or 1)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (
        1.0 / pos_freqs
    ) * extrapolation
    return inv_freq, float(attention_factor)


def _longrope_factor(p: dict[str, Any], max_pos: int) -> float:
    old_len = int(p["original_max_position_embeddings"])
    factor = float(p.get("factor") or max_pos / old_len)
    if p.get("attention_factor") is not None:
        return float(p["attention_factor"])
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_len))


def _freq_factors(factors: list[float], rot_dim: int) -> torch.Tensor:
    """llama.cpp's `rope_freqs` (one divisor of each rotated pair's frequency, as its converter
    writes llama3 scaling into a GGUF), checked against the rotated width.

    Raises:
        ModelLoadError: not one factor per rotated pair.
    """
    if len(factors) != rot_dim // 2:
        raise ModelLoadError(
            f"rope_freqs has {len(factors)} factors; the rotary width {rot_dim} needs {rot_dim // 2}"
        )
    return torch.tensor(factors, dtype=torch.float32)


def build_cos_sin_cache(
    theta: float,
    params: dict[str, Any] | None,
    rot_dim: int,
    max_position_embeddings: int,
    max_positions: int,
    device,
) -> torch.Tensor:
    """fp32 `[max_positions, rot_dim]` = cat(cos, sin), each `[max_positions, rot_dim / 2]`,
    times the rope type's attention factor.

    Args:
        theta: the RoPE base (`rope_theta`).
        params: the model's rope scaling parameters (`rope_scaling` / `rope_parameters`), or None.
        rot_dim: rotated features per head (head_dim x partial_rotary_factor).
        max_position_embeddings: the config's, which `yarn`/`longrope` scale from.

    Raises:
        ModelLoadError: an unsupported rope type.
    """
    p = params or {}
    kind = rope_type(p)
    check_rope_type(p, "rope")
    inv_freq, attention_factor = _base_inv_freq(theta, rot_dim), 1.0
    t = torch.arange(max_positions, dtype=torch.float32)
    if "freq_factors" in p:  # a GGUF's `rope_freqs` tensor: the divisors themselves
        inv_freq = inv_freq / _freq_factors(p["freq_factors"], rot_dim)
    elif kind == "linear":
        inv_freq = inv_freq / float(p["factor"])
    elif kind == "llama3":
        inv_freq = _llama3(inv_freq, p)
    elif kind == "yarn":
        inv_freq, attention_factor = _yarn(theta, rot_dim, p, max_position_embeddings)
    elif kind in ("longrope", "su"):
        old_len = int(p["original_max_position_embeddings"])
        short = inv_freq / torch.tensor(p["short_factor"], dtype=torch.float32)
        long = inv_freq / torch.tensor(p["long_factor"], dtype=torch.float32)
        freqs = torch.where((t < old_len)[:, None], torch.outer(t, short), torch.outer(t, long))
        scale = _longrope_factor(p, max_position_embeddings)
        return (torch.cat([freqs.cos(), freqs.sin()], dim=-1) * scale).to(device)
    freqs = torch.outer(t, inv_freq)  # [P, rot_dim / 2]
    return (torch.cat([freqs.cos(), freqs.sin()], dim=-1) * attention_factor).to(device)
