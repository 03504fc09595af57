"""Sizing the paged KV pool: how many blocks fit the memory budget (`choose_num_blocks`: ~2 GiB on
a CPU, on a GPU 90 % of the memory free after the weights and a profiled forward's activation
peak, `profile_activation_bytes`), the `max_model_len` the pool then allows, and the figures the
worker announces (`kv_pool_info`). `plan_kv_pool` does all of it for an engine's config.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch

from laneserve.gpu_worker.config import EngineConfig
from laneserve.gpu_worker.model_config import ModelConfig
from laneserve.gpu_worker.models.llama import AttentionMetadata, LlamaForCausalLM

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_BYTES = 2 * 1024**3  # DESIGN: the CPU KV pool is bounded (about 2 GiB)
DEFAULT_GPU_KV_FRACTION = 0.90  # of the memory free after the weights and the profiled activations


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of K and V for one block across all layers: 2 x layers x block x kv_heads x head_dim x elem."""
    elem = torch.empty((), dtype=dtype).element_size()
    return (
        2
        * config.num_hidden_layers
        * block_size
        * config.num_key_value_heads
        * config.head_dim
        * elem
    )


def choose_num_blocks(
    config: ModelConfig,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    kv_cache_memory_bytes: int | None,
    max_num_seqs: int,
    max_model_len: int,
    activation_bytes: int = 0,
) -> int:
    """Blocks that fit in `kv_cache_memory_bytes`, capped at what `max_num_seqs` sequences of
    `max_model_len` tokens could ever use. Default budget: ~2 GiB on CPU; on a GPU 90 % of the
    memory free after the weights less `activation_bytes` (the peak of a profiled forward at the
    largest step, :func:`profile_activation_bytes`)."""
    per_block = kv_bytes_per_block(config, block_size, dtype)
    if kv_cache_memory_bytes is None:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            kv_cache_memory_bytes = int(max(free - activation_bytes, 0) * DEFAULT_GPU_KV_FRACTION)
            logger.info(
                "KV pool sizing: %.2f GiB free after weights, %.2f GiB activation peak "
                "(profiled), %.2f GiB for KV",
                free / 2**30,
                activation_bytes / 2**30,
                kv_cache_memory_bytes / 2**30,
            )
        else:
            kv_cache_memory_bytes = DEFAULT_CPU_KV_BYTES
    blocks = int(kv_cache_memory_bytes // per_block)
    cap = max_num_seqs * -(-max_model_len // block_size)
    blocks = min(blocks, cap)
    if blocks < 2:
        raise ValueError(
            f"kv_cache_memory_bytes={kv_cache_memory_bytes} holds {blocks} blocks of {per_block} bytes; "
            "need at least 2"
        )
    return blocks


def kv_pool_info(
    config: ModelConfig,
    block_size: int,
    num_blocks: int,
    dtype: torch.dtype,
    device: torch.device,
    activation_bytes: int | None,
    max_model_len: int,
) -> dict:
    """The KV pool's chosen numbers as the worker announces them (``laneserve status`` shows them):
    blocks, tokens, bytes, the profiled activation peak (None where nothing was profiled)."""
    per_block = kv_bytes_per_block(config, block_size, dtype)
    return {
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "num_blocks": num_blocks,
        "block_size": block_size,
        "num_tokens": num_blocks * block_size,
        "kv_cache_bytes": num_blocks * per_block,
        "activation_bytes": activation_bytes,
        "max_model_len": max_model_len,
    }


def profile_activation_bytes(
    model: LlamaForCausalLM, num_tokens: int, num_samples: int, block_size: int
) -> int | None:
    """Memory one forward of the largest step needs beyond what is allocated now (vLLM's profile run).

    The step is `num_tokens` prompt tokens of one sequence with `num_samples` logits rows, over a
    throwaway one-block cache: every slot is -1 (nothing is written) and every block-table entry
    is block 0, so attention reads as many keys as a real step of that size. Returns the CUDA peak
    in bytes, or None on other devices (the CPU pool has a fixed size; the forward still runs, so
    the path is exercised everywhere).
    """
    c = model.config
    dev = model.device
    num_tokens = max(1, num_tokens)
    blocks = -(-num_tokens // block_size)
    shape = (1, block_size, c.num_key_value_heads, c.head_dim)
    caches = [
        (torch.zeros(shape, dtype=model.dtype, device=dev),) * 2 for _ in range(c.num_hidden_layers)
    ]
    attn = AttentionMetadata(
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=dev),
        cu_seqlens_q=torch.tensor([0, num_tokens], dtype=torch.int32, device=dev),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=dev),
        block_tables=torch.zeros((1, blocks), dtype=torch.int32, device=dev),
    )
    ids = torch.zeros(num_tokens, dtype=torch.int64, device=dev)
    positions = torch.arange(num_tokens, dtype=torch.int64, device=dev)
    rows = torch.arange(num_tokens - min(num_samples, num_tokens), num_tokens, device=dev)
    if dev.type != "cuda":
        with torch.inference_mode():
            model.forward(ids, positions, attn, caches, rows)
        return None
    torch.cuda.synchronize(dev)
    before = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    with torch.inference_mode():
        model.forward(ids, positions, attn, caches, rows)
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev) - before
    del caches, attn, ids, positions, rows
    torch.cuda.empty_cache()
    return int(peak)


class KvPoolPlan(NamedTuple):
    """A sized KV pool: `num_blocks` blocks of the config's `block_size`, the `max_model_len` it
    allows (tokens), and `info` (`kv_pool_info`: what the worker announces)."""

    num_blocks: int
    max_model_len: int
    info: dict


def plan_kv_pool(
    model: LlamaForCausalLM, config: EngineConfig, dtype: torch.dtype, device: torch.device
) -> KvPoolPlan:
    """The KV pool for an engine: `config.num_blocks`, or what `choose_num_blocks` fits (on a GPU
    after profiling the activation peak of the largest step, unless the config sets the pool's
    size). `max_model_len` is the config's (else the model's), capped at what the pool holds.

    Raises:
        ValueError: a `config.max_model_len` larger than the pool, or a pool under 2 blocks.
    """
    max_len = min(config.max_model_len or model.config.max_model_len, model.config.max_model_len)
    activation_bytes = None
    if device.type == "cuda" and not (config.num_blocks or config.kv_cache_memory_bytes):
        activation_bytes = profile_activation_bytes(
            model,
            min(config.max_num_batched_tokens, max_len),
            config.max_num_seqs,
            config.block_size,
        )
    num_blocks = config.num_blocks or choose_num_blocks(
        model.config,
        config.block_size,
        dtype,
        device,
        config.kv_cache_memory_bytes,
        config.max_num_seqs,
        max_len,
        activation_bytes or 0,
    )
    pool_tokens = num_blocks * config.block_size
    if max_len > pool_tokens:
        if config.max_model_len is not None:
            raise ValueError(
                f"max_model_len={config.max_model_len} does not fit the KV pool of "
                f"{num_blocks} blocks x {config.block_size} tokens"
            )
        logger.warning("max_model_len capped at %d tokens: the KV pool holds no more", pool_tokens)
        max_len = pool_tokens
    info = kv_pool_info(
        model.config, config.block_size, num_blocks, dtype, device, activation_bytes, max_len
    )
    return KvPoolPlan(num_blocks, max_len, info)
