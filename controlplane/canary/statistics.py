"""Always-valid statistics for canary decisions: running sums, confidence sequences, Holm, SRM.

Owns the arithmetic only; no I/O, no database, no policy. :mod:`controlplane.canary.policy`
turns these figures into promote / reject / inconclusive / continue.

- **Running state.** :class:`MetricAccumulator` keeps Welford sums of one per-request metric;
  :class:`ArmAccumulator` keeps one per primary metric for an arm. Both round-trip through JSON,
  so a service can keep them on a database row and add each ingested request.
- **Comparisons.** Arms are compared by the relative difference of their means,
  ``treatment / control - 1`` (delta method for its standard error), on per-request observations
  of independent arms (a live split). Pairing (shadow replay of the same prompts) can only shrink
  the variance, so feeding paired runs in as independent arms stays valid, just conservative.
- **Confidence sequences.** A one-sided normal-mixture boundary (Robbins 1970; Howard et al. 2021;
  the asymptotic confidence sequences of Waudby-Smith et al., arXiv 2103.06476): with
  ``Z = estimate / se`` and information growing like the effective sample size
  ``n_eff = 1 / (1/n_t + 1/n_c)``, the half-normal mixture of ``exp(lambda S - lambda^2 V / 2)``
  over ``lambda > 0`` is a nonnegative supermartingale under the null, so by Ville's inequality
  ``p = 1 / M`` is an *anytime-valid* p-value: the chance that it ever dips below ``alpha``, however
  often it is looked at, is at most ``alpha`` (asymptotically: the variance is a plug-in).
  In closed form, with ``r = V / rho`` the ratio of information to the mixing scale and
  ``a = Z sqrt(r / (1 + r))``::

      M = 2 (1 + r)^(-1/2) exp(a^2 / 2) Phi(a)

  ``rho`` is set so the boundary is tightest at ``tuning_n`` effective samples (the formula of
  Waudby-Smith et al.; GrowthBook's "tuning parameter"). Every function here works elementwise on
  numpy arrays as well as on floats, so the benchmark runs the same code over thousands of streams.
- **Multiplicity.** :func:`holm_reject` is Holm's step-down on anytime p-values; because each
  p-value is valid uniformly over time, so is Holm's family-wise guarantee.
- **Routing.** :func:`sample_ratio_check` tests arm counts against the routing weights with a
  sequential Dirichlet-multinomial Bayes factor (Lindon & Malek 2022, anytime-valid, so it may be
  checked after every batch) and reports Pearson's chi-square beside it for humans.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]

TOKENS_PER_STEP = "tokens_per_step"  # generated tokens / verify steps of one request (higher is better)
LATENCY_MS_PER_TOKEN = "latency_ms_per_token"  # request latency / output tokens (lower is better)
PRIMARY_METRICS = (TOKENS_PER_STEP, LATENCY_MS_PER_TOKEN)

STATE_VERSION = 1
Alternative = Literal["greater", "less"]


# ------------------------------------------------------------------------------- running sums


@dataclass(slots=True)
class MetricAccumulator:
    """Welford running count, mean and sum of squared deviations of one per-request metric."""

    n: int = 0
    mean: float = 0.0
    m2: float = 0.0

    def add(self, value: float) -> None:
        if not math.isfinite(value):
            raise ValueError(f"observation must be finite, got {value!r}")
        self.n += 1
        delta = value - self.mean
        self.mean += delta / self.n
        self.m2 += delta * (value - self.mean)

    def merge(self, other: MetricAccumulator) -> None:
        """Add another accumulator's observations (Chan et al.'s parallel update)."""
        if other.n == 0:
            return
        total = self.n + other.n
        delta = other.mean - self.mean
        self.m2 += other.m2 + delta * delta * self.n * other.n / total
        self.mean += delta * other.n / total
        self.n = total

    @classmethod
    def from_sums(cls, n: float, total: float, total_of_squares: float) -> MetricAccumulator:
        """The state of ``n`` observations known only by their sum and sum of squares (an edge's
        window aggregate), ready to :meth:`merge`.

        ``M2 = sum x^2 - (sum x)^2 / n`` cancels: for per-request metrics of a few units over a
        window's thousands of requests the relative error stays near 1e-12, far below any
        effect a decision resolves. Rounding can push it a hair below zero; it is clamped.
        """
        count = int(round(n))
        if count <= 0:
            return cls()
        values = (float(total), float(total_of_squares))
        if not all(math.isfinite(v) for v in values) or values[1] < 0:
            raise ValueError(f"sums must be finite, the sum of squares non-negative: {values!r}")
        mean = values[0] / count
        return cls(n=count, mean=mean, m2=max(values[1] - values[0] * mean, 0.0))

    @property
    def variance(self) -> float:
        """Sample variance (n - 1 denominator); infinite below two observations."""
        return self.m2 / (self.n - 1) if self.n >= 2 else math.inf

    def to_state(self) -> dict[str, Any]:
        return {"n": self.n, "mean": self.mean, "m2": self.m2}

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> MetricAccumulator:
        return cls(n=int(state["n"]), mean=float(state["mean"]), m2=float(state["m2"]))


@dataclass(frozen=True, slots=True)
class MetricSummary:
    """What a comparison needs from one arm's metric. Fields may be floats or same-shaped arrays."""

    n: Any
    mean: Any
    variance: Any


class ArmAccumulator:
    """One arm's running state: a :class:`MetricAccumulator` per primary metric.

    ``add`` takes one request. For the no-speculation arm ``tokens_per_step`` is 1.0 by definition.
    """

    __slots__ = ("metrics",)

    def __init__(self, metrics: Mapping[str, MetricAccumulator] | None = None) -> None:
        self.metrics: dict[str, MetricAccumulator] = {name: MetricAccumulator() for name in PRIMARY_METRICS}
        for name, accumulator in (metrics or {}).items():
            if name not in self.metrics:
                raise ValueError(f"unknown metric {name!r}; expected one of {PRIMARY_METRICS}")
            self.metrics[name] = accumulator

    def add(self, *, tokens_per_step: float, latency_ms_per_token: float) -> None:
        # Validate both before touching either, so a bad request never leaves the counts unequal.
        for name, value in ((TOKENS_PER_STEP, tokens_per_step), (LATENCY_MS_PER_TOKEN, latency_ms_per_token)):
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a positive finite number, got {value!r}")
        self.metrics[TOKENS_PER_STEP].add(tokens_per_step)
        self.metrics[LATENCY_MS_PER_TOKEN].add(latency_ms_per_token)

    def merge(self, other: ArmAccumulator) -> None:
        for name, accumulator in other.metrics.items():
            self.metrics[name].merge(accumulator)

    @property
    def n(self) -> int:
        return min(accumulator.n for accumulator in self.metrics.values())

    def summary(self, metric: str) -> MetricSummary:
        accumulator = self.metrics[metric]
        return MetricSummary(accumulator.n, accumulator.mean, accumulator.variance)

    def to_state(self) -> dict[str, Any]:
        return {"version": STATE_VERSION, "metrics": {k: v.to_state() for k, v in self.metrics.items()}}

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> ArmAccumulator:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"unsupported arm state version {state.get('version')!r}")
        return cls({k: MetricAccumulator.from_state(v) for k, v in state["metrics"].items()})

    def __repr__(self) -> str:
        return f"ArmAccumulator({self.to_state()['metrics']!r})"


# ------------------------------------------------------------------------ normal-mixture boundary


_ERFC_COEFFICIENTS = (
    0.17087277,
    -0.82215223,
    1.48851587,
    -1.13520398,
    0.27886807,
    -0.18628806,
    0.09678418,
    0.37409196,
    1.00002368,
    -1.26551223,
)


def _normal_cdf(x: FloatArray) -> FloatArray:
    """Standard normal CDF, elementwise, without scipy (erfc of Numerical Recipes, rel. error < 1.2e-7)."""
    z = np.abs(x) / math.sqrt(2.0)
    t = 1.0 / (1.0 + 0.5 * z)
    poly = np.zeros_like(t)
    for coefficient in _ERFC_COEFFICIENTS:  # Horner, highest power first
        poly = poly * t + coefficient
    erfc = t * np.exp(-z * z + poly)
    result: FloatArray = np.where(x >= 0, 1.0 - 0.5 * erfc, 0.5 * erfc)
    return result


def mixing_scale(alpha: float) -> float:
    """``kappa`` such that mixing variance ``n_eff * kappa / tuning_n`` is tightest at ``tuning_n``.

    Waudby-Smith et al.'s optimum ``rho^2 = (-2 ln alpha + ln(1 - 2 ln alpha)) / t*``.
    """
    two_log = -2.0 * math.log(alpha)
    return two_log + math.log(1.0 + two_log)


def information_ratio(n_eff: npt.ArrayLike, *, tuning_n: float, alpha: float) -> FloatArray:
    """``r = V / rho``: accumulated information over the mixing scale (0 with no data)."""
    n = np.maximum(np.asarray(n_eff, dtype=np.float64), 0.0)
    result: FloatArray = n * (mixing_scale(alpha) / tuning_n)
    return result


def log_mixture_evidence(z: npt.ArrayLike, r: npt.ArrayLike) -> FloatArray:
    """log M of the one-sided (half-normal) mixture martingale at standardised statistic ``z``.

    Negative ``z`` counts as 0: the evidence is increasing in ``z`` and already at most 1 at 0,
    and clipping keeps ``exp(a^2/2) Phi(a)`` free of underflow.
    """
    zz = np.maximum(np.nan_to_num(np.asarray(z, dtype=np.float64), nan=0.0, posinf=1e6), 0.0)
    rr = np.maximum(np.asarray(r, dtype=np.float64), 0.0)
    a = zz * np.sqrt(rr / (1.0 + rr))
    result: FloatArray = math.log(2.0) - 0.5 * np.log1p(rr) + 0.5 * a * a + np.log(_normal_cdf(a))
    return result


def anytime_p_value(z: npt.ArrayLike, n_eff: npt.ArrayLike, *, tuning_n: float, alpha: float) -> FloatArray:
    """Anytime-valid one-sided p-value for "the standardised effect ``z`` is above its null".

    ``alpha`` and ``tuning_n`` only place the mixing distribution (fixed by policy before any
    data); any level may be tested against the result.
    """
    log_m = log_mixture_evidence(z, information_ratio(n_eff, tuning_n=tuning_n, alpha=alpha))
    result: FloatArray = np.minimum(1.0, np.exp(-log_m))
    return result


def critical_z(
    n_eff: npt.ArrayLike, level: npt.ArrayLike, *, tuning_n: float, alpha: float, iterations: int = 40
) -> FloatArray:
    """Smallest ``z`` whose anytime p-value is ``level`` (the confidence-sequence radius in SEs).

    Bisection on ``a`` (log M is increasing in it); infinite where no ``z`` reaches the level
    (no information yet).
    """
    if np.ndim(n_eff) == 0 and np.ndim(level) == 0:
        scalar: FloatArray = np.asarray(
            _critical_z_scalar(
                float(np.asarray(n_eff)), float(np.asarray(level)), tuning_n, alpha, iterations
            ),
            dtype=np.float64,
        )
        return scalar
    r = information_ratio(n_eff, tuning_n=tuning_n, alpha=alpha)
    target = -np.log(np.asarray(level, dtype=np.float64))
    base = math.log(2.0) - 0.5 * np.log1p(r)
    low = np.zeros(np.broadcast(r, target).shape)
    high = np.full_like(low, 60.0)
    for _ in range(iterations):
        mid = 0.5 * (low + high)
        above = base + 0.5 * mid * mid + np.log(_normal_cdf(mid)) >= target
        high = np.where(above, mid, high)
        low = np.where(above, low, mid)
    scale = np.sqrt(r / (1.0 + r))
    with np.errstate(divide="ignore"):
        result: FloatArray = np.where(scale > 0, high / np.where(scale > 0, scale, 1.0), np.inf)
    return result


def _critical_z_scalar(n_eff: float, level: float, tuning_n: float, alpha: float, iterations: int) -> float:
    """:func:`critical_z` for one value in plain floats: a service's ``decide`` asks for a few dozen
    bounds, where numpy's per-call overhead on 0-d arrays would dominate."""
    r = max(n_eff, 0.0) * mixing_scale(alpha) / tuning_n
    if r <= 0:
        return math.inf
    target = -math.log(level) - math.log(2.0) + 0.5 * math.log1p(r)
    low, high = 0.0, 60.0
    for _ in range(iterations):
        mid = 0.5 * (low + high)
        if 0.5 * mid * mid + math.log(1.0 - 0.5 * math.erfc(mid / math.sqrt(2.0))) >= target:
            high = mid
        else:
            low = mid
    return high / math.sqrt(r / (1.0 + r))


# ------------------------------------------------------------------------------- comparisons


@dataclass(frozen=True, slots=True)
class RelativeDifference:
    """``treatment / control - 1`` with its delta-method standard error and effective sample size."""

    estimate: FloatArray
    se: FloatArray
    n_eff: FloatArray


def relative_difference(treatment: MetricSummary, control: MetricSummary) -> RelativeDifference:
    """Relative difference of two independent arms' means, elementwise.

    Delta method: ``Var(m_t / m_c) ~ Var(m_t) / m_c^2 + m_t^2 Var(m_c) / m_c^4``. Arms with fewer
    than two observations, or a non-positive control mean, get an infinite standard error
    (a p-value of 1, never a decision).
    """
    n_t = np.asarray(treatment.n, dtype=np.float64)
    n_c = np.asarray(control.n, dtype=np.float64)
    m_t = np.asarray(treatment.mean, dtype=np.float64)
    m_c = np.asarray(control.mean, dtype=np.float64)
    valid = (n_t >= 2) & (n_c >= 2) & (m_c > 0)
    safe_nt = np.where(valid, n_t, 1.0)
    safe_nc = np.where(valid, n_c, 1.0)
    safe_mc = np.where(valid, m_c, 1.0)
    var_t = np.where(valid, np.asarray(treatment.variance, dtype=np.float64), 0.0) / safe_nt
    var_c = np.where(valid, np.asarray(control.variance, dtype=np.float64), 0.0) / safe_nc
    estimate = np.where(valid, m_t / safe_mc - 1.0, 0.0)
    se = np.sqrt(var_t / safe_mc**2 + m_t**2 * var_c / safe_mc**4)
    # A zero-variance pair (identical constant arms) carries no evidence either way.
    se = np.where(valid & (se > 0), se, np.inf)
    n_eff = np.where(valid, 1.0 / (1.0 / safe_nt + 1.0 / safe_nc), 0.0)
    return RelativeDifference(estimate, se, n_eff)


def standardised_effect(diff: RelativeDifference, null_value: float, alternative: Alternative) -> FloatArray:
    """Standardised distance of the estimate from ``null_value`` in the direction of the alternative."""
    sign = 1.0 if alternative == "greater" else -1.0
    with np.errstate(invalid="ignore"):
        z = sign * (diff.estimate - null_value) / diff.se
    result: FloatArray = np.where(np.isfinite(diff.se), z, 0.0)
    return result


def one_sided_p_value(
    diff: RelativeDifference, null_value: float, alternative: Alternative, *, tuning_n: float, alpha: float
) -> FloatArray:
    """Anytime p-value of H0 "effect <= null" (alternative "greater") or "effect >= null" ("less")."""
    return anytime_p_value(
        standardised_effect(diff, null_value, alternative), diff.n_eff, tuning_n=tuning_n, alpha=alpha
    )


def confidence_bounds(
    estimate: npt.ArrayLike,
    se: npt.ArrayLike,
    n_eff: npt.ArrayLike,
    level: npt.ArrayLike,
    *,
    tuning_n: float,
    alpha: float,
) -> tuple[FloatArray, FloatArray]:
    """Lower and upper bounds, each one-sided at ``level``: together a ``1 - 2 level`` sequence."""
    radius = critical_z(n_eff, level, tuning_n=tuning_n, alpha=alpha) * np.asarray(se, dtype=np.float64)
    est = np.asarray(estimate, dtype=np.float64)
    return est - radius, est + radius


def mean_confidence_interval(
    summary: MetricSummary, level: float, *, tuning_n: float, alpha: float
) -> tuple[float, float]:
    """Two-sided ``1 - level`` confidence sequence for one arm's mean (``level / 2`` each side)."""
    if summary.n < 2 or not math.isfinite(summary.variance):
        return (-math.inf, math.inf)
    se = math.sqrt(summary.variance / summary.n)
    low, high = confidence_bounds(summary.mean, se, summary.n, level / 2, tuning_n=tuning_n, alpha=alpha)
    return float(low), float(high)


# ----------------------------------------------------------------------------------- multiplicity


def _ranks(p: FloatArray) -> npt.NDArray[np.int64]:
    """Rank of each p-value on the last axis (0 = smallest; ties broken by position).

    Pairwise comparisons rather than a sort: the families here have two or three hypotheses and
    the benchmark evaluates millions of them, where broadcasting beats ``argsort``.
    """
    m = p.shape[-1]
    earlier = np.tri(m, m, -1, dtype=bool).T  # earlier[j, i]: j comes before i
    smaller = (p[..., :, None] < p[..., None, :]) | ((p[..., :, None] == p[..., None, :]) & earlier)
    result: npt.NDArray[np.int64] = smaller.sum(axis=-2)
    return result


def holm_reject(p_values: npt.ArrayLike, alpha: float) -> BoolArray:
    """Holm's step-down over the last axis: which hypotheses are rejected at family-wise ``alpha``.

    Via Holm-adjusted p-values: ``p_adj(i) = max over j ranked at or before i of (m - rank_j) p_j``.
    """
    p = np.asarray(p_values, dtype=np.float64)
    m = p.shape[-1]
    ranks = _ranks(p)
    scaled = (m - ranks) * p
    before = ranks[..., :, None] <= ranks[..., None, :]  # [j, i]: j ranked at or before i
    adjusted = np.max(np.where(before, scaled[..., :, None], 0.0), axis=-2)
    rejected: BoolArray = adjusted <= alpha
    return rejected


def holm_levels(p_values: npt.ArrayLike, alpha: float) -> FloatArray:
    """The level Holm compares each p-value with: ``alpha / (m - rank)`` (rank 0 = smallest p)."""
    p = np.asarray(p_values, dtype=np.float64)
    result: FloatArray = alpha / (p.shape[-1] - _ranks(p))
    return result


# ------------------------------------------------------------------------- sample-ratio mismatch


def chi_square_survival(statistic: float, df: int) -> float:
    """P(chi2_df >= statistic) for integer ``df`` (closed forms; no scipy in the service)."""
    if df < 1:
        raise ValueError("df must be at least 1")
    if statistic <= 0:
        return 1.0
    half = statistic / 2.0
    if df % 2 == 0:
        term, total = 1.0, 1.0
        for i in range(1, df // 2):
            term *= half / i
            total += term
        return min(1.0, math.exp(-half) * total)
    total = math.erfc(math.sqrt(half))
    term = math.sqrt(half) / math.gamma(1.5)
    for i in range(1, (df - 1) // 2 + 1):
        total += math.exp(-half) * term
        term *= half / (i + 0.5)
    return min(1.0, total)


@dataclass(frozen=True, slots=True)
class SampleRatioCheck:
    """Do the arms' request counts fit the routing weights? ``flagged`` uses the anytime p-value."""

    flagged: bool
    sequential_p_value: float
    chi_square: float
    chi_square_p_value: float
    counts: dict[str, int]
    expected_shares: dict[str, float]
    observed_shares: dict[str, float]
    alpha: float

    def as_dict(self) -> dict[str, Any]:
        return {
            "flagged": self.flagged,
            "sequential_p_value": self.sequential_p_value,
            "chi_square": self.chi_square,
            "chi_square_p_value": self.chi_square_p_value,
            "counts": dict(self.counts),
            "expected_shares": dict(self.expected_shares),
            "observed_shares": dict(self.observed_shares),
            "alpha": self.alpha,
        }


def sample_ratio_check(
    counts: Mapping[str, int],
    weights: Mapping[str, float],
    *,
    alpha: float = 0.001,
    prior_strength: float = 100.0,
) -> SampleRatioCheck:
    """Sample-ratio-mismatch check of arm ``counts`` against routing ``weights`` (normalised here).

    The Bayes factor of a Dirichlet(``prior_strength`` x weights) mixture against the routing
    multinomial is a test martingale under correct routing, so ``1 / BF`` may be checked after
    every batch. A small ``alpha`` (default 0.001) because a false flag halts a canary.
    """
    arms = sorted(weights)
    if set(counts) - set(weights):
        raise ValueError(f"counts for arms without a routing weight: {sorted(set(counts) - set(weights))}")
    total_weight = sum(weights[a] for a in arms)
    if total_weight <= 0 or any(weights[a] <= 0 for a in arms):
        raise ValueError("routing weights must be positive")
    shares = {a: weights[a] / total_weight for a in arms}
    n = {a: int(counts.get(a, 0)) for a in arms}
    total = sum(n.values())
    if total == 0:
        return SampleRatioCheck(False, 1.0, 0.0, 1.0, n, shares, dict.fromkeys(arms, 0.0), alpha)
    prior = {a: prior_strength * shares[a] for a in arms}
    log_marginal = (
        math.lgamma(prior_strength)
        - math.lgamma(prior_strength + total)
        + sum(math.lgamma(prior[a] + n[a]) - math.lgamma(prior[a]) for a in arms)
    )
    log_null = sum(n[a] * math.log(shares[a]) for a in arms)
    sequential_p = min(1.0, math.exp(min(0.0, log_null - log_marginal)))
    chi_square = sum((n[a] - total * shares[a]) ** 2 / (total * shares[a]) for a in arms)
    return SampleRatioCheck(
        flagged=sequential_p < alpha,
        sequential_p_value=sequential_p,
        chi_square=chi_square,
        chi_square_p_value=chi_square_survival(chi_square, len(arms) - 1),
        counts=n,
        expected_shares=shares,
        observed_shares={a: n[a] / total for a in arms},
        alpha=alpha,
    )
