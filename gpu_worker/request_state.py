"""`RequestState`: what the engine keeps per request beside the scheduler's `Request`."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from laneserve.gpu_worker.detokenizer import IncrementalDetokenizer
from laneserve.gpu_worker.request import Request
from laneserve.gpu_worker.sampling_params import SamplingParams
from laneserve.gpu_worker.spec_decode import SpecRequest
from laneserve.gpu_worker.structured_output import GrammarMatcher


@dataclass(slots=True)
class RequestState:
    """The engine's state of one request beside the scheduler's `Request`: its detokenizer, seeded
    generator and sampling params, the text sent so far, its prompt logprobs while they are
    gathered (`gpu_worker/prompt_logprobs.py`), and with speculative decoding or structured
    outputs its token history or grammar matcher."""

    request: Request
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None
    params: SamplingParams
    text_parts: list[str] = field(default_factory=list)
    # prompt_logprobs requested: entries so far (one per position); sent once complete
    prompt_logprobs: list | None = None
    prompt_logprobs_sent: bool = False
    spec: SpecRequest | None = None  # speculative decoding: token history, acceptance
    matcher: GrammarMatcher | None = None  # structured outputs: the request's grammar state
    # embed requests: fp32 [hidden_size], the sum of the final hidden states so far (MEAN) or
    # the last prompt token's (LAST); gpu_worker/pooling.py
    pooled: torch.Tensor | None = None
