"""Per-lane latency targets (SLOs): `LaneSlo`, `SloTargets`, and `parse_slo` for the operator's
``--slo interactive:ttft=800,tpot=60 batch:tpot=400`` text (DESIGN.md "SLO-driven steps").

Targets the operator leaves out are derived at start-up from the measured step cost
(`gpu_worker.step_budget.default_targets`).
"""

from __future__ import annotations

from dataclasses import dataclass

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
