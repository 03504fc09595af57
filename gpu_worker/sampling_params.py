"""Per-request sampling parameters, validated once at the edge of the engine.

Names, defaults and ranges follow vLLM's `SamplingParams` (and the OpenAI API, which vLLM mirrors):
https://github.com/vllm-project/vllm/blob/main/vllm/sampling_params.py

On the wire (broker protocol) the parameters travel as a msgpack map produced by `to_dict()` and read
back by `from_dict()`, which is strict: unknown keys and wrongly typed values raise
`InvalidRequestError` naming the field, so a malformed request is rejected with a 4xx instead of
crashing a worker.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from laneserve.contracts.openai.structured import spec_shape_error
from laneserve.gpu_worker.errors import InvalidRequestError

__all__ = ["MAX_LOGIT_BIAS", "MAX_LOGPROBS", "SAMPLING_EPS", "SamplingParams"]

# Top-n logprobs cap; the OpenAI API allows 0..20 `top_logprobs`.
MAX_LOGPROBS = 20
# OpenAI's `logit_bias`: each bias in [-100, 100], at most this many entries per request.
MAX_LOGIT_BIAS = 300
LOGIT_BIAS_RANGE = 100.0
# Temperatures below this are treated as greedy (vLLM's `_SAMPLING_EPS`): dividing logits by ~0
# only overflows, and the argmax is what such a temperature means.
SAMPLING_EPS = 1e-5
# Seeds must fit torch.Generator.manual_seed and msgpack (int64 .. uint64).
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1


@dataclass(slots=True)
class SamplingParams:
    """How to pick output tokens and when to stop.

    Reproducibility contract (DESIGN "Sampling contract"): with a `seed`, a request's output is
    a function of its prompt, these parameters and the seed only -- the same seed, prompt and
    parameters give the same tokens on the same model, dtype and device, whatever other requests
    share the batch, the prefill chunking, the prefix cache or a preemption. Each sampled row
    takes its own path with its own generator (one draw per output token). Greedy requests
    (temperature 0) are deterministic without a seed; unseeded sampled requests draw from the
    engine's shared generator and are not reproducible.

    Attributes:
        n: completions per prompt (>= 1). The gateway fans `n > 1` out as n requests; the engine
            itself generates one sequence per request.
        max_tokens: most output tokens to generate (>= 1); reaching it -> finish_reason "length".
        min_tokens: generation cannot stop before this many tokens exist
            (0 <= min_tokens <= max_tokens): the sampler masks EOS and `stop_token_ids`, and the
            detokenizer matches stop strings only in tokens after the first `min_tokens` (vLLM v1).
        temperature: softmax temperature (>= 0). 0 (or below 1e-5) means greedy: exact argmax.
        top_p: nucleus sampling, keep the smallest set of tokens whose probability sums to
            >= top_p (0 < top_p <= 1; 1 = off). Holtzman et al. 2019, arXiv:1904.09751.
        top_k: keep the k most likely tokens (0 or -1 = off, normalised to 0; else >= 1).
        seed: per-request RNG seed (int64 or uint64 range) for reproducible sampling (see the
            contract above); None = the engine's shared generator.
        stop: stop strings, matched on the detokenized text (not in the output unless
            `include_stop_str_in_output`). Accepts a str, a list of str, or None.
        stop_token_ids: token ids that end generation (finish_reason "stop"); the stop token is
            kept in `token_ids` but its text is not added (same as EOS).
        ignore_eos: keep generating past the model's EOS token.
        include_stop_str_in_output: keep the matched stop string at the end of the text.
        repetition_penalty: > 0; 1 = off. Divides positive / multiplies negative logits of every
            token seen in the prompt or the output (Keskar et al. 2019, CTRL, arXiv:1909.05858;
            the HF/vLLM form).
        presence_penalty: -2..2; subtracted once from the logit of every token in the output
            (OpenAI API definition).
        frequency_penalty: -2..2; subtracted per occurrence in the output (OpenAI API definition).
        logprobs: None = no logprobs; n in 0..20 = the sampled token's logprob plus the top-n
            (raw model log-softmax, see `gpu_worker.sampler`).
        skip_special_tokens: leave special tokens (e.g. `<|im_end|>`) out of the text.
        prompt_logprobs: None = off; n in 0..20 = for every prompt position after the first, the
            logprob of the prompt's actual token (with its 1-based rank) plus the top-n, from the
            raw log-softmax of the previous position's logits (vLLM's field). Requests that ask
            skip the prefix cache (every prompt position must be computed).
        min_p: 0..1; after temperature, drop tokens whose probability is below
            `min_p * max probability` (Nguyen et al. 2024, arXiv:2407.01082; vLLM's field).
            0 = off. No effect on greedy rows (the argmax always survives).
        logit_bias: {token_id: bias} added to the logits before penalties and sampling (OpenAI
            API; bias in [-100, 100], at most 300 entries). On the wire a list of
            `[token_id, bias]` pairs (msgpack maps keep string keys only).
        structured_outputs: None = unconstrained; else the wire spec of
            `contracts.openai.structured` (`{"json": schema text}`, `{"json_object": True}`,
            `{"regex": ...}` or `{"choice": [...]}`): the sampler masks every token the grammar
            does not allow, and EOS until the grammar accepts (gpu_worker/structured_output.py).

    Raises:
        InvalidRequestError (a ValueError) naming the field when a value has the wrong type or is
        out of range.
    """

    n: int = 1
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None
    min_p: float = 0.0
    logit_bias: dict[int, float] | None = None
    structured_outputs: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.n = _int("n", self.n, lo=1)
        self.max_tokens = _int("max_tokens", self.max_tokens, lo=1)
        self.min_tokens = _int("min_tokens", self.min_tokens, lo=0, hi=self.max_tokens)
        self.temperature = _float("temperature", self.temperature, lo=0.0)
        self.top_p = _float("top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True)
        self.top_k = _int("top_k", self.top_k, lo=-1)
        if self.top_k == -1:
            self.top_k = 0
        if self.seed is not None:
            self.seed = _int("seed", self.seed, lo=_SEED_MIN, hi=_SEED_MAX)
        self.stop = _stop_strings(self.stop)
        self.stop_token_ids = _token_ids("stop_token_ids", self.stop_token_ids)
        self.ignore_eos = _bool("ignore_eos", self.ignore_eos)
        self.include_stop_str_in_output = _bool(
            "include_stop_str_in_output", self.include_stop_str_in_output
        )
        self.repetition_penalty = _float("repetition_penalty", self.repetition_penalty, lo=0.0)
        if self.repetition_penalty == 0.0:
            raise InvalidRequestError("repetition_penalty must be > 0, got 0.0")
        self.presence_penalty = _float("presence_penalty", self.presence_penalty, lo=-2.0, hi=2.0)
        self.frequency_penalty = _float(
            "frequency_penalty", self.frequency_penalty, lo=-2.0, hi=2.0
        )
        if self.logprobs is not None:
            self.logprobs = _int("logprobs", self.logprobs, lo=0, hi=MAX_LOGPROBS)
        self.skip_special_tokens = _bool("skip_special_tokens", self.skip_special_tokens)
        if self.prompt_logprobs is not None:
            self.prompt_logprobs = _int(
                "prompt_logprobs", self.prompt_logprobs, lo=0, hi=MAX_LOGPROBS
            )
        self.min_p = _float("min_p", self.min_p, lo=0.0, hi=1.0)
        self.logit_bias = _logit_bias(self.logit_bias)
        if self.structured_outputs is not None:
            problem = spec_shape_error(self.structured_outputs)
            if problem:
                raise InvalidRequestError(f"structured_outputs: {problem}")

    # ---- derived flags the sampler uses to pick fast paths -------------------------------------

    @property
    def greedy(self) -> bool:
        """True when the token is the exact argmax (temperature below `SAMPLING_EPS`)."""
        return self.temperature < SAMPLING_EPS

    @property
    def has_penalties(self) -> bool:
        """True when any of repetition/presence/frequency penalty changes the logits."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def has_logit_bias(self) -> bool:
        """True when `logit_bias` changes at least one logit."""
        return bool(self.logit_bias)

    # ---- wire format ---------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """All fields as a msgpack-able dict of plain Python values (lists copied)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "logit_bias" and value:  # [[token_id, bias], ...] on the wire
                value = [[k, v] for k, v in value.items()]
            out[f.name] = list(value) if isinstance(value, list) else value
        return out

    @staticmethod
    def for_task(sampling_params: SamplingParams | dict | None, task: str) -> SamplingParams:
        """A request's params from what `LLMEngine.add` was given; an embed request samples
        nothing (its params only size the length check). Raises InvalidRequestError."""
        if task not in ("generate", "embed"):
            raise InvalidRequestError(f"task must be 'generate' or 'embed', got {task!r}")
        if task == "embed" or sampling_params is None:
            return SamplingParams(max_tokens=1) if task == "embed" else SamplingParams()
        if isinstance(sampling_params, dict):
            return SamplingParams.from_dict(sampling_params)
        if isinstance(sampling_params, SamplingParams):
            return sampling_params
        raise InvalidRequestError("sampling_params must be a SamplingParams or a dict")

    @classmethod
    def from_dict(cls, d: Any) -> SamplingParams:
        """Build from a map (e.g. decoded msgpack); missing keys take their defaults.

        Raises:
            InvalidRequestError: `d` is not a dict, has an unknown key, or a value has the wrong
                type or range (the message names the field).
        """
        if not isinstance(d, dict):
            raise InvalidRequestError(f"sampling params must be a map, got {type(d).__name__}")
        known = _FIELD_NAMES
        for key in d:
            if key not in known:
                raise InvalidRequestError(f"unknown sampling parameter {key!r}")
        return cls(**d)


_FIELD_NAMES = frozenset(f.name for f in fields(SamplingParams))


# ---- validators: each names the field and raises InvalidRequestError ----------------------------


def _int(name: str, value: Any, lo: int | None = None, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"{name} must be an integer, got {type(value).__name__}")
    if lo is not None and value < lo:
        raise InvalidRequestError(f"{name} must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise InvalidRequestError(f"{name} must be <= {hi}, got {value}")
    return int(value)


def _float(
    name: str,
    value: Any,
    lo: float | None = None,
    hi: float | None = None,
    lo_open: bool = False,
) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequestError(f"{name} must be a number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise InvalidRequestError(f"{name} must be finite, got {value}")
    if lo is not None and (value <= lo if lo_open else value < lo):
        raise InvalidRequestError(f"{name} must be {'>' if lo_open else '>='} {lo}, got {value}")
    if hi is not None and value > hi:
        raise InvalidRequestError(f"{name} must be <= {hi}, got {value}")
    return value


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise InvalidRequestError(f"{name} must be a boolean, got {type(value).__name__}")
    return value


def _stop_strings(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list | tuple):
        raise InvalidRequestError(f"stop must be a string or a list of strings, got {value!r}")
    out = []
    for s in value:
        if not isinstance(s, str):
            raise InvalidRequestError(f"stop must contain only strings, got {type(s).__name__}")
        if not s:
            raise InvalidRequestError("stop must not contain an empty string")
        out.append(s)
    return out


def _token_ids(name: str, value: Any) -> list[int]:
    if value is None:
        return []
    if not isinstance(value, list | tuple):
        raise InvalidRequestError(f"{name} must be a list of integers, got {value!r}")
    return [_int(name, v, lo=0) for v in value]


def _logit_bias(value: Any) -> dict[int, float] | None:
    """A `{token_id: bias}` map, from a dict (int or decimal-string keys, the OpenAI JSON form) or
    a list of `[token_id, bias]` pairs (the wire form). Empty -> None."""
    if value is None:
        return None
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, list | tuple):
        if not all(isinstance(p, list | tuple) and len(p) == 2 for p in value):
            raise InvalidRequestError("logit_bias must be a map or a list of [token_id, bias]")
        items = [tuple(p) for p in value]
    else:
        raise InvalidRequestError(f"logit_bias must be a map, got {type(value).__name__}")
    if len(items) > MAX_LOGIT_BIAS:
        raise InvalidRequestError(f"logit_bias has more than {MAX_LOGIT_BIAS} entries")
    out: dict[int, float] = {}
    for key, bias in items:
        if isinstance(key, str) and key.isdigit():
            key = int(key)
        token = _int("logit_bias token id", key, lo=0)
        out[token] = _float("logit_bias value", bias, lo=-LOGIT_BIAS_RANGE, hi=LOGIT_BIAS_RANGE)
    return out or None
