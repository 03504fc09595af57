"""SLO-driven step budgets: per-lane latency targets -> each step's token budget and batch share.

Operators state targets, not knobs (DESIGN.md "Lanes", "SLO-driven steps"): per lane a TTFT and
a TPOT target (P99, ms), ``--slo interactive:ttft=800,tpot=60 batch:tpot=400``. Each step the
`BudgetController` reads the scheduler's state and the worker's own step-cost model
(`gpu_worker.step_cost.StepCostModel`, fitted online from every step) and picks:

- **interactive streams running**: batch gets what the model predicts fits beside the
  interactive decodes within ``headroom x`` the interactive TPOT target, as an average over
  steps: the fraction of a batch row the target affords accrues as credit, and a step takes
  the whole tokens of it (at least ``min_batch_rate`` tokens a step on average, so batch never
  stops). A whole row forced into every step cost ~20 % of a CPU decode step, as much as the
  TPOT target's margin, and left the stream's TPOT at the target whatever the headroom. An
  arriving interactive prompt prefills in chunks of up to what fits in half its TTFT target, and
  at least `MIN_PREFILL_CHUNK` tokens, so it is not starved by the TPOT pacing (TPOT is a mean
  over a stream's tokens: one longer step moves it little, many short ones cost TTFT; with many
  streams running even their decodes alone may overrun half the TTFT target);
- **an interactive prompt waiting, no stream yet**: the prompt gets the whole budget (TTFT), batch
  the share it would get beside one stream;
- **no interactive request running or waiting** (the batch lane alone): the step is sized for
  the batch lane's throughput, and its only bound is how long an interactive arrival may wait
  for it (it waits for the running step, then prefills): step time <= ``slack_headroom x`` the
  TTFT slack, and at least the interactive TPOT target. Where the worker runs interactive steps
  between its layers (gpu_worker/interleave.py), an arrival waits for one of `interleave_pieces`:
  the target is that many pieces (`interleave_pieces_short` in a step under
  `interleave_split_rows` rows) of at most the slack and `_stream_piece` each.
  The slack is planned for an arrival with a robust prompt length ``p`` (`robust_prompt`: the
  90th percentile of the last 128 interactive prompts once 10 came, never below
  `TYPICAL_PROMPT` = 256 tokens): ``ttft - prefill(p)`` for an operator's TTFT target, and
  ``(TTFT_MULTIPLE - 1) x prefill(p)`` for a derived one, so that arrival's TTFT stays within
  that multiple of its idle TTFT. No single prompt moves it: a one-token "Hi" once shrank the
  slack (a running mean then) and with it every later batch-only step to 1-4 tokens, and a bulk
  job to 0.4x of its rate alone. Decodes never crowd prefill out: while batch prompts wait to
  be prefilled, the step holds as many batch decodes as fit half of that time
  (`batch_decode_rows`; the scheduler rotates the ones it skips, so every request progresses)
  and a prefill chunk that fits the rest (at least `MIN_PREFILL_CHUNK` tokens); with nothing to
  prefill, decodes take it all. A worker that serves no interactive lane expects no arrival:
  its steps take the whole budget (`batch-worker`; the slack once held a batch-only worker's
  200-token embeddings to one a step). Each plan names its rule (`StepBudget.reason`, in the
  step trace).

Speculative drafts (`gpu_worker/spec_decode.py` proposes them before the step is planned, and
only those it judged worth verifying) count against the budget like any tokens, so the plan holds
them: a stream's drafts are priced into the base cost beside which batch gets its share, a
batch-only step holds its decodes' drafts as far as its time target allows, and a step carrying
stream drafts is not judged against the TPOT target (it emits several tokens a stream). A budget
of `rows + 1` once left a lone stream one draft a step, whatever `num_speculative_tokens` said.

The plan aims at a headroom (0.5 .. 1.0) times the step's target, one for the steps interactive
streams pace (``headroom``, against the TPOT target) and one for batch-only steps
(``slack_headroom``, against their target: the TTFT slack, at least the TPOT target); each
follows its own steps' measured times, every 64 steps: when they averaged over 0.85 of their
target, it shrinks by 10 %; when they averaged under 0.75 of it, or fewer than 8 had one, it
grows back by 3 % (so a headroom drifts back towards 1.0 while its kind of step is absent: after
a stretch of streams, the first batch-only steps aim at their whole slack until their own
measurements say otherwise). Apart, because one headroom let a tight TPOT target
shrink batch-only steps too (batch beside interactive traffic at 0.36-0.47x of alone, twice as
slow). The mean, not a high percentile: TPOT is a mean over a stream's steps, and on a jittery
CPU the slowest of 64 lone decode steps runs over twice their median whatever the plan (a P99
rule held the headroom at its floor, starving batch work for no TPOT gain). An interactive
prompt's prefill beside running streams counts with the TPOT target: it lengthens those streams'
TPOT, and less batch beside them is the only compensation (frequent arrivals can so hold the
headroom at its floor; with no batch running that costs nothing, with batch waiting it leaves
the streams' steps at `min_batch_rate`: a lone decode step sits near 0.77 of a target of 1.3x
its median, between the thresholds, so the headroom stays where the prefills put it while
streams run). A batch-only step planned over its slack on purpose (the minimum chunk): no target.
The fixed knobs (``max_num_batched_tokens``, ``interactive_batch_token_cap``,
``batch_token_budget``) stay hard upper bounds, applied by the scheduler.

Defaults: targets the operator does not give come from the start-up profile
(`gpu_worker.step_profile.profile_engine`):
interactive TPOT = `TPOT_MULTIPLE` x the idle single-stream decode step as measured there (the
median of its batch-1 decode steps: the linear fit, dominated by large steps, once predicted
twice the real one), then x the lone decode steps measured while serving (wall clock, so the
engine loop's own overhead counts, as it does in the TPOT a client sees); interactive TTFT =
`TTFT_MULTIPLE` x the idle TTFT of a `TYPICAL_PROMPT`-token prompt as the cost model predicts it,
re-derived every `RETARGET_STEPS` measured steps (within 0.5-4x the start-up value), so both
derived targets follow the machine the worker really runs on (a machine that turns twice as
slow gets targets twice as long, not a TTFT target its running decodes alone overrun); batch
targets are `BATCH_MULTIPLE` times the
interactive ones at start (batch is judged on throughput; its attainment is reported).

Per-lane attainment is the fraction of the last `ATTAINMENT_WINDOW` finished requests of the lane
whose engine-side TTFT and TPOT both met the targets.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import statistics
import time
from typing import TYPE_CHECKING, Any, NamedTuple

from laneserve.contracts import env
from laneserve.gpu_worker.slo import (  # noqa: F401 (re-exported: the targets' names)
    BATCH_MULTIPLE,
    LANES,
    TPOT_MULTIPLE,
    TTFT_MULTIPLE,
    TYPICAL_PROMPT,
    LaneSlo,
    SloTargets,
    default_targets,
    derived_ttft,
    prefill_features,
)
from laneserve.gpu_worker.step_cost import StepCostModel, StepFeatures
from laneserve.gpu_worker.step_trace import StepTrace

if TYPE_CHECKING:
    from laneserve.gpu_worker.request import Request

__all__ = ["BudgetController", "StepBudget", "StepView", "default_targets"]

logger = logging.getLogger(__name__)

# The prompt an interactive arrival is planned for while batch runs alone (`robust_prompt`): the
# ROBUST_PROMPT_QUANTILE of the last PROMPT_WINDOW interactive prompts once MIN_PROMPTS_SEEN came,
# never below TYPICAL_PROMPT. A running mean of the prompts seen once let one "Hi" (max_tokens 1,
# ~30 tokens templated) shrink every later batch-only step to 1-4 tokens (docs/benchmarks.md Run
# 24). A high quantile is robust both ways: short prompts never shrink the steps, a few odd long
# ones (under 1 in 10) never stretch them.
ROBUST_PROMPT_QUANTILE = 0.9
PROMPT_WINDOW = 128
MIN_PROMPTS_SEEN = 10
# Prefill tokens a step with prompts to prefill always has room for (a batch-only step's batch
# prompts, an interactive prompt beside running streams): at least the rows from which the linears
# run dense GEMMs (gpu_worker/quantization.py: 10 rows in bf16, 32 in float32; on a CPU with AMX,
# bf16 calls of 5 to 512 rows run the AMX matmuls, which cost about the same per call from 5 to 16
# rows, so the floor costs nothing there either). Below that a CPU step pays the per-row GEMV
# price for every prompt token (a bulk job beside the TTFT slack ran at 0.6x on an AVX2 CPU). It
# also keeps the cost model seeing steps of real size: fed only tiny ones, its fit once planned
# 5-token chunks and held a 64-seat worker at 3 running requests.
MIN_PREFILL_CHUNK = 32
MIN_BATCH_RATE = 0.25  # batch tokens per step beside interactive streams, at least (average)
RETARGET_STEPS = 64  # measured steps between re-derivations of a derived TTFT target
ATTAINMENT_WINDOW = 200  # finished requests per lane
IDLE_STEPS_TO_LEARN = 20  # lone decode steps before a derived TPOT target follows them
_HEADROOM_WINDOW = 64  # measured steps between headroom updates
CALIBRATION_STEPS = 16  # batch-only steps whose measured / predicted time plans the next
_HEADROOM_MIN_STEPS = 8  # steps with a target a window needs to judge the headroom by


# ------------------------------------------------------------------------------ the controller


class StepView(NamedTuple):
    """What the scheduler holds before a step: running interactive streams and batch requests,
    the KV tokens each group attends to (`context`, `batch_context`), the prompt tokens
    interactive requests still have to prefill, and the speculative drafts proposed for the
    coming step (`gpu_worker/spec_decode.py`) of the streams and of the batch decodes."""

    interactive_running: int
    batch_running: int
    context: int
    interactive_waiting_tokens: int
    batch_context: int = 0
    batch_prefill_tokens: int = 0  # batch prompt tokens still to prefill (running and waiting)
    batch_decodes: int = 0  # running batch requests that decode this step (the rest prefill)
    batch_prefill_depth: int = 0  # computed tokens of the deepest running batch prefill
    interactive_prefill_depth: int = 0  # the same of the interactive prompts being prefilled
    interactive_drafts: int = 0  # draft tokens proposed for the running streams
    batch_drafts: int = 0  # draft tokens proposed for the running batch decodes
    # (computed, left) of each batch prompt to prefill in a step's order; (): one, depth-deep
    batch_prefill_parts: tuple[tuple[int, int], ...] = ()


class StepBudget(NamedTuple):
    """A step's plan: `token_budget` (all lanes), `batch_tokens` (the batch lane's share, None
    for no separate cap), `batch_decode_rows` (batch decodes this step, None for all),
    `batch_drafts` (speculative draft tokens of batch decodes the plan holds, None: no bound
    but the budget and the cap) and `reason`: ``streams`` (paced by running interactive streams'
    TPOT target), ``prompt`` (an interactive prompt waits to prefill: the whole budget),
    ``batch-alone`` (no interactive request: sized for the batch lane's throughput within the
    TTFT slack), ``batch-alone-min-chunk`` (the same, over the slack on purpose to keep
    `MIN_PREFILL_CHUNK` prefill tokens) or ``batch-worker`` (the worker serves no interactive
    lane: the whole budget)."""

    token_budget: int
    batch_tokens: int | None
    batch_decode_rows: int | None = None
    batch_drafts: int | None = None
    reason: str = ""  # which rule sized it (the step trace's `plan.reason`)


class BudgetController:
    """Picks each step's budget from the targets and the cost model (module docstring).

    Args:
        targets: the per-lane targets.
        model: the step-cost model (updated by `observe`).
        max_tokens: the scheduler's `max_num_batched_tokens` (a hard bound).
        min_batch_rate: batch tokens per step, on average, while streams run (module docstring).
        wall_clock: time each step itself (from one `schedule()` to the next); False when the
            caller reports step times through `observe` (tests replaying step-cost traces).
        given_ttft: the interactive TTFT target is the operator's (else derived: the batch-only
            step's slack is then also bounded relative to the prompts seen, module docstring).
        given_tpot: the interactive TPOT target is the operator's (else derived, and it follows
            the lone decode steps the worker measures, `_learn_idle_step`).
        serves_interactive: the worker serves the interactive lane (else no arrival is waited
            for: every step may take `max_tokens`).
    """

    def __init__(
        self,
        targets: SloTargets,
        model: StepCostModel,
        max_tokens: int,
        min_batch_rate: float = MIN_BATCH_RATE,
        wall_clock: bool = True,
        given_ttft: bool = False,
        given_tpot: bool = True,
        serves_interactive: bool = True,
    ) -> None:
        self.wall_clock = wall_clock
        self.serves_interactive = serves_interactive
        self.targets = targets
        self.model = model
        self.max_tokens = max_tokens
        self.min_batch_rate = min_batch_rate
        self._batch_credit = 0.0  # batch tokens owed beside streams (fractions of a row accrue)
        self.headroom = 1.0  # of streams' steps: lowered when they run over the TPOT target
        self.slack_headroom = 1.0  # of batch-only steps, against the TTFT slack
        self.given_ttft = given_ttft
        self.given_tpot = given_tpot
        self._idle: collections.deque[float] = collections.deque(maxlen=64)  # lone decodes, ms
        self._prompts: collections.deque[int] = collections.deque(maxlen=PROMPT_WINDOW)
        self._robust_prompt = TYPICAL_PROMPT  # of `_prompts`, kept by `note_arrival`
        self.last = StepBudget(max_tokens, None)
        self.last_target_ms: float | None = None
        self.predicted_ms = 0.0  # of the last step scheduled
        self.measured_ms = 0.0  # EMA of measured steps
        self.prediction_error_ms = 0.0  # EMA of |measured - predicted|
        # measured / target of this window's steps: [others with a target, TPOT-paced ones]
        self._ratios: tuple[list[float], list[float]] = ([], [])
        self._met: dict[str, collections.deque[bool]] = {
            lane: collections.deque(maxlen=ATTAINMENT_WINDOW) for lane in LANES
        }
        # (features, start, target, predicted ms, paced, batch-only) of the step scheduled last
        self._pending: tuple[StepFeatures, float, float | None, float, bool, bool] | None = None
        self._last_update = 0.0
        self._num_observed = 0
        self.last_paced = False
        self._start_ttft = targets.interactive.ttft_ms
        self._view: StepView | None = None  # of the step planned last (for the trace)
        self._trace = StepTrace.open(env.get("LANESERVE_STEP_TRACE")) if wall_clock else None
        # pieces an interactive arrival's wait is cut into where the worker runs interactive
        # steps at a step's pause points (gpu_worker/interleave.py), else the whole step: in a
        # step of `interleave_split_rows` rows or more, and in a shorter one
        self.interleave_pieces, self.interleave_pieces_short, self.interleave_split_rows = 1, 1, 0
        self._interleaved_s = 0.0  # of the step in flight: not its own time
        self._alone_steps: dict[bool, collections.deque[tuple[StepFeatures, float]]] = {
            prefill: collections.deque(maxlen=CALIBRATION_STEPS) for prefill in (True, False)
        }  # by whether a step carried a prefill chunk (`alone_calibration`)

    # --- planning ---
    def _batch_share(self, rows: int, view: StepView, target_ms: float, drafts: int = 0) -> float:
        """Batch tokens (a fraction of one, maybe) that fit beside `rows` interactive decodes
        (over `view.context`) and their `drafts` within `target_ms`, each counted as a batch
        decode row (the dearer kind: a token, a row and an average batch request's context
        read)."""
        base = self.model.predict(StepFeatures(rows + drafts, rows, view.context))
        return max(0.0, (target_ms - base) / self._batch_row_ms(view))

    def _batch_row_ms(self, view: StepView) -> float:
        """Predicted cost of one batch decode row (ms): a token, a row, an average context."""
        coef = self.model.coefficients
        avg_ctx = view.batch_context / max(view.batch_running, 1)
        return max(coef[1] + coef[2] + coef[3] * avg_ctx / 1000.0, 1e-6)

    def robust_prompt(self) -> int:
        """The prompt length (tokens) an interactive arrival is planned for: the
        `ROBUST_PROMPT_QUANTILE` of the last `PROMPT_WINDOW` interactive prompts once
        `MIN_PROMPTS_SEEN` came (nearest rank), never below `TYPICAL_PROMPT` (set per arrival)."""
        return self._robust_prompt

    def ttft_slack(self) -> float:
        """How long a step may run while an interactive arrival waits for it (ms), for an
        arrival with a `robust_prompt`: an operator's TTFT target less the predicted prefill of
        that prompt; with a derived target (stated for a `TYPICAL_PROMPT`-token prompt)
        ``TTFT_MULTIPLE - 1`` times that prefill, so an arrival of the robust length keeps its
        TTFT within `TTFT_MULTIPLE` x its idle TTFT, as a `TYPICAL_PROMPT` one keeps the target
        (module docstring)."""
        prefill = self.model.predict(prefill_features(self.robust_prompt()))
        if self.given_ttft:
            return self.targets.interactive.ttft_ms - prefill
        return (TTFT_MULTIPLE - 1.0) * prefill

    def alone_calibration(self, prefill: bool) -> float:
        """Measured time of the last `CALIBRATION_STEPS` batch-only steps (min-chunk ones too)
        with a prefill chunk (`prefill`: half `MIN_PREFILL_CHUNK` or more tokens that sample
        nothing) or without, over what the model predicts for them now (median, 0.5-2; 1
        before 4 came): their plans aim the model's prediction at their target divided by it, so
        a model that swings neither shrinks nor stretches them. Each kind apart: a bulk job's
        decode-only steps measured 0.64-0.88 of their prediction, its prompt steps 0.84-0.95."""
        steps = self._alone_steps[prefill]
        if len(steps) < 4:
            return 1.0
        ratio = statistics.median(ms / self.model.predict(f) for f, ms in steps)
        return min(max(ratio, 0.5), 2.0)

    def _stream_piece(self, tpot: float) -> float:
        """The longest piece (ms) of an interleaved batch-only step that a stream started inside
        it may wait for between its tokens: the TPOT target less a lone decode (the stream's
        own interleaved step), at least half the target (a stream spends at most one step's
        remainder at that pace, TPOT is a mean over its tokens)."""
        decode = self.model.predict(StepFeatures(1, 1, TYPICAL_PROMPT))
        return max(tpot - decode, 0.5 * tpot)

    def _batch_only(self, view: StepView, ms: float) -> tuple[int, int, float, int]:
        """(token budget, batch decode rows, predicted ms, batch drafts) of a batch-only step
        aimed at `ms`: while prompts wait to be prefilled, the decodes that fit half of `ms` (at
        least one) and a prefill chunk that fits the rest (at least `MIN_PREFILL_CHUNK`; priced
        by `StepCostModel.chunk_cost` over the prompts it takes, `StepView.batch_prefill_parts`);
        otherwise every decode that fits (at least one). The budget also
        holds the drafts speculation proposed for the decodes it takes (their share of
        `view.batch_drafts`), priced as tokens, as many as fit the time left."""
        coef = self.model.coefficients
        decodes = view.batch_decodes
        per_row = self._batch_row_ms(view)
        room = max(ms - coef[0], 0.0)
        if view.batch_prefill_tokens:
            depth, parts = view.batch_prefill_depth, view.batch_prefill_parts
            rows = min(decodes, max(1, int(0.5 * room / per_row)))
            chunk = self.model.chunk_within(room - rows * per_row, depth, parts)
            chunk = min(max(MIN_PREFILL_CHUNK, chunk), view.batch_prefill_tokens)
            chunk_ms = self.model.chunk_cost(chunk, depth, parts)
        else:
            chunk, rows, chunk_ms = 0, min(decodes, max(1, int(room / per_row))), 0.0
        # the drafts of the decodes it takes, as far as the time left holds them
        drafts = round(view.batch_drafts * rows / decodes) if decodes else 0
        left = ms - (coef[0] + chunk_ms + rows * per_row)
        drafts = min(drafts, max(0, int(left / max(coef[1], 1e-6))))
        predicted = coef[0] + chunk_ms + rows * per_row + drafts * coef[1]
        return max(1, rows + drafts + chunk), rows, predicted, drafts

    def _prompt_chunk(self, view: StepView, room: int = 0) -> int:
        """An arriving prompt's chunk beside the running streams: as few steps as its TTFT
        allows (what fits half the TTFT target, at least `MIN_PREFILL_CHUNK` and `room`): one
        long step barely moves a stream's TPOT (a mean over its tokens), many short ones cost
        TTFT."""
        fits = self.model.max_tokens_within(
            0.5 * self.targets.interactive.ttft_ms,
            view.interactive_running, view.context, view.interactive_prefill_depth,
        )  # fmt: skip
        return min(view.interactive_waiting_tokens, max(room, fits, MIN_PREFILL_CHUNK))

    def interleaved_budget(self, view: StepView) -> int:
        """The token budget of an interleaved step (gpu_worker/interleave.py: the interactive
        requests alone): the whole budget for a prompt with no stream running, else the
        streams' decodes and a `_prompt_chunk`, as a regular step plans them."""
        rows = view.interactive_running
        budget = rows + self._prompt_chunk(view) if rows else self.max_tokens
        return max(1, min(budget, self.max_tokens))

    def note_arrival(self, prompt_tokens: int) -> None:
        """An interactive request with `prompt_tokens` arrived (`robust_prompt` reads them)."""
        self._prompts.append(prompt_tokens)
        if len(self._prompts) >= MIN_PROMPTS_SEEN:
            ranked = sorted(self._prompts)
            k = min(len(ranked), math.ceil(ROBUST_PROMPT_QUANTILE * len(ranked))) - 1
            self._robust_prompt = max(TYPICAL_PROMPT, ranked[k])

    def plan(self, view: StepView) -> StepBudget:
        """The budget of the next step."""
        self._view = view
        rows_cap = drafts_cap = None
        tpot = self.targets.interactive.tpot_ms
        h = self.headroom
        if view.interactive_running:
            target = tpot
            rows = view.interactive_running
            drafts = view.interactive_drafts
            rate = max(self._batch_share(rows, view, h * target, drafts), self.min_batch_rate)
            self._batch_credit += rate  # below 1 after every step: no bursts
            room = int(self._batch_credit)
            self._batch_credit -= room
            chunk = self._prompt_chunk(view, room)
            # The streams' drafts have room (speculation proposes only those it judged worth
            # verifying; a stream's TPOT is per token, and a verified run emits several): a step
            # that sends them is not judged against one token's target (`on_scheduled`).
            budget = rows + drafts + chunk + max(room, 1)
            batch = room  # a prompt's prefill here keeps the TPOT target (module docstring)
            reason = "streams"
        else:
            self._batch_credit = 0.0  # owed beside streams only
            if view.interactive_waiting_tokens:
                target = None  # the prompt's prefill: TTFT, as fast as the budget allows
                budget = self.max_tokens
                batch = max(1, int(self._batch_share(1, view, h * tpot)))
                reason = "prompt"
            elif not self.serves_interactive:
                target, budget, batch, reason = None, self.max_tokens, None, "batch-worker"
            else:
                slack = self.ttft_slack()
                target = max(tpot, slack)
                if self.interleave_pieces > 1:  # an arrival waits for one piece of it
                    piece = self._stream_piece(tpot)
                    piece = min(slack, piece) if slack > 0 else piece
                    target = self.interleave_pieces * piece
                prefill = view.batch_prefill_tokens >= MIN_PREFILL_CHUNK // 2
                hs, cal = self.slack_headroom, self.alone_calibration(prefill)
                budget, rows_cap, predicted, drafts_cap = self._batch_only(view, hs * target / cal)
                if budget < self.interleave_split_rows and self.interleave_pieces > 1:
                    target = self.interleave_pieces_short * piece  # its gate/up runs whole
                    ms = hs * target / cal
                    budget, rows_cap, predicted, drafts_cap = self._batch_only(view, ms)
                reason = "batch-alone"
                if predicted * cal > hs * target:
                    target = None  # planned over the slack on purpose: not a headroom miss
                    reason = "batch-alone-min-chunk"
                batch = None
        budget = max(1, min(budget, self.max_tokens))
        self.last = StepBudget(budget, batch, rows_cap, drafts_cap, reason)
        self.last_target_ms = target  # the target itself; the plan aimed at headroom x it
        self.last_paced = target is not None and bool(view.interactive_running)
        return self.last

    # --- measuring ---
    def on_scheduled(self, features: StepFeatures, stream_drafts: bool = False) -> None:
        """The step just built runs `features`: remember its prediction and start time.
        `stream_drafts`: it sends speculative drafts of interactive streams, so it emits several
        tokens a stream and is not judged against one token's TPOT target."""
        if stream_drafts:
            self.last_target_ms, self.last_paced = None, False
        self._interleaved_s = 0.0
        self.predicted_ms = self.model.predict(features)
        self._pending = (
            features, time.monotonic(), self.last_target_ms, self.predicted_ms, self.last_paced,
            self.last.reason.startswith("batch-alone"),
        )  # fmt: skip

    def observe_interleaved(
        self, start: float, view: StepView, features: StepFeatures, ms: float
    ) -> None:
        """An interleaved step (gpu_worker/interleave.py) ran `features` in `ms` (its forward to
        its outputs): the cost model learns from it, and the step trace gets a line whose plan
        reason is ``interleaved``. It counts for no headroom window (it has no target) and
        not for the derived TPOT target (timed without a whole loop's overhead)."""
        predicted = self.model.predict(features)
        if self._trace is not None:
            plan = StepBudget(features.tokens, None, reason="interleaved")
            self._write_trace(start, features, ms, None, predicted, False, view, plan)
        self.model.update(features, ms)

    def note_interleaved(self, seconds: float) -> None:
        """The step in flight spent `seconds` running interleaved steps: not its own time."""
        self._interleaved_s += seconds

    def on_step_done(self) -> None:
        """The scheduled step computed (`Scheduler.update_after_step`)."""
        self._last_update = time.monotonic()

    def observe_pending(self, now: float) -> None:
        """Fold the previous step's measured time into the model: from its schedule to this
        schedule when the engine went straight on, else to its update (idle gaps excluded)."""
        if self._pending is None or not self.wall_clock:
            return
        features, start, target, predicted, paced, alone = self._pending
        self._pending = None
        done = self._last_update
        if done < start:
            return  # never completed (engine step failed)
        gap = now - done
        ms = (now - start if gap < max(0.005, 0.5 * (done - start)) else done - start) * 1000.0
        ms, self._interleaved_s = max(ms - 1000.0 * self._interleaved_s, 0.0), 0.0
        if self._trace is not None:
            self._write_trace(start, features, ms, target, predicted, paced)
        self.observe(features, ms, target, predicted, paced, alone)

    def _write_trace(
        self, start: float, features: StepFeatures, ms: float, target: float | None,
        predicted: float, paced: bool, view: StepView | None = None,
        plan: StepBudget | None = None,
    ) -> None:  # fmt: skip
        """One line of the step trace (`gpu_worker.step_trace.StepTrace.write`) for a step
        planned as `plan` from `view` (the last plan and its view by default)."""
        view, plan = (view, plan) if plan is not None else (self._view, self.last)
        if not self._trace.write(self, start, view, plan, features, ms, target, predicted, paced):
            self._trace = None

    def observe(
        self,
        features: StepFeatures,
        measured_ms: float,
        target_ms: float | None = None,
        predicted_ms: float | None = None,
        paced: bool | None = None,
        alone: bool | None = None,
    ) -> None:
        """Fold one measured step in: the cost model, the EMAs, and the headroom feedback.
        `alone`: a batch-only plan (min-chunk ones included; None: a step with a target that
        streams did not pace), kept for `alone_calibration`.
        `paced`: the step was paced by interactive streams (their TPOT target); None infers it
        from `target_ms` being that target (traces replayed by tests; a batch-only step whose
        slack is below the TPOT target, so aimed at it, then counts as paced: the worker itself
        always passes `paced`)."""
        if paced is None:
            paced = target_ms is not None and target_ms == self.targets.interactive.tpot_ms
        predicted = self.model.predict(features) if predicted_ms is None else predicted_ms
        self.model.update(features, measured_ms)
        a = 0.1
        self.measured_ms = measured_ms if not self.measured_ms else (
            (1 - a) * self.measured_ms + a * measured_ms
        )  # fmt: skip
        self.prediction_error_ms = (1 - a) * self.prediction_error_ms + a * abs(
            measured_ms - predicted
        )
        if features.tokens == 1 and features.rows == 1 and not self.given_tpot:
            self._learn_idle_step(measured_ms)
        self._num_observed += 1
        if not self.given_ttft and self._num_observed % RETARGET_STEPS == 0:
            self._follow_model_ttft()
        if target_ms:
            self._ratios[paced].append(measured_ms / target_ms)
        if alone if alone is not None else (target_ms is not None and not paced):
            prefill = features.tokens - features.rows >= MIN_PREFILL_CHUNK // 2
            self._alone_steps[prefill].append((features, measured_ms))
        if self._num_observed % _HEADROOM_WINDOW == 0:
            self._adjust_headroom()

    def _learn_idle_step(self, ms: float) -> None:
        """A lone decode step took `ms` (wall clock, the engine loop's own overhead included):
        a derived interactive TPOT target follows `TPOT_MULTIPLE` x the median of the last 64
        (after `IDLE_STEPS_TO_LEARN` of them), so it is the multiple of the TPOT an idle
        stream really gets here, not of the start-up profile's bare engine step."""
        self._idle.append(ms)
        if len(self._idle) >= IDLE_STEPS_TO_LEARN:
            self._set_interactive(tpot_ms=round(TPOT_MULTIPLE * statistics.median(self._idle), 1))

    def _follow_model_ttft(self) -> None:
        """A derived interactive TTFT target: `TTFT_MULTIPLE` x the predicted idle TTFT of a
        `TYPICAL_PROMPT`-token prompt under the model as it is now (as at start-up), within
        0.5-4x the start-up target (the fit sees mostly decode steps: it extrapolates a prefill)."""
        ttft = min(max(derived_ttft(self.model), 0.5 * self._start_ttft), 4.0 * self._start_ttft)
        self._set_interactive(ttft_ms=ttft)

    def _set_interactive(self, **targets: float) -> None:
        """Replace interactive targets (`ttft_ms`, `tpot_ms`) the controller derives itself."""
        i = dataclasses.replace(self.targets.interactive, **targets)
        self.targets = dataclasses.replace(self.targets, interactive=i)

    def _adjust_headroom(self) -> None:
        """Every `_HEADROOM_WINDOW` measured steps, each headroom by its own steps (streams'
        steps: `headroom`; the others with a target, batch-only ones: `slack_headroom`)."""
        others, paced = self._ratios
        self._ratios = ([], [])
        self.headroom = _next_headroom(self.headroom, paced)
        self.slack_headroom = _next_headroom(self.slack_headroom, others)

    def on_finish(self, request: Request) -> None:
        """Count a finished request towards its lane's attainment (engine-side TTFT, TPOT)."""
        if request.first_token_time is None:
            return
        slo = self.targets.lane(str(request.lane))
        ttft = (request.first_token_time - request.arrival_time) * 1000.0
        n = request.num_output_tokens
        ok = ttft <= slo.ttft_ms
        if n >= 2 and request.last_token_time is not None:
            tpot = (request.last_token_time - request.first_token_time) * 1000.0 / (n - 1)
            ok = ok and tpot <= slo.tpot_ms
        self._met[str(request.lane)].append(ok)

    def attainment(self, lane: str) -> float | None:
        """Fraction (0..1) of the lane's recent finished requests that met both targets."""
        met = self._met[lane]
        return sum(met) / len(met) if met else None

    def stats(self) -> dict[str, Any]:
        """Figures for worker stats / worker_stats (targets in ms, attainment 0..1)."""
        t = self.targets
        return {
            "slo_interactive_ttft_ms": t.interactive.ttft_ms,
            "slo_interactive_tpot_ms": t.interactive.tpot_ms,
            "slo_batch_ttft_ms": t.batch.ttft_ms,
            "slo_batch_tpot_ms": t.batch.tpot_ms,
            "slo_interactive_attainment": self.attainment("interactive"),
            "slo_batch_attainment": self.attainment("batch"),
            "step_token_budget": self.last.token_budget,
            "step_batch_tokens": self.last.batch_tokens,
            "predicted_step_ms": round(self.predicted_ms, 3),
            "measured_step_ms": round(self.measured_ms, 3),
            "step_cost_error_ms": round(self.prediction_error_ms, 3),
            "slo_headroom": round(self.headroom, 3),
        }


def _next_headroom(headroom: float, ratios: list[float]) -> float:
    """`headroom` after a window whose steps took `ratios` (measured / target): 10 % less when
    they averaged over 0.85, 3 % more when under 0.75 or fewer than `_HEADROOM_MIN_STEPS` had a
    target, within 0.5 .. 1.0 (module docstring)."""
    mean = statistics.fmean(ratios) if len(ratios) >= _HEADROOM_MIN_STEPS else 0.0
    if mean > 0.85:
        return max(0.5, headroom * 0.9)
    if mean < 0.75:
        return min(1.0, headroom * 1.03)
    return headroom
