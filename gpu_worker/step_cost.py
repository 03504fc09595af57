"""Online model of one engine step's cost: step time (ms) as a linear function of what it runs.

The model (Sarathi-Serve and DistServe model step time the same way; here it is fitted online)::

    t_step(ms) ~= theta . x,
    x = [1, scheduled_tokens, decode_rows, context_kilotokens, prefill_kilopairs]

- ``1``: the fixed cost of a step (launch, sampling, Python bookkeeping);
- ``scheduled_tokens``: tokens computed this step (prefill chunks + decodes): the GEMMs'
  compute, linear in the token count once the weights' read is amortized;
- ``decode_rows``: requests that emit a token (sampler and per-row overheads);
- ``context_kilotokens``: KV tokens the step's attention reads (sum over scheduled requests of
  the positions they attend to, / 1000): the memory-bound part that grows with context;
- ``prefill_kilopairs``: the (query, key) pairs prefill chunks attend (`chunk_pairs`: a chunk
  of ``n`` tokens after ``d`` computed ones, ``n d + n (n + 1) / 2``, / 1000): attention's
  compute, which grows with a chunk's length times its depth. Without it a 32-token chunk 700
  tokens into its prompt (75 % dearer than at its start on a 2-core CPU) was charged to the
  context read it counts once: the context coefficient grew 100x, priced a batch decode row at
  ~15 ms instead of ~2, and batch-only steps decoded 1-3 rows while dozens waited.

It is fitted by recursive least squares with exponential forgetting (``forgetting``, the weight
of a sample ``k`` steps old is ``forgetting ** k``), so a machine that slows down (thermal
throttling, a noisy neighbour, a 2x slower synthetic step) is followed within a few dozen steps::

    k     = P x / (lambda + x' P x)
    theta = theta + k (t - theta . x)
    P     = (P - k x' P) / lambda

The prior (``theta0``, with ``P0 = prior_variance * I`` in scaled units) comes from a short
start-up profile (`fit_least_squares` over a handful of measured steps). ``P`` is bounded
(trace at most its start value) so long runs of identical steps cannot wind it up, and
predictions are at least ``min_step_ms``. Predictions use no coefficient below
``floor_fraction`` of its prior (tokens and rows move together in decode steps, so the fit alone
can trade one coefficient for another). A step change of the cost (``reset_after`` steps in a
row off by more than ``reset_error``, relative) resets ``P`` to ``P0`` (covariance resetting),
so the model relearns at once instead of at the forgetting factor's pace. Pure Python (five
features): no numpy, no torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

__all__ = ["StepCostModel", "StepFeatures", "chunk_pairs", "fit_least_squares"]

NUM_FEATURES = 5
# Scale of each feature so the RLS works on numbers near 1 (a 256-token step, 32 rows, 8k ctx,
# the 33k pairs of a 256-token prompt's prefill).
_SCALE = (1.0, 1 / 256, 1 / 32, 1 / 8, 1 / 32)


def chunk_pairs(num_new: int, depth: int) -> int:
    """(query, key) pairs causal attention computes for a chunk of `num_new` tokens after
    `depth` computed ones: ``num_new * depth + num_new * (num_new + 1) / 2``."""
    return num_new * depth + num_new * (num_new + 1) // 2


class StepFeatures(NamedTuple):
    """What one step runs: `tokens` scheduled, `rows` emitting a token, `context` KV tokens
    read by attention (sum over scheduled requests of their attended positions), and
    `prefill_pairs` its prefill chunks' attention (sum of their `chunk_pairs`)."""

    tokens: int
    rows: int
    context: int
    prefill_pairs: int = 0

    def vector(self) -> list[float]:
        """The scaled feature vector ``[1, tokens, rows, context / 1000, prefill_pairs /
        1000]``."""
        raw = (
            1.0, float(self.tokens), float(self.rows), self.context / 1000.0,
            self.prefill_pairs / 1000.0,
        )  # fmt: skip
        return [r * s for r, s in zip(raw, _SCALE, strict=True)]


def _to_scaled(theta: Sequence[float]) -> list[float]:
    """Coefficients per raw unit (ms per token, ...) -> per scaled feature."""
    return [t / s for t, s in zip(theta, _SCALE, strict=True)]


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Solve the small dense system ``a x = b`` (Gaussian elimination, partial pivoting)."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        if abs(m[col][col]) < 1e-12:
            m[col][col] = 1e-12
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


def fit_least_squares(
    samples: Sequence[tuple[StepFeatures, float]], ridge: float = 1e-3
) -> list[float]:
    """Ridge least-squares coefficients (per raw unit: ms, ms/token, ms/row, ms/ktoken,
    ms/kpair) of
    measured ``(features, ms)`` samples; with fewer distinct samples than features the ridge
    term keeps the unseen coefficients near 0.

    Raises:
        ValueError: no samples.
    """
    if not samples:
        raise ValueError("fit_least_squares needs at least one sample")
    ata = [[ridge if i == j else 0.0 for j in range(NUM_FEATURES)] for i in range(NUM_FEATURES)]
    atb = [0.0] * NUM_FEATURES
    for features, ms in samples:
        x = features.vector()
        for i in range(NUM_FEATURES):
            atb[i] += x[i] * ms
            for j in range(NUM_FEATURES):
                ata[i][j] += x[i] * x[j]
    scaled = _solve(ata, atb)
    return [t * s for t, s in zip(scaled, _SCALE, strict=True)]


@dataclass
class StepCostModel:
    """Recursive-least-squares step-time model (see the module docstring).

    Args:
        theta0: prior coefficients per raw unit ``[ms, ms/token, ms/row, ms/ktoken,
            ms/kpair]``.
        forgetting: RLS forgetting factor lambda in (0, 1]; 0.97 remembers ~30 steps.
        prior_variance: initial ``P`` diagonal (scaled units): how far the prior may be off.
        min_step_ms: floor of every prediction.
        floor_fraction: predictions use no coefficient below this fraction of its prior.
        reset_error, reset_after: covariance reset when that many steps in a row are off by
            more than that fraction (module docstring).
    """

    theta0: Sequence[float]
    forgetting: float = 0.97
    prior_variance: float = 100.0
    min_step_ms: float = 0.05
    floor_fraction: float = 0.25
    reset_error: float = 0.25
    reset_after: int = 4

    def __post_init__(self) -> None:
        if len(self.theta0) != NUM_FEATURES:
            raise ValueError(f"theta0 needs {NUM_FEATURES} coefficients, got {len(self.theta0)}")
        if not 0.0 < self.forgetting <= 1.0:
            raise ValueError(f"forgetting must be in (0, 1], got {self.forgetting}")
        self.theta = _to_scaled(self.theta0)
        # Predictions use no coefficient below `floor_fraction` of its prior (the fit itself is
        # left alone: clamping inside RLS made it oscillate): tokens and rows move together in
        # decode steps, so the fit can trade one coefficient for another, and a batch row's
        # fitted cost (token + row + context) near 0 once priced a 512-token batch chunk beside
        # an interactive stream as free (a 1.8 s step, planned within a 33 ms target).
        self._floor = [self.floor_fraction * max(t, 0.0) for t in self.theta]
        n = NUM_FEATURES
        self.p = [[self.prior_variance if i == j else 0.0 for j in range(n)] for i in range(n)]
        self.num_updates = 0
        self.num_resets = 0
        self._num_off = 0  # consecutive steps off by more than reset_error

    def _used(self) -> list[float]:
        """The fitted coefficients (scaled units), none below its floor."""
        return [max(t, lo) for t, lo in zip(self.theta, self._floor, strict=True)]

    @property
    def coefficients(self) -> list[float]:
        """Current coefficients per raw unit ``[ms, ms/token, ms/row, ms/ktoken, ms/kpair]``
        (each at least `floor_fraction` of its prior)."""
        return [t * s for t, s in zip(self._used(), _SCALE, strict=True)]

    def predict(self, features: StepFeatures) -> float:
        """Predicted step time (ms) of a step running `features`."""
        x = features.vector()
        return max(self.min_step_ms, sum(t * xi for t, xi in zip(self._used(), x, strict=True)))

    def max_tokens_within(self, ms: float, rows: int, context: int, depth: int = 0) -> int:
        """The most tokens a step of `rows` emitting rows over `context` KV tokens may add as
        one prefill chunk `depth` tokens into its prompt and still be predicted to take at most
        `ms` (0 when even no token fits)."""
        return self.chunk_within(ms - self.predict(StepFeatures(0, rows, context)), depth)

    def chunk_within(self, ms: float, depth: int) -> int:
        """The longest prefill chunk, `depth` tokens into its prompt, predicted to add at most
        `ms` to a step: its tokens and its attention (`chunk_pairs`), the largest ``n`` with
        ``a n + q (n d + n (n + 1) / 2) <= ms`` (0 when `ms` <= 0)."""
        if ms <= 0:
            return 0
        coef = self.coefficients
        a = max(coef[1], 1e-6)
        q = coef[4] / 1000.0  # ms per pair
        b = a + q * (depth + 0.5)
        if q <= 0.0:
            return int(ms / b)
        n = int((-b + math.sqrt(b * b + 2.0 * q * ms)) / q)  # root of q/2 n^2 + b n = ms
        return n if n * b + 0.5 * q * n * n <= ms else max(0, n - 1)

    def update(self, features: StepFeatures, measured_ms: float) -> float:
        """Fold one measured step into the model; returns the prediction error (ms) before it."""
        x = features.vector()
        lam, p, n = self.forgetting, self.p, NUM_FEATURES
        error = measured_ms - sum(t * xi for t, xi in zip(self.theta, x, strict=True))
        off = abs(error) > self.reset_error * max(measured_ms, self.min_step_ms)
        self._num_off = self._num_off + 1 if off else 0
        if self._num_off >= self.reset_after:  # the cost itself changed: relearn quickly
            self.p = [[self.prior_variance if i == j else 0.0 for j in range(n)] for i in range(n)]
            p = self.p
            self._num_off = 0
            self.num_resets += 1
        px = [sum(p[i][j] * x[j] for j in range(n)) for i in range(n)]
        denom = lam + sum(x[i] * px[i] for i in range(n))
        k = [v / denom for v in px]
        self.theta = [t + ki * error for t, ki in zip(self.theta, k, strict=True)]
        self.p = [[(p[i][j] - k[i] * px[j]) / lam for j in range(n)] for i in range(n)]
        trace = sum(self.p[i][i] for i in range(n))
        limit = self.prior_variance * n
        if trace > limit:  # bounded: no wind-up over long runs of identical steps
            self.p = [[v * limit / trace for v in row] for row in self.p]
        self.num_updates += 1
        return error
