"""The engine's options, defined once: `EngineConfig`, its command-line flags, its JSON form, and
the lane profile that fills the step knobs a worker was not given.

Every engine option is one field of `EngineConfig` with its default and meaning. `laneserve
worker` and `laneserve up` register their engine flags from these fields
(`add_engine_arguments`), `up` hands each worker child one JSON document (`to_json` /
`from_json`, the worker's ``--engine-config``), and `LLMEngine`, `SchedulerConfig` and `LLM` take
their defaults from here. Torch-free: the supervisor imports it.

Three step knobs (`max_num_seqs`, `max_num_batched_tokens`, `interactive_batch_token_cap`) default
to None, meaning "the lane profile's value": `lane_profile(lanes, on_gpu)` gives a CPU worker that
serves interactive traffic short steps and the others the engine defaults (`ENGINE_DEFAULTS`).
An offline `LLM` and a bare `LLMEngine` use `ENGINE_DEFAULTS`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from laneserve.gpu_worker.model_files import DEFAULT_MODEL
from laneserve.gpu_worker.slo import parse_slo

__all__ = [
    "CPU_BATCH_PROFILE",
    "CPU_INTERACTIVE_PROFILE",
    "ENGINE_DEFAULTS",
    "LANES",
    "EngineConfig",
    "EngineConfigError",
    "LaneProfile",
    "SpeculativeConfig",
    "add_engine_arguments",
    "config_from_args",
    "lane_profile",
    "parse_bytes",
]

LANES = ("interactive", "batch")
DTYPES = ("auto", "bfloat16", "float16", "float32")
POOLING_TYPES = ("LAST", "MEAN")  # vLLM's PoolerConfig.pooling_type names (gpu_worker/pooling.py)
QUANTIZATIONS = ("auto", "none", "int8", "int4")  # weight-only kernels (gpu_worker/quantization.py)


class EngineConfigError(ValueError):
    """An engine option out of range, of the wrong type, or unknown (JSON form)."""


def parse_bytes(text: str | int | None) -> int | None:
    """``"2GiB"``, ``"512MiB"``, ``"1.5GB"`` or a plain integer -> bytes; None passes through.

    Raises:
        ValueError: anything else.
    """
    if text is None or isinstance(text, int):
        return text
    s = text.strip().lower().replace(" ", "")
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9}
    for suffix, mult in (*units.items(), ("b", 1)):
        if s.endswith(suffix):
            return int(float(s[: -len(suffix)]) * mult)
    return int(s)


def _parse_lanes(text: str) -> tuple[str, ...]:
    lanes = tuple(lane.strip() for lane in text.split(",") if lane.strip())
    if not lanes or any(lane not in LANES for lane in lanes):
        raise argparse.ArgumentTypeError(f"expected lanes from {LANES}, got {text!r}")
    return lanes


def _cli_bytes(text: str) -> int:
    try:
        size = parse_bytes(text)
    except ValueError:
        size = None
    if not size or size < 1:
        raise argparse.ArgumentTypeError(f"expected a size such as 2GiB, got {text!r}")
    return size


def _cli_count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


# ------------------------------------------------------------------------------ lane profile


@dataclass(frozen=True, slots=True)
class LaneProfile:
    """Step knobs chosen by what a worker serves and where it runs (DESIGN.md "Lanes").

    Attributes:
        max_num_seqs: most requests running at once (the decode batch cap).
        max_num_batched_tokens: token budget of one step (prefill chunks + decodes).
        interactive_batch_token_cap: batch-lane tokens per step while interactive requests run.
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    interactive_batch_token_cap: int = 512


# The engine's own defaults: a GPU worker, a batch-only worker on a GPU, an offline `LLM`.
ENGINE_DEFAULTS = LaneProfile()

# A CPU worker serving interactive traffic. A new request only enters the engine between steps, so
# the running step bounds TTFT, and every batch token in a step that also decodes an interactive
# request lengthens its TPOT. Measured on a 2-core EPYC, bf16 SmolLM2-135M, one torch thread (what
# `laneserve up` gives a worker on 2 cores), ms per step: decode batch 1 / 8 / 32 / 48 / 64 =
# 25 / 37 / 81 / ~110 / 165; prefill 64 / 128 tokens ~60 / 105.
# - budget 48: the step an arriving interactive request waits for stays near 110 ms, while batch
#   decodes stay near their best tokens/s (batch 32-48); longer interactive prompts prefill in
#   48-token chunks, which costs them little (prefill is compute-bound from ~64 tokens);
# - 8 batch tokens beside interactive requests: ~1.5x their idle TPOT;
# - 64 running requests: a decode batch of 64 is already past the best tokens/s on such a CPU,
#   more seats only add KV and queueing inside the engine.
# Without interactive traffic batch gets the whole budget (DESIGN.md "Lanes inside one worker").
CPU_INTERACTIVE_PROFILE = LaneProfile(
    max_num_seqs=64, max_num_batched_tokens=48, interactive_batch_token_cap=8
)
# A batch-only CPU worker: the large step budget, the CPU's seat count.
CPU_BATCH_PROFILE = LaneProfile(max_num_seqs=64)


def lane_profile(lanes: Iterable[str], on_gpu: bool, slo_control: bool = False) -> LaneProfile:
    """The step knobs of a worker serving `lanes` on a GPU (`on_gpu`) or a CPU. Under SLO
    control (gpu_worker/step_budget.py) the controller sizes every step and the knobs are only
    upper bounds: the engine defaults, with the CPU's seat count on a CPU."""
    if on_gpu:
        return ENGINE_DEFAULTS
    if slo_control:
        return CPU_BATCH_PROFILE
    return CPU_INTERACTIVE_PROFILE if "interactive" in lanes else CPU_BATCH_PROFILE


def _parse_slo(text: str) -> str:
    try:
        parse_slo(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


# ------------------------------------------------------------------------------ speculation

SPEC_METHODS = ("ngram", "none")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding by n-gram prompt lookup (vLLM's `speculative_config` names).

    Attributes:
        method: "ngram" (draft from the request's own prompt + output) or "none" (off).
        num_speculative_tokens: most draft tokens per request per step (k). 4 by default: on
            copy-heavy text runs of 4+ accepted tokens are common, and each draft is one more
            query row of the step when it is rejected.
        prompt_lookup_min / prompt_lookup_max: shortest / longest suffix n-gram looked up
            (the longest matching n wins; vLLM's knobs).
        adaptive: laneserve's own knob. True: each step the engine drafts only what its measured
            step cost and each request's acceptance rate say pays (gpu_worker/spec_decode.py);
            False: always draft up to k tokens where a match exists (operator forces it on).

    Raises (constructor):
        EngineConfigError: an unknown method, a count below 1, or min > max.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise EngineConfigError(
                f"speculative_config method must be one of {SPEC_METHODS}, got {self.method!r}"
            )
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise EngineConfigError(
                    f"speculative_config {name} must be an integer >= 1, got {value!r}"
                )
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise EngineConfigError(
                f"speculative_config prompt_lookup_min={self.prompt_lookup_min} > "
                f"prompt_lookup_max={self.prompt_lookup_max}"
            )
        if type(self.adaptive) is not bool:
            raise EngineConfigError(
                f"speculative_config adaptive must be a bool, got {self.adaptive!r}"
            )

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_any(cls, value: Any) -> SpeculativeConfig | None:
        """A `SpeculativeConfig`, its dict form (vLLM's), or its JSON text -> config; None -> None.

        Raises:
            EngineConfigError: bad JSON, not an object, an unknown key, or a bad value.
        """
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise EngineConfigError(f"speculative_config is not JSON: {exc}") from None
        if not isinstance(value, dict):
            raise EngineConfigError(
                f"speculative_config must be an object, got {type(value).__name__}"
            )
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise EngineConfigError(
                f"unknown speculative_config key(s) {unknown}; known: {sorted(names)}"
            )
        return cls(**value)


def _cli_speculative(text: str) -> SpeculativeConfig:
    try:
        return SpeculativeConfig.from_any(text)
    except EngineConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# ------------------------------------------------------------------------------ the options


def _opt(
    default: Any,
    help: str,
    *,
    flag: str | None = None,
    parse: Callable[[str], Any] | None = None,
    choices: tuple[str, ...] | None = None,
    nargs: str | None = None,
) -> Any:
    """A field of `EngineConfig` with what its command-line flag needs."""
    meta = {"help": help, "flag": flag, "parse": parse, "choices": choices, "nargs": nargs}
    return field(default=default, metadata=meta)


_POSITIVE = (
    "block_size",
    "num_blocks",
    "kv_cache_memory_bytes",
    "max_num_seqs",
    "max_num_batched_tokens",
    "long_prefill_token_threshold",
    "max_model_len",
    "interactive_batch_token_cap",
    "batch_token_budget",
)
_PROFILE_FIELDS = tuple(f.name for f in dataclasses.fields(LaneProfile))


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Engine options (DESIGN.md "Engine" vocabulary; counts in tokens, memory in bytes).

    Raises (constructor):
        EngineConfigError: a count below 1, an empty or unknown lane.
    """

    model: str = _opt(DEFAULT_MODEL, "model alias, .gguf file or Hugging Face directory")
    dtype: str = _opt("auto", "weights and KV dtype; auto: bfloat16 on a GPU or a bf16-capable "
                      "CPU, float32 otherwise", choices=DTYPES)  # fmt: skip
    device: str | None = _opt(None, "torch device, e.g. cpu or cuda:1 (default: cuda when present)")
    block_size: int = _opt(16, "tokens per KV block")
    num_blocks: int | None = _opt(None, "KV blocks (default: what --kv-cache-memory holds)")
    kv_cache_memory_bytes: int | None = _opt(
        None,
        "KV pool size, e.g. 2GiB (default: about 2 GiB on CPU, 80%% of free GPU memory)",
        flag="--kv-cache-memory",
        parse=_cli_bytes,
    )
    max_num_seqs: int | None = _opt(
        None, "most requests running at once (default: lane profile; 256, 64 on a CPU worker)"
    )
    max_num_batched_tokens: int | None = _opt(
        None, "token budget per engine step (default 2048: an upper bound under SLO control; "
        "with --no-slo-control, 48 on a CPU worker serving interactive traffic)"
    )  # fmt: skip
    long_prefill_token_threshold: int | None = _opt(
        None, "largest prefill chunk of one request per step (default: the budget)"
    )
    enable_prefix_caching: bool = _opt(True, "reuse cached KV blocks of shared prompt prefixes")
    max_model_len: int | None = _opt(
        None, "longest sequence (default: the model's, capped to what the KV pool holds)"
    )
    interactive_batch_token_cap: int | None = _opt(
        None, "batch-lane tokens per step while interactive requests run (default 512: an "
        "upper bound under SLO control; with --no-slo-control, 8 on a CPU worker serving "
        "interactive traffic)"
    )  # fmt: skip
    batch_token_budget: int | None = _opt(
        None, "batch-lane tokens per step even without interactive traffic (default: none, "
        "batch gets the whole budget then)"
    )  # fmt: skip
    slo: str | None = _opt(
        None, "per-lane latency targets (P99 ms), e.g. 'interactive:ttft=800,tpot=60 "
        "batch:tpot=400' (default: derived from a start-up profile of this worker)",
        parse=_parse_slo,
        nargs="+",
    )  # fmt: skip
    slo_control: bool | None = _opt(
        None, "size every step from the SLO targets and the measured step cost (default: on "
        "for `laneserve worker` and `up`, off for an offline LLM); the step flags above "
        "stay upper bounds"
    )  # fmt: skip
    lanes: tuple[str, ...] = _opt(LANES, "lanes served, comma-separated", parse=_parse_lanes)
    enforce_eager: bool = _opt(False, "no CUDA graphs for decode steps (CUDA only)")
    quantization: str = _opt("auto", "weight-only kernels: auto = a GGUF's own Q4_0/Q4_1/Q8_0 "
                             "on CPU (int4 / int8), none = dequantized, int8, int4",
                             choices=QUANTIZATIONS)  # fmt: skip
    pooling_type: str = _opt(
        "LAST", "how /v1/embeddings pools the final hidden states (L2-normalized): LAST = the "
        "last prompt token's (what a causal model's last position has read), MEAN = the average "
        "over every prompt token", choices=POOLING_TYPES
    )  # fmt: skip
    speculative_config: SpeculativeConfig | dict | None = _opt(
        None, 'speculative decoding as JSON, vLLM\'s names: {"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5, '
        '"adaptive": true} (default: off)', parse=_cli_speculative
    )  # fmt: skip

    def __post_init__(self) -> None:
        object.__setattr__(self, "lanes", tuple(self.lanes))
        spec = SpeculativeConfig.from_any(self.speculative_config)
        object.__setattr__(self, "speculative_config", spec)
        for name in _POSITIVE:
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 1):
                raise EngineConfigError(f"{name} must be an integer >= 1, got {value!r}")
        if not self.lanes or any(lane not in LANES for lane in self.lanes):
            raise EngineConfigError(
                f"lanes must be a non-empty list from {LANES}, got {self.lanes}"
            )
        if str(self.pooling_type).upper() not in POOLING_TYPES:
            raise EngineConfigError(
                f"pooling_type must be one of {POOLING_TYPES}, got {self.pooling_type!r}"
            )
        object.__setattr__(self, "pooling_type", str(self.pooling_type).upper())
        if len(set(self.lanes)) != len(self.lanes):
            raise EngineConfigError(f"lanes repeat: {self.lanes}")
        if self.slo is not None:
            try:
                parse_slo(self.slo)
            except ValueError as exc:
                raise EngineConfigError(str(exc)) from None

    def with_profile(self, profile: LaneProfile = ENGINE_DEFAULTS) -> EngineConfig:
        """This config with every step knob left at None taken from `profile`."""
        missing = {n: getattr(profile, n) for n in _PROFILE_FIELDS if getattr(self, n) is None}
        return dataclasses.replace(self, **missing) if missing else self

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON/msgpack values (lanes as a list)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["lanes"] = list(self.lanes)
        if self.speculative_config is not None:
            out["speculative_config"] = self.speculative_config.to_dict()
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: Any) -> EngineConfig:
        """Inverse of `to_dict`.

        Raises:
            EngineConfigError: not an object, an unknown key, or a value of the wrong type.
        """
        if not isinstance(data, dict):
            raise EngineConfigError(f"engine config must be an object, got {type(data).__name__}")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise EngineConfigError(f"unknown engine option(s) {unknown}")
        for name, value in data.items():
            _check_type(name, fields[name].type, value)
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> EngineConfig:
        """Inverse of `to_json` (raises EngineConfigError on bad JSON too)."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise EngineConfigError(f"engine config is not JSON: {exc}") from None
        return cls.from_dict(data)


_TYPE_CHECKS: dict[str, Callable[[Any], bool]] = {
    "str": lambda v: type(v) is str,
    "int": lambda v: type(v) is int,
    "bool": lambda v: type(v) is bool,
    "None": lambda v: v is None,
    "tuple[str, ...]": lambda v: type(v) in (list, tuple) and all(type(x) is str for x in v),
    "dict": lambda v: type(v) is dict,
    "SpeculativeConfig": lambda v: isinstance(v, SpeculativeConfig),
}


def _check_type(name: str, annotation: str, value: Any) -> None:
    if not any(_TYPE_CHECKS[t.strip()](value) for t in annotation.split("|")):
        raise EngineConfigError(f"engine option {name} must be {annotation}, got {value!r}")


# ------------------------------------------------------------------------------ command line


def add_engine_arguments(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, exclude: Iterable[str] = ()
) -> None:
    """Register one flag per `EngineConfig` field (``--block-size`` for `block_size`, ...).

    Every flag defaults to None ("not given"), so `config_from_args` keeps the field's default,
    or the lane profile for the step knobs.
    """
    skip = set(exclude)
    defaults = EngineConfig()
    for f in dataclasses.fields(EngineConfig):
        if f.name in skip:
            continue
        meta = f.metadata
        flag = meta["flag"] or "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        shown = ",".join(default) if isinstance(default, tuple) else default
        help_text = meta["help"] if default is None else f"{meta['help']} (default: {shown})"
        kwargs: dict[str, Any] = {"dest": f.name, "default": None, "help": help_text}
        if meta["flag"]:
            kwargs["metavar"] = meta["flag"].lstrip("-").replace("-", "_").upper()
        if f.type.startswith("bool"):
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = meta["parse"] or (_cli_count if "int" in f.type else str)
            if meta["choices"]:
                kwargs["choices"] = meta["choices"]
            if meta.get("nargs"):
                kwargs["nargs"] = meta["nargs"]
        parser.add_argument(flag, **kwargs)


def config_from_args(
    args: argparse.Namespace, base: EngineConfig | None = None, exclude: Iterable[str] = ()
) -> EngineConfig:
    """`base` (default: `EngineConfig()`) with every engine flag given on the command line
    (`exclude`: the fields `add_engine_arguments` was told to leave out).

    Raises:
        EngineConfigError: a value out of range.
    """
    skip = set(exclude)
    given = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(EngineConfig)
        if f.name not in skip and getattr(args, f.name, None) is not None
    }
    if isinstance(given.get("slo"), list):  # --slo interactive:... batch:...
        given["slo"] = " ".join(given["slo"])
    return dataclasses.replace(base or EngineConfig(), **given)
