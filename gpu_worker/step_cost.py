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

It is fitted by least squares with exponential forgetting (``forgetting``, lambda: the weight
of a sample ``k`` steps old is ``lambda ** k``), so a machine that slows down (thermal
throttling, a noisy neighbour, a 2x slower synthetic step) is followed within a few dozen steps,
and a prior that is never forgotten, in information form (recursive least squares' normal
equations, solved each step: five features make that a 5x5 solve)::

    A = lambda A + x x',   b = lambda b + x t                    (the data)
    s = sum lambda^k (theta0 . x_k) t_k / sum lambda^k (theta0 . x_k)^2   (the prior's scale)
    theta = (A + w I)^-1 (b + w s theta0)

``theta0`` comes from a short start-up profile (`fit_least_squares` over a handful of measured
steps); ``s`` is the one-number fit of its shape to the recent steps (2 on a machine twice as
slow). The prior's weight ``w`` (``prior_weight``, in scaled steps) decides only the directions
the recent steps leave undetermined (a small ridge pull on every direction, decisive only where
the steps carry little information): a bulk job's batch-only steps are a 32-token chunk beside a
few decode rows, their context read, the chunk's attention and the fixed cost all growing with
the chunk's depth, and recursive least squares with forgetting (covariance form, the prior
forgotten) traded them freely: replaying a slow machine's trace, it priced a batch decode row at
~4 ms (the prior shape scaled, ~1.7) and predicted those steps 15-20 % long, against 0-5 % with
the prior kept (one-step errors 22-26 % of a step against 16 %). Predictions are at least
``min_step_ms`` and use no coefficient below ``floor_fraction`` of its prior (tokens and rows
move together in decode steps, so the fit alone can trade one coefficient for another). A step
change of the cost (``reset_after`` steps in a row off by more than ``reset_error``, relative)
keeps only ``reset_keep`` of the data so far (then forgotten as usual), so the model relearns
at once instead of at the forgetting factor's pace. Pure Python: no numpy, no torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

__all__ = ["StepCostModel", "StepFeatures", "chunk_pairs", "fit_least_squares", "parts_pairs"]

NUM_FEATURES = 5
# Scale of each feature so the fit works on numbers near 1 (a 256-token step, 32 rows, 8k ctx,
# the 33k pairs of a 256-token prompt's prefill).
_SCALE = (1.0, 1 / 256, 1 / 32, 1 / 8, 1 / 32)


def chunk_pairs(num_new: int, depth: int) -> int:
    """(query, key) pairs causal attention computes for a chunk of `num_new` tokens after
    `depth` computed ones: ``num_new * depth + num_new * (num_new + 1) / 2``."""
    return num_new * depth + num_new * (num_new + 1) // 2


def parts_pairs(num_new: int, parts: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """(attention pairs, context read) of `num_new` prefill tokens taken in order from `parts`,
    each one prompt's (tokens computed, tokens left to prefill), as the scheduler takes them
    (its running prefills, then the waiting prompts): each prompt's `chunk_pairs` from its own
    depth, and its depth plus the tokens it computes. Tokens past the last part continue it. A
    waiting prompt's prefix-cache hit is not known before it is admitted: priced from its start
    (a deep hit computes fewer tokens, each deeper). One chunk of 900 tokens over three fresh
    300-token prompts computes a third of the pairs of one 900-token prompt; a bound from the
    longest prompt and the deepest prefill once priced a bulk job's steps at up to 2.4x their
    attention (docs/benchmarks.md Run 37)."""
    pairs = context = 0
    left = num_new
    for i, (depth, rest) in enumerate(parts):
        if left <= 0:
            break
        take = left if i == len(parts) - 1 else min(left, rest)
        pairs += chunk_pairs(take, depth)
        context += depth + take
        left -= take
    return pairs, context


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
    """Least-squares step-time model fitted online, with forgetting and a kept prior (see the
    module docstring).

    Args:
        theta0: prior coefficients per raw unit ``[ms, ms/token, ms/row, ms/ktoken,
            ms/kpair]``.
        forgetting: forgetting factor lambda in (0, 1]; 0.97 remembers ~30 steps.
        prior_weight: the prior's weight ``w`` (scaled steps' worth per feature): it decides
            what the recent steps leave undetermined. 0.1: replaying a slow machine's step
            trace, 0.03-0.1 gave the smallest one-step errors (0.01 and 1.0 a little larger).
        min_step_ms: floor of every prediction.
        floor_fraction: predictions use no coefficient below this fraction of its prior.
        reset_error, reset_after, reset_keep: when that many steps in a row are off by more
            than that fraction, only `reset_keep` of the data so far is kept.
    """

    theta0: Sequence[float]
    forgetting: float = 0.97
    prior_weight: float = 0.1
    min_step_ms: float = 0.05
    floor_fraction: float = 0.25
    reset_error: float = 0.25
    reset_after: int = 4
    reset_keep: float = 0.05

    def __post_init__(self) -> None:
        if len(self.theta0) != NUM_FEATURES:
            raise ValueError(f"theta0 needs {NUM_FEATURES} coefficients, got {len(self.theta0)}")
        if not 0.0 < self.forgetting <= 1.0:
            raise ValueError(f"forgetting must be in (0, 1], got {self.forgetting}")
        if not self.prior_weight > 0.0:
            raise ValueError(f"prior_weight must be > 0, got {self.prior_weight}")
        if not 0.0 < self.reset_keep <= 1.0:
            raise ValueError(f"reset_keep must be in (0, 1], got {self.reset_keep}")
        self.theta = _to_scaled(self.theta0)
        self._prior = list(self.theta)  # scaled units
        # Predictions use no coefficient below `floor_fraction` of its prior (the fit itself is
        # left alone: clamping inside the fit made it oscillate): tokens and rows move together in
        # decode steps, so the fit can trade one coefficient for another, and a batch row's
        # fitted cost (token + row + context) near 0 once priced a 512-token batch chunk beside
        # an interactive stream as free (a 1.8 s step, planned within a 33 ms target).
        self._floor = [self.floor_fraction * max(t, 0.0) for t in self.theta]
        n = NUM_FEATURES
        self.info = [[0.0] * n for _ in range(n)]  # A: sum of lambda^k x x'
        self.moment = [0.0] * n  # b: sum of lambda^k x t
        self._prior_sums = [0.0, 0.0]  # sum of lambda^k (theta0 . x) t, of (theta0 . x)^2
        self.prior_scale = 1.0  # s
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
        """The most tokens a step of `rows` decodes over `context` KV tokens may add as one
        prefill chunk `depth` tokens into its prompt and still be predicted to take at most
        `ms` (0 when even no token fits)."""
        return self.chunk_within(ms - self.predict(StepFeatures(rows, rows, context)), depth)

    def chunk_cost(self, n: int, depth: int, parts: Sequence[tuple[int, int]] = ()) -> float:
        """What a prefill chunk of `n` tokens adds to a step (ms): its tokens, its context read
        and its attention (`chunk_pairs`): one prompt `depth` tokens in, or taken in order from
        the prompts `parts` (`parts_pairs`) where it may span several."""
        coef = self.coefficients
        pairs, context = parts_pairs(n, parts) if parts else (chunk_pairs(n, depth), depth + n)
        return max(coef[1], 1e-6) * n + coef[3] * context / 1000.0 + coef[4] * pairs / 1000.0

    def chunk_within(self, ms: float, depth: int, parts: Sequence[tuple[int, int]] = ()) -> int:
        """The longest prefill chunk (one prompt `depth` tokens in, or across `parts`:
        `chunk_cost`) whose `chunk_cost` is at most `ms` (0 when none is): from the root of
        ``q/2 n^2 + b n = ms - c`` for one prompt (``q`` ms per pair, ``b`` per token with the
        chunk's own pairs and context, ``c`` the context read of the `depth` tokens before it;
        across parts, the first one's depth), in the form that stays exact for a tiny ``q``,
        then a search to where the cost reaches `ms` (the cost grows with the chunk)."""
        coef = self.coefficients
        if parts:
            depth = parts[0][0]
        q = coef[4] / 1000.0
        b = max(coef[1], 1e-6) + coef[3] / 1000.0 + q * (depth + 0.5)
        room = ms - coef[3] * depth / 1000.0
        if room <= 0.0:
            return 0
        guess = int(2.0 * room / (b + math.sqrt(b * b + 2.0 * q * room)))
        if self.chunk_cost(guess, depth, parts) <= ms:
            n, hi = guess, guess + 1  # double past `ms`, then bisect
            while self.chunk_cost(hi, depth, parts) <= ms:
                n, hi = hi, 2 * hi
        else:  # deeper prompts further on (or rounding): bisect below the guess
            n, hi = 0, guess
        while hi - n > 1:
            mid = (n + hi) // 2
            n, hi = (mid, hi) if self.chunk_cost(mid, depth, parts) <= ms else (n, mid)
        return n

    def update(self, features: StepFeatures, measured_ms: float) -> float:
        """Fold one measured step into the model; returns the prediction error (ms) before it."""
        x = features.vector()
        lam, n, t = self.forgetting, NUM_FEATURES, measured_ms
        error = t - sum(c * xi for c, xi in zip(self.theta, x, strict=True))
        off = abs(error) > self.reset_error * max(t, self.min_step_ms)
        self._num_off = self._num_off + 1 if off else 0
        if self._num_off >= self.reset_after:  # the cost itself changed: relearn quickly
            lam *= self.reset_keep  # the data so far counts this much less, this once
            self._num_off = 0
            self.num_resets += 1
        a, b = self.info, self.moment
        for i in range(n):
            b[i] = lam * b[i] + x[i] * t
            row = a[i]
            for j in range(n):
                row[j] = lam * row[j] + x[i] * x[j]
        p = sum(c * xi for c, xi in zip(self._prior, x, strict=True))
        sums = self._prior_sums
        sums[0] = lam * sums[0] + p * t
        sums[1] = lam * sums[1] + p * p
        if sums[1] > 0.0:  # a prior's shape never fits a negative cost
            self.prior_scale = max(sums[0] / sums[1], 1e-3)
        w = self.prior_weight
        s = w * self.prior_scale
        self.theta = _solve(
            [[v + w if i == j else v for j, v in enumerate(row)] for i, row in enumerate(a)],
            [bi + s * ci for bi, ci in zip(b, self._prior, strict=True)],
        )
        self.num_updates += 1
        return error
