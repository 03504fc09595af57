"""Per-lane latency targets (SLOs): `LaneSlo`, `SloTargets`, and `parse_slo` for the operator's
``--slo interactive:ttft=800,tpot=60 batch:tpot=400`` text (DESIGN.md "SLO-driven steps").

Targets the operator leaves out are derived at start-up from the measured step cost
(`default_targets`: multiples of the idle decode step and of a typical prompt's prefill).
"""

from __future__ import annotations

from dataclasses import dataclass

from laneserve.gpu_worker.step_cost import StepCostModel, StepFeatures, chunk_pairs

LANES = ("interactive", "batch")  # the lanes a target can name


@dataclass(frozen=True, slots=True)
class LaneSlo:
    """One lane's targets (P99, ms)."""

    ttft_ms: float
    tpot_ms: float


@dataclass(frozen=True, slots=True)
class SloTargets:
    interactive: LaneSlo
    batch: LaneSlo

    def lane(self, name: str) -> LaneSlo:
        return self.interactive if name == "interactive" else self.batch


def parse_slo(text: str | None) -> dict[str, dict[str, float]]:
    """``"interactive:ttft=800,tpot=60 batch:tpot=400"`` -> ``{"interactive": {"ttft": 800.0,
    "tpot": 60.0}, "batch": {"tpot": 400.0}}``. Lane specs are separated by spaces or ``;``;
    a target left out is derived at start-up.

    Raises:
        ValueError: an unknown lane or target, a repeated lane, or a value that is not a
            positive number of milliseconds.
    """
    out: dict[str, dict[str, float]] = {}
    for spec in (text or "").replace(";", " ").split():
        lane, sep, body = spec.partition(":")
        if lane not in LANES or not sep:
            raise ValueError(f"SLO {spec!r}: expected LANE:ttft=MS,tpot=MS with LANE in {LANES}")
        if lane in out:
            raise ValueError(f"SLO for the {lane} lane given twice")
        targets: dict[str, float] = {}
        for item in body.split(","):
            name, eq, value = item.partition("=")
            if name not in ("ttft", "tpot") or not eq:
                raise ValueError(f"SLO {spec!r}: targets are ttft=MS and tpot=MS, got {item!r}")
            try:
                ms = float(value)
            except ValueError:
                ms = -1.0
            if not ms > 0 or ms == float("inf"):
                raise ValueError(f"SLO {spec!r}: {name} must be a positive number of ms")
            targets[name] = ms
        out[lane] = targets
    return out


# interactive TPOT target / idle single-stream step. Issue 19 asks P99 <= 1.5x the idle P50: the
# target sits below it because steps jitter (15-55 ms for one 20 ms decode on a shared 2-core
# CPU) and P99 of 16 streams is their worst; at 1.45 three runs gave 1.41x / 1.53x / 1.67x.
TPOT_MULTIPLE = 1.3
TTFT_MULTIPLE = 1.8  # interactive TTFT target / idle TTFT (issue 19: <= 2.0x)
TYPICAL_PROMPT = 256  # tokens: the prompt an interactive arrival is assumed to bring
BATCH_MULTIPLE = 10.0  # batch targets / interactive targets


def default_targets(
    model: StepCostModel, given: dict[str, dict[str, float]], idle_step_ms: float | None = None
) -> SloTargets:
    """Targets from the measured step cost where `given` (`parse_slo`) leaves them out;
    `idle_step_ms` is the measured idle single-stream decode step (the model's prediction for
    one when None)."""
    idle_step = idle_step_ms or model.predict(StepFeatures(1, 1, TYPICAL_PROMPT))
    inter = given.get("interactive", {})
    i_slo = LaneSlo(
        inter.get("ttft", derived_ttft(model)),
        inter.get("tpot", round(TPOT_MULTIPLE * idle_step, 1)),
    )
    batch = given.get("batch", {})
    b_slo = LaneSlo(
        batch.get("ttft", round(BATCH_MULTIPLE * i_slo.ttft_ms, 1)),
        batch.get("tpot", round(BATCH_MULTIPLE * i_slo.tpot_ms, 1)),
    )
    return SloTargets(i_slo, b_slo)


def derived_ttft(model: StepCostModel) -> float:
    """The default interactive TTFT target (ms): `TTFT_MULTIPLE` x the predicted idle TTFT (the
    prefill step) of a `TYPICAL_PROMPT`-token prompt."""
    return round(TTFT_MULTIPLE * model.predict(prefill_features(TYPICAL_PROMPT)), 1)


def prefill_features(prompt_tokens: int) -> StepFeatures:
    """The features of an idle step that prefills a whole prompt of `prompt_tokens` tokens."""
    return StepFeatures(prompt_tokens, 1, prompt_tokens, chunk_pairs(prompt_tokens, 0))
