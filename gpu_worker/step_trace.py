"""The worker's step trace (`LANESERVE_STEP_TRACE`): one JSON line per measured engine step,
what the SLO controller (gpu_worker/step_budget.py) saw, planned, predicted and measured."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from laneserve.gpu_worker.step_budget import BudgetController, StepBudget, StepView
    from laneserve.gpu_worker.step_cost import StepFeatures

__all__ = ["StepTrace"]

logger = logging.getLogger(__name__)


class StepTrace:
    """An open trace file, line-buffered for appending (workers of one stack share it)."""

    def __init__(self, file: Any) -> None:
        self._file = file

    @classmethod
    def open(cls, path: Path | None) -> StepTrace | None:
        """The trace at `path`, or None (unset, or it cannot be opened: a warning, and the
        worker runs without a trace)."""
        if path is None:
            return None
        try:
            return cls(open(path, "a", buffering=1, encoding="utf-8"))  # noqa: SIM115 (a life)
        except OSError as exc:
            logger.warning("cannot open the step trace %s: %s", path, exc)
            return None

    def write(
        self, ctl: BudgetController, start: float, view: StepView | None, plan: StepBudget,
        features: StepFeatures, ms: float, target: float | None, predicted: float, paced: bool,
    ) -> bool:  # fmt: skip
        """One line: the worker's pid, the step's start (monotonic s), what the plan saw
        (`view`) and chose (`plan`), what ran (`features`), the prediction, the target it was
        planned within (None: none), the measured time, the headrooms, the cost model's
        coefficients as the plan used them (ms, ms/token, ms/row, ms/ktoken, ms/kpair) and the
        targets. False when the trace stopped (a full disk or a closed file)."""
        record = {
            "pid": os.getpid(),  # workers of one stack share the file
            "t": round(start, 6),
            "view": view._asdict() if view is not None else None,
            "plan": plan._asdict(),
            "features": features._asdict(),
            "predicted_ms": round(predicted, 3),
            "measured_ms": round(ms, 3),
            "target_ms": target,
            "paced": paced,
            "headroom": round(ctl.headroom, 3),
            "slack_headroom": round(ctl.slack_headroom, 3),
            "coefficients": [round(c, 5) for c in ctl.model.coefficients],
            "tpot_target_ms": ctl.targets.interactive.tpot_ms,
            "ttft_target_ms": ctl.targets.interactive.ttft_ms,
            "robust_prompt": ctl.robust_prompt(),
        }
        try:
            self._file.write(json.dumps(record) + "\n")
            return True
        except (OSError, ValueError) as exc:
            logger.warning("step trace stopped: %s", exc)
            return False

    def close(self) -> None:
        self._file.close()
