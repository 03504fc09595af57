"""Model runner: owns the weights and the paged KV cache, turns a scheduled step into one forward.

The pool's size is chosen before (gpu_worker/kv_pool.py).

For each step it builds the flattened varlen batch (DESIGN.md, "Model runner"):

    input_ids[T], positions[T], slot_mapping[T]     T = tokens computed this step, all requests
    cu_seqlens_q[B+1], seq_lens[B], block_tables[B, max_blocks]
    logits_indices[N]                               last row of each request that emits a token
                                                    (its last 1 + d rows when it verifies d drafts)

Request b computes tokens [num_computed_tokens, num_computed_tokens + num_new_tokens) of its
sequence (prompt + output so far); it emits a token when that range reaches the end of the known
tokens (a decode, or the last chunk of a prefill), which the scheduler reports as `samples`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from laneserve.contracts import defaults, env
from laneserve.gpu_worker import host_memory
from laneserve.gpu_worker.config import ENGINE_DEFAULTS
from laneserve.gpu_worker.models.llama import AttentionMetadata, LlamaForCausalLM
from laneserve.gpu_worker.openmp import openmp_is_purely_passive
from laneserve.gpu_worker.pooling import hidden_rows
from laneserve.gpu_worker.step_upload import StepUploader
from laneserve.kernels import cpu_ext

logger = logging.getLogger(__name__)

# Under a purely passive OpenMP wait policy (OMP_WAIT_POLICY=PASSIVE with no GOMP_SPINCOUNT, or
# GOMP_SPINCOUNT=0) every parallel region pays ~40 us to wake its threads, ~240 regions per decode
# step, so CPU steps of at most this many tokens run on one intra-op thread: they are memory-bound
# and gain nothing from a second one. Measured on a 2-core EPYC, bf16 SmolLM2-135M, ms per step,
# 1 vs 2 threads: decode B=1 25 vs 31, B=16 54 vs 58, B=32 81 vs 83, B=64 165 vs 150; prefill 128
# tokens 105 vs 118, 256 tokens 200 vs 175. With gpu_worker's default short spin two threads win
# at every size (B=1 18 vs 25), so the rule is off then. LANESERVE_CPU_SINGLE_THREAD_TOKENS
# overrides it either way (0 turns it off).
CPU_SINGLE_THREAD_TOKENS = 48


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn: AttentionMetadata
    logits_indices: torch.Tensor
    sample_rows: list[int]  # index into the scheduled list of each request that emits a token
    # embed requests (gpu_worker/pooling.py): rows whose final hidden states come back, and
    # (request index, offset, count) into them per embed request of the step
    hidden_indices: torch.Tensor | None = None
    pooled: list[tuple[int, int, int]] | None = None
    # called at the forward's pause points (gpu_worker/interleave.py: interactive steps run there)
    pause: Callable[[], None] | None = None

    @property
    def is_pure_decode(self) -> bool:
        """Every request computes exactly one token and emits one (graph-replayable shape)."""
        n = self.input_ids.shape[0]
        return n == self.attn.seq_lens.shape[0] == len(self.sample_rows)


def _split_draft_rows(
    num_drafts: np.ndarray,
    lens: np.ndarray,
    starts: np.ndarray,
    seq_lens: np.ndarray,
    tables: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Attention metadata where each query row of a request verifying drafts is a one-token
    "sequence" of its own: row j (position starts + j) attends to keys [0, starts + j], which
    is what causal attention over the request's rows gives it, so a step of decodes and draft
    verifications stays a pure decode batch for attention (the in-place paged decode kernel,
    the same numerics as a plain decode). K/V slots, positions and logits rows are unchanged.

    Returns (cu_seqlens_q `[S+1]` int32, seq_lens `[S]` int32, block_tables `[S, max_blocks]`).
    """
    split = num_drafts > 0  # [B]
    reps = np.where(split, lens, 1)  # attention sequences per request
    seq_of = np.repeat(np.arange(lens.shape[0]), reps)  # [S] request of each
    first = np.cumsum(reps) - reps
    j = np.arange(seq_of.shape[0]) - first[seq_of]  # row within its request
    q_lens = np.where(split[seq_of], 1, lens[seq_of]).astype(np.int32)
    att_lens = np.where(split[seq_of], starts[seq_of] + j + 1, seq_lens[seq_of]).astype(np.int32)
    att_cu = np.zeros(seq_of.shape[0] + 1, dtype=np.int32)
    np.cumsum(q_lens, out=att_cu[1:])
    return att_cu, att_lens, np.ascontiguousarray(tables[seq_of])


class ModelRunner:
    """Holds the model and one KV cache tensor per layer: [2, num_blocks, block_size, Hk, D].

    On CUDA, pure-decode steps replay CUDA graphs captured for a ladder of batch sizes
    (`kernels.cuda_graphs.DecodeGraphs`, vLLM's 1, 2, 4, 8, 16, ... ladder) unless
    `use_cuda_graphs=False`; other steps (prefill chunks, mixed batches) run eagerly.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        block_size: int,
        num_blocks: int,
        use_cuda_graphs: bool = True,
        max_num_seqs: int = ENGINE_DEFAULTS.max_num_seqs,
        max_model_len: int = defaults.MAX_MODEL_LEN,
    ):
        self.model = model
        self.block_size = block_size
        self.num_blocks = num_blocks
        c = model.config
        self.device = model.device
        if self.device.type == "cpu":
            host_memory.tune_for_inference()  # stop per-step mmap/page-fault churn (see module)
            if cpu_ext.load():  # build the C++ CPU kernels now (once per machine), not in a step
                model.prepare_gemv_blocks()
        shape = (2, num_blocks, block_size, c.num_key_value_heads, c.head_dim)
        self.kv_caches = [
            host_memory.zeros(shape, model.dtype, self.device) for _ in range(c.num_hidden_layers)
        ]
        # (k_cache, v_cache) views per layer, made once: indexing a tensor per layer per step
        # costs two ATen ops a layer; indexing a tuple costs none.
        self.kv_views = [(t[0], t[1]) for t in self.kv_caches]
        self.graphs = None
        self.uploader = StepUploader(self.device)  # one pinned, non-blocking copy per step on CUDA
        self.cpu_single_thread_tokens = 0
        if self.device.type == "cpu":
            default = CPU_SINGLE_THREAD_TOKENS if openmp_is_purely_passive() else 0
            forced = env.get("LANESERVE_CPU_SINGLE_THREAD_TOKENS")  # EnvError if not an int
            self.cpu_single_thread_tokens = default if forced is None else forced
        if use_cuda_graphs and self.device.type == "cuda" and model.cuda_graph_safe:
            self.graphs = self._capture_graphs(max_num_seqs, -(-max_model_len // block_size))

    def _capture_graphs(self, max_num_seqs: int, max_blocks: int):
        from laneserve.kernels.cuda_graphs import DecodeGraphs, StaticInput, default_ladder

        graphs = DecodeGraphs(
            self._decode_fn,
            inputs=[
                StaticInput("input_ids", (), torch.int64),
                StaticInput("positions", (), torch.int64),
                StaticInput("slot_mapping", (), torch.int64, pad=-1),  # padded rows write nothing
                StaticInput("cu_seqlens_q", (), torch.int32, pad="arange", extra_rows=1),
                StaticInput("seq_lens", (), torch.int32, pad=1),
                StaticInput("block_tables", (max_blocks,), torch.int32, pad=0),
            ],
            batch_sizes=default_ladder(min(max_num_seqs, 256)),
            device=self.device,
            enabled=True,
        )
        graphs.capture()
        logger.info("captured CUDA graphs for decode batch sizes up to %d", min(max_num_seqs, 256))
        return graphs

    def _decode_fn(self, input_ids, positions, slot_mapping, cu_seqlens_q, seq_lens, block_tables):
        attn = AttentionMetadata(slot_mapping, cu_seqlens_q, seq_lens, block_tables)
        rows = torch.arange(input_ids.shape[0], device=input_ids.device)
        return self.model.forward(input_ids, positions, attn, self.kv_views, rows)

    def kv_cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.kv_caches)

    def prepare_inputs(
        self,
        new_token_ids: Sequence[Sequence[int]],
        num_computed: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        samples: Sequence[bool],
        num_drafts: Sequence[int] | None = None,
        pooling: Sequence[str | None] | None = None,
    ) -> StepInputs:
        """Build the varlen batch.

        Args:
            new_token_ids: per request, the ids of positions
                `[num_computed[b], num_computed[b] + len(new_token_ids[b]))`.
            num_computed: per request, tokens whose KV is already in the cache.
            block_tables: per request, physical block ids covering every position computed.
            samples: per request, whether its last new token's logits are needed.
            num_drafts: per request, draft tokens at the end of its new tokens (speculative
                decoding): a sampling request then gets logits rows for its last
                `1 + num_drafts[b]` tokens, in order.
            pooling: per request, "LAST" | "MEAN" for an embed request (it samples nothing;
                its rows' hidden states come back instead, `pooling.hidden_rows`), else None.
        """
        bs = self.block_size
        num_reqs = len(new_token_ids)
        lens = np.fromiter((len(t) for t in new_token_ids), dtype=np.int32, count=num_reqs)
        cu = np.zeros(num_reqs + 1, dtype=np.int32)
        np.cumsum(lens, out=cu[1:])
        starts = np.asarray(num_computed, dtype=np.int64)
        seq_lens = (starts + lens).astype(np.int32)
        input_ids = np.fromiter(
            (t for ids in new_token_ids for t in ids), dtype=np.int64, count=int(cu[-1])
        )
        req_of_token = np.repeat(np.arange(num_reqs), lens)
        positions = (
            np.arange(int(cu[-1]), dtype=np.int64) - cu[:-1][req_of_token] + starts[req_of_token]
        )
        max_blocks = max((len(t) for t in block_tables), default=1)
        tables = np.zeros((num_reqs, max(max_blocks, 1)), dtype=np.int32)
        for b, table in enumerate(block_tables):
            tables[b, : len(table)] = table
        if pooling is not None and not any(pooling):
            pooling = None
        sample_rows = [
            b for b in range(num_reqs) if samples[b] and (pooling is None or pooling[b] is None)
        ]
        if num_drafts is None or not any(num_drafts):
            logits_indices = cu[1:][sample_rows].astype(np.int64) - 1
        else:
            logits_indices = np.fromiter(
                (
                    r
                    for b in sample_rows
                    for r in range(int(cu[b + 1]) - 1 - num_drafts[b], int(cu[b + 1]))
                ),
                dtype=np.int64,
            )
        # slot of token at position p of request b = table[b, p // bs] * bs + p % bs
        slots = tables[req_of_token, positions // bs].astype(np.int64) * bs + positions % bs
        att_cu, att_lens, att_tables = cu, seq_lens, tables
        if num_drafts is not None and any(num_drafts):
            att_cu, att_lens, att_tables = _split_draft_rows(
                np.asarray(num_drafts), lens, starts, seq_lens, tables
            )
        ids_t, pos_t, slots_t, cu_t, lens_t, tables_t, logits_t = self.uploader.upload(
            [input_ids, positions, slots, att_cu, att_lens, att_tables, logits_indices]
        )
        inputs = StepInputs(
            input_ids=ids_t,
            positions=pos_t,
            attn=AttentionMetadata(slots_t, cu_t, lens_t, tables_t),
            logits_indices=logits_t,
            sample_rows=sample_rows,
        )
        if pooling is not None:
            rows, inputs.pooled = hidden_rows(cu, samples, pooling)
            inputs.hidden_indices = torch.from_numpy(rows).to(self.device)
        return inputs

    def execute(self, inputs: StepInputs) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """One forward; logits [len(logits_indices), vocab] in fp32, and with
        `inputs.hidden_indices` (embed requests) also the final hidden rows [M, H] fp32."""
        if (
            self.cpu_single_thread_tokens
            and inputs.input_ids.shape[0] <= self.cpu_single_thread_tokens
            and torch.get_num_threads() > 1
        ):
            threads = torch.get_num_threads()
            torch.set_num_threads(1)  # ~0.1 us; the process's setting is restored right after
            try:
                return self._forward(inputs)
            finally:
                torch.set_num_threads(threads)
        return self._forward(inputs)

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        if self.graphs is not None and inputs.is_pure_decode:
            a = inputs.attn
            batch = inputs.input_ids.shape[0]
            logits = self.graphs(
                input_ids=inputs.input_ids,
                positions=inputs.positions,
                slot_mapping=a.slot_mapping,
                cu_seqlens_q=a.cu_seqlens_q,
                seq_lens=a.seq_lens,
                block_tables=a.block_tables,
            )
            return logits[:batch]
        return self.model.forward(
            inputs.input_ids, inputs.positions, inputs.attn, self.kv_views,
            inputs.logits_indices, inputs.hidden_indices, pause=inputs.pause,
        )  # fmt: skip
