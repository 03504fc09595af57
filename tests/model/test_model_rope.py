"""RoPE scaling types: our cos/sin cache against transformers' own `ROPE_INIT_FUNCTIONS`, from a
config saved by transformers and read back by `config_from_hf_dict`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from laneserve.gpu_worker.model_config import config_from_hf_dict
from laneserve.gpu_worker.models.rope import build_cos_sin_cache

SHAPE = dict(hidden_size=64, num_attention_heads=2, num_hidden_layers=1, vocab_size=32)
MAX_POS = 1024
ORIG = 256


def hf_cos_sin(config, positions: torch.Tensor, seq_len: int | None) -> torch.Tensor:
    """cat(cos, sin) [P, rot_dim] as transformers' rotary embedding computes them (inv_freq and
    attention factor of the config's rope type)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    kind = config.rope_parameters["rope_type"]
    if kind == "default":
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        inv_freq, factor = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    else:
        inv_freq, factor = ROPE_INIT_FUNCTIONS[kind](config, None, seq_len=seq_len)
    freqs = torch.outer(positions.float(), inv_freq.float())
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1) * factor


def ours(config) -> torch.Tensor:
    arch = type(config).__name__.replace("Config", "ForCausalLM")
    c = config_from_hf_dict(config.to_dict() | {"architectures": [arch]}, Path("x"))
    args = (c.rope_theta, c.rope_scaling, c.rotary_dim, c.max_position_embeddings, MAX_POS, "cpu")
    return build_cos_sin_cache(*args)


@pytest.mark.parametrize(
    "params",
    [
        {"rope_type": "default"},
        {"rope_type": "linear", "factor": 4.0},
        {"rope_type": "dynamic", "factor": 2.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": ORIG,
        },
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIG},
        {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": ORIG,
            "mscale": 1.0,
            "mscale_all_dim": 0.5,
            "beta_fast": 16,
        },
    ],
    ids=lambda p: "-".join(k for k in ("rope_type", "mscale") if k in p) + "=" + p["rope_type"],
)
def test_rope_types_match_transformers(params):
    from transformers import LlamaConfig

    config = LlamaConfig(
        **SHAPE,
        max_position_embeddings=MAX_POS,
        rope_parameters={"rope_theta": 10000.0, **params},
    )
    ref = hf_cos_sin(config, torch.arange(MAX_POS), None)
    torch.testing.assert_close(ours(config), ref, rtol=1e-5, atol=1e-5)


def test_longrope_partial_rotary_short_then_long_factors():
    """Phi-3 / Phi-4-mini LongRoPE with partial rotary: short factors below the original length,
    long ones from it on, both times transformers' attention factor."""
    from transformers import Phi3Config

    rot_dim = 24  # head 32 x 0.75
    config = Phi3Config(
        **SHAPE,
        max_position_embeddings=MAX_POS,
        original_max_position_embeddings=ORIG,
        partial_rotary_factor=0.75,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0 + 0.05 * i for i in range(rot_dim // 2)],
            "long_factor": [1.0 + 0.7 * i for i in range(rot_dim // 2)],
        },
    )
    cache = ours(config)
    assert cache.shape == (MAX_POS, rot_dim)
    positions = torch.arange(MAX_POS)
    short = hf_cos_sin(config, positions[:ORIG], None)
    long = hf_cos_sin(config, positions[ORIG:], ORIG + 1)
    torch.testing.assert_close(cache[:ORIG], short, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache[ORIG:], long, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(cache[ORIG:], hf_cos_sin(config, positions[ORIG:], None))
