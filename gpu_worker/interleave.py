"""Interactive steps inside a batch-only step's forward pass (the worker's interleaving).

Without it an interactive arrival waits for the whole step in flight, so a batch-only step may
run only as long as the TTFT slack allows (`step_budget.BudgetController.ttft_slack`): ~90
tokens on a 2-core CPU, where the engine itself runs at ~0.8x of its rate at 2,048-token steps
(docs/benchmarks.md Run 24) -- a bulk job alone could not reach the offline engine's speed.

With it a batch-only step's forward calls back at its pause points (`StepInputs.pause`: before each
decoder layer, after its attention block, inside (a step of `SPLIT_ROWS` rows or more) and after
its MLP's gate/up, before the LM head). The worker's callback (`hook`) takes the requests that
arrived meanwhile and, if an interactive request is due a step, runs one (`run_step`):
`Scheduler.schedule_interleaved` picks the interactive requests alone, without preemption (the step
in flight writes its requests' KV blocks) and past `max_num_seqs` if need be, within the budget the
SLO controller would give them (`BudgetController.interleaved_budget`: beside running streams a
prompt's chunk fits half the TTFT target, as in a regular step), and the step runs to its outputs,
which the worker sends at once. The step in flight then goes on: its activations and KV slots are
its own, its requests are all batch ones, and the interleaved step touches none of them. An abort
of one of its requests waits until it ends (`defer_abort`), as freeing its blocks mid-forward would
let another request take them; a request sent again under that id meanwhile waits too (the worker
parks it).

So an arrival waits for one piece of the step, not all of it, and the batch-only step is sized for
throughput: its time target is `pieces` (the pause points, less two for the embedding and the tail
of LM head, sampling and outputs) times a piece of at most the TTFT slack and what a stream started
inside the step may wait between its tokens: the TPOT target less its own decode, at least half the
target (`BudgetController.plan`, `_stream_piece`). A running stream is due its next token when its
gap since the last one, plus what an interleaved step takes, would reach the headroom x its TPOT
target by the next pause (`piece_ms` away); a prompt is due at once. One interleaved step runs per
pause point, so the step in flight always moves on. Interleaving is off (the whole step runs, as
before) for a step that holds an interactive request, off the CPU (a device's forward runs
asynchronously and its graphs have no pause point), without an SLO controller to pace streams by,
and in the offline `LLM` (no `hook`). A prompt's prefix-cache hit stops at the first block the step
in flight is still writing. A small step in flight runs on one thread; interleaved steps get the
worker's threads back. Time spent in interleaved steps is taken out of the step in flight's
measured time, for the step-cost model (`BudgetController.note_interleaved`) and speculation's
timing alike."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from laneserve.contracts.engine_io import EngineOutput
from laneserve.gpu_worker.models.llama import SPLIT_ROWS, pause_pieces
from laneserve.gpu_worker.request import Lane
from laneserve.gpu_worker.scheduler import step_features
from laneserve.gpu_worker.scheduler_output import SchedulerOutput

if TYPE_CHECKING:
    from laneserve.gpu_worker.engine import LLMEngine

__all__ = ["Interleaver"]

logger = logging.getLogger(__name__)

_EMA = 0.2  # weight of the newest interleaved step's time in its running mean


class Interleaver:
    """One engine's layer interleaving (module docstring). `hook` is the worker's callback:
    it takes arrivals and calls `run_step` once if `due()`; None (the default) turns it off."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.hook: Callable[[], None] | None = None
        self.in_flight: frozenset[str] = frozenset()  # request ids of the step in flight
        self._deferred: list[str] = []  # aborts of those, applied when it ends
        self.spent_s = 0.0  # time in the hook during the step in flight
        self.num_steps = 0  # interleaved steps run
        self.step_ms = 0.0  # running mean of an interleaved step's time
        self.piece_ms = 0.0  # running mean of the step in flight's own time between two pauses
        self._left: float | None = None  # when the step in flight last went on (perf_counter)
        self._failed = False  # the hook raised during this step: no more calls to it
        # (free KV blocks, first waiting request) when a waiting prompt found no room in the step
        # in flight: it is not due again while both stay as they were
        self._no_room: tuple[int, str] | None = None
        self._threads = torch.get_num_threads()

    def install(self, hook: Callable[[], None] | None) -> None:
        """Set the worker's callback (None: off) and tell the SLO controller, which then sizes
        batch-only steps for a wait of one of `pieces`."""
        self.hook = hook
        self._threads = torch.get_num_threads()  # the worker's (a small step runs on one)
        ctl = self.engine.scheduler.step_budget
        if ctl is not None:
            on = self.enabled
            ctl.interleave_pieces = self.pieces if on else 1
            ctl.interleave_pieces_short = self.pieces_short if on else 1
            ctl.interleave_split_rows = SPLIT_ROWS if on else 0

    @property
    def pieces(self) -> int:
        """The parts a step's forward is cut into, counted for the longest wait they leave
        (`models.llama.pause_pieces`: the layers' weights over the largest segment's anywhere),
        less two for what runs before the first pause and after the last (the embedding; the LM
        head, sampling and every row's outputs)."""
        return max(1, int(pause_pieces(self.engine.model_config)) - 2)

    @property
    def pieces_short(self) -> int:
        """`pieces` of a step under `SPLIT_ROWS` rows (its gate/up runs whole)."""
        return max(1, int(pause_pieces(self.engine.model_config, split=False)) - 2)

    @property
    def enabled(self) -> bool:
        """A hook, a CPU, and an SLO controller to pace the streams by (without one every
        stream is due at every pause point)."""
        engine = self.engine
        return (
            self.hook is not None
            and engine.device.type == "cpu"
            and engine.scheduler.step_budget is not None
        )

    def layer_hook(self, out: SchedulerOutput) -> Callable[[], None] | None:
        """The callback for the forward of `out` (and the step in flight set), or None when
        that step may not be interleaved."""
        if not self.enabled or not out.scheduled:
            return None
        for e in out.scheduled:  # (a batch embed request's pooled rows are set after the pass)
            if e.request.lane is not Lane.BATCH:
                return None
        self.in_flight = frozenset(e.request.request_id for e in out.scheduled)
        self.spent_s, self._failed, self._no_room = 0.0, False, None
        self._left = time.perf_counter()
        return self._pause

    def _pause(self) -> None:
        if self._failed:
            return
        started = time.perf_counter()
        if self._left is not None:  # the piece of the step in flight since the last pause
            ms = (started - self._left) * 1000.0
            self.piece_ms = ms if not self.piece_ms else (1 - _EMA) * self.piece_ms + _EMA * ms
        threads = torch.get_num_threads()
        if threads != self._threads:  # a small step in flight runs on one thread
            torch.set_num_threads(self._threads)
        try:
            self.hook()
        except Exception:  # the step in flight goes on; its requests are not this code's
            logger.exception("interleaved work failed; the rest of this step runs alone")
            self._failed = True
        finally:
            if threads != self._threads:
                torch.set_num_threads(threads)
            self._left = time.perf_counter()
            self.spent_s += self._left - started

    def end_step(self) -> tuple[float, list[str]]:
        """The step in flight ended: (seconds its forward spent in interleaved work, the aborts
        deferred meanwhile)."""
        spent, deferred = self.spent_s, self._deferred
        self.in_flight, self._deferred, self.spent_s = frozenset(), [], 0.0
        ctl = self.engine.scheduler.step_budget
        if spent and ctl is not None:
            ctl.note_interleaved(spent)
        return spent, deferred

    def aborting(self, request_id: str) -> bool:
        """Whether an abort of `request_id` waits for the step in flight (a request sent again
        under that id must wait for it too)."""
        return request_id in self._deferred

    def defer_abort(self, request_id: str) -> bool:
        """True (and the abort kept for `end_step`) when `request_id` is in the step in flight."""
        if request_id in self.in_flight:
            self._deferred.append(request_id)
            return True
        return False

    def due(self) -> bool:
        """Whether an interactive request is due a step now: a prompt waits, or a running one
        is still prefilling, or a stream's gap since its last token plus an interleaved step's
        time would reach the headroom x the TPOT target by the next pause (a piece of the step
        in flight away: served then, it would be late by up to that piece)."""
        sched = self.engine.scheduler
        if not sched._has_interactive():
            return False
        ctl = sched.step_budget
        pace_ms = 0.0 if ctl is None else ctl.headroom * ctl.targets.interactive.tpot_ms
        now = time.monotonic()
        for r in sched.running:
            if r.lane is not Lane.INTERACTIVE:
                continue
            last = r.last_token_time
            if last is None or (now - last) * 1000.0 + self.step_ms + self.piece_ms >= pace_ms:
                return True
        if not any(r.lane is Lane.INTERACTIVE for r in sched.waiting):
            return False
        return self._no_room != self._room_key()

    def _room_key(self) -> tuple[int, str]:
        sched = self.engine.scheduler
        first = sched.waiting[0].request_id if sched.waiting else ""
        return sched.block_manager.num_free_blocks, first

    def run_step(self) -> list[EngineOutput]:
        """One interleaved step of the interactive requests alone; its outputs."""
        engine = self.engine
        sched = engine.scheduler
        ctl = sched.step_budget
        view = sched._step_view() if ctl is not None else None  # what the step starts from
        budget = ctl.interleaved_budget(view) if ctl is not None else None
        out = sched.schedule_interleaved(budget)
        # a prompt left waiting with budget to spare had no KV room (no preemption here): it
        # waits for the step's end, and is not due at every pause until then
        spare = budget is None or out.num_batched_tokens < budget
        waits = spare and any(r.lane is Lane.INTERACTIVE for r in sched.waiting)
        self._no_room = self._room_key() if waits else None
        if out.is_empty:
            return []
        outputs: list[EngineOutput] = []
        t0, started = time.monotonic(), time.perf_counter()
        with engine.speculation.aside():
            sampled = engine._execute(out, outputs)
            if sampled is not None:
                outputs.extend(engine._update(out, sampled, started))
        engine._embedded = []  # finished by `_update`; the step in flight sets its own
        ms = (time.perf_counter() - started) * 1000.0
        self.step_ms = ms if not self.num_steps else (1 - _EMA) * self.step_ms + _EMA * ms
        self.num_steps += 1
        if ctl is not None and sampled is not None:
            ctl.observe_interleaved(t0, view, step_features(out), ms)
        return outputs
