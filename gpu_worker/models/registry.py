"""Which model class runs each family (`ModelConfig.architecture`)."""

from __future__ import annotations

from laneserve.gpu_worker.model_config import ModelConfig
from laneserve.gpu_worker.models.llama import LlamaForCausalLM


def model_class(config: ModelConfig) -> type[LlamaForCausalLM]:
    """The decoder class for `config`'s family: Gemma 3's norms, MLP and attention have their
    own forward; every other family is the Llama decoder with its own checkpoint table
    (`models.checkpoint.LAYER_LINEARS`)."""
    if config.architecture == "gemma3":
        from laneserve.gpu_worker.models.gemma3 import Gemma3ForCausalLM

        return Gemma3ForCausalLM
    return LlamaForCausalLM


def build_model(
    config: ModelConfig,
    weights,
    dtype,
    device,
    quantization: str = "none",
    release_weights: bool = False,
):
    """`model_class(config)(config, weights, dtype, device, quantization, release_weights)`;
    with `release_weights` the checkpoint tensors leave `weights` as the model takes them."""
    return model_class(config)(config, weights, dtype, device, quantization, release_weights)
