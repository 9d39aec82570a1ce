"""Thresholds from a requested ARL0 (mean requests between false alarms), with the corrections
that make the requested figure hold on real traffic rather than on an idealised i.i.d. stream.

Three effects, each turned into a number here:

* **Shiryaev-Roberts bound.** ``R_n - n`` is a martingale under no change when every factor is a
  true likelihood ratio, so alarming at ``R_n >= A`` gives ARL0 >= A (Pollak 1987): ``ln A = ln ARL0``.
* **Overdispersion.** Tokens of one request share its prompt, so per-request counts vary more
  than binomial by a factor ``phi`` (the design effect). A binomial log-likelihood ratio then
  has ``E[exp(l)] > 1`` and the martingale argument fails; raising it to ``1/phi``
  (quasi-likelihood tempering) restores ``E[exp(l / phi)] ~= 1`` to second order.
* **Estimated baseline.** The baseline comes from a finite reference window. An error in it
  shifts the null drift of each likelihood-ratio component: with ``eta`` the relative shift
  (``eta ~ N(0, tau^2)`` over reference windows), the component's log statistic drifts like a
  Brownian motion whose exponent ``theta = -2 mu / sigma^2`` is ``1 - eta`` instead of 1. Its run
  length to ``ln A`` is Siegmund's ``ARL(theta) = (e^(theta h) - 1 - theta h) / (theta^2 sigma^2 / 2)``,
  finite for every ``eta`` (a window whose error turns the drift positive still needs ~``h /
  drift`` requests to climb). Tempering the exponent by ``kappa`` (``l -> kappa l``) turns
  ``theta`` into ``(1 - eta) / kappa``; :func:`estimation_tempering` picks the largest ``kappa``
  whose false-alarm *rate* averaged over windows, ``E[1 / ARL]``, is at most the rate with an
  exact baseline. (An earlier version used the cruder ``ARL ~ A^(1 - eta)``, which ignores that
  climb and over-tempered the small-drop components that matter most.) Components that would
  need ``kappa < MIN_TEMPERING`` are not monitored: their power would not pay for their weight.

**Simulated threshold.** With those corrections the bound holds several times the requested ARL0
(the statistic overshoots the level, and the tempering is sized for the reference windows whose
error is worst), which costs detection delay. :func:`simulated_log_threshold` instead finds, once
per reference window, the level at which simulated null traffic of that window's own moments has
the requested ARL0 under the frozen kernel (run through the exact mixture recursion):

* *Requests.* Per group (the requests on the pooled baseline, and each category with a baseline
  of its own, in their reference shares) a library of simulated requests: a gamma step count with
  the group's mean and variance, its per-position rates as sequential conditional binomials, and
  a per-request difficulty shared by the positions, sized by position 0's overdispersion. Each
  component's ``l`` over the library is then shifted and scaled to exactly the reference's mean
  ``W_c mu_c`` and variance ``diag(W_c S_c W_c')``; only its shape comes from the model. A Gaussian
  ``l`` with those moments is not enough: for the large drops its right tail is far heavier than
  a count's (``E[e^l]`` of the -50% component ~1e4 instead of ~1), and thresholds came out above
  the bound.
* *Reference error.* Each simulated run stands for one deployment, so its ``l`` are shifted by a
  draw of the reference's own sampling error: of the mean (``W_c S_c W_c' / n_c``) and of the
  variance (relative variance ``(kurtosis - 1) / n_c``, the library's kurtosis, drawn as the drift
  shift that moves the tail exponent ``-2 m / v`` alike). Calibrating as if the reference were
  exact is not enough: the tempering pays for baseline error at the bound, but at a lower level
  the deployments whose error left the least margin dominate the false alarms. On
  bench/drift.py's stream families (150 deployments each), exact-reference thresholds held
  0.87-1.04x the requested ARL0, these 1.0-1.3x.
* *Estimate.* Runs of ``ARL0 / 2`` requests from a fresh start, the censored-exponential ARL
  (exposure over alarms, as bench/drift.py measures it) bisected in the threshold. The run length
  sits between two readings of ARL0 across deployments: one first passage from a fresh start
  each (long runs) and false alarms per request with the detector reset after each on the same
  baseline (short runs, which weight the worst deployments more). At ARL0 = 1e4 the threshold
  holds 1.0-1.3x by the first reading and 0.85-0.9x by the second (the bound: 2-3.6x, 1.9-2.9x).
* *Cost.* At most ``SIM_REQUESTS`` simulated requests (40-70 ns each in float32 on one core),
  with 400 alarms at the simulated level up to ARL0 = 1e4 (the ARL within ~5%) and at least 200
  up to ``L = SIM_REQUESTS / MIN_SIM_ALARMS`` = 3e4: 0.1-0.4 s per freeze.
* *Beyond L* the threshold is extrapolated: ``h = h(L) + ln(ARL0 / L) / EXTRAPOLATION_SLOPE``. A
  single Kesten-type recursion has ``ln ARL0 ~ theta h + c``, but across deployments the slope
  falls as ``h`` grows (the deployments with the least margin take over, and one whose error turns
  the null drift positive alarms within ~``h / drift`` requests whatever ``h``). Simulated directly
  on the bench families, the slope from 5e4 was 0.76-0.88 to 1e5 and 0.84-0.87 to 1e6 (0.7-0.8
  locally at 1e6), so a slope of 0.8 stays at or above the directly simulated threshold there; on
  bench/drift.py's streams at ARL0 = 1e5, thresholds extrapolated from 5e4 held 1.4-1.7x (the
  bound 3.0-3.7x). As ARL0 grows the line meets the bound, which the tempering sizes to hold at
  ``ln ARL0`` itself, and the bound is used from there on (near 1e8 for those windows).
* *Clamps.* Never above ``ln ARL0``: the bound is safe by the arguments above. Never below
  ``ln(ARL0 / FLOOR_FACTOR)``: were the simulation entirely wrong about the traffic, a tempered
  statistic at that level still keeps ARL0 >= ARL0 / 10 by the same bound, and a gain over the
  bound beyond that factor (measured: 2-4x) would mean the reference's moments do not describe
  its own traffic.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from controlplane.drift.reference import GroupStats

FloatArray = npt.NDArray[np.float64]


def sr_log_threshold(arl0: float) -> float:
    """Log of the Shiryaev-Roberts alarm level that guarantees ARL0 >= ``arl0`` for true likelihood ratios."""
    if not arl0 > 1.0:
        raise ValueError(f"arl0 must be > 1, got {arl0}")
    return math.log(arl0)


# Gauss-Hermite (probabilists') nodes for E over eta ~ N(0, tau^2); the integrand is smooth.
_GH_X, _GH_W = np.polynomial.hermite_e.hermegauss(48)
_GH_W = _GH_W / _GH_W.sum()
MIN_TEMPERING = 0.25


def _siegmund(theta: FloatArray, h: float) -> FloatArray:
    """``(e^(theta h) - 1 - theta h) / theta^2``: a Brownian log statistic's ARL, times ``sigma^2 / 2``."""
    th = theta * h
    safe = np.where(np.abs(th) < 1e-6, 1.0, theta)
    with np.errstate(over="ignore"):
        exact = (np.expm1(np.minimum(th, 700.0)) - th) / (safe * safe)
    out: FloatArray = np.where(np.abs(th) < 1e-6, 0.5 * h * h * (1.0 + th / 3.0), exact)
    return out


def _bisected_temperings(arl0: float, tau2: FloatArray) -> FloatArray:
    """Each ``tau2``'s tempering by bisection; NaN where no ``kappa >= MIN_TEMPERING`` suffices."""
    h = math.log(arl0)
    t2 = np.atleast_1d(np.asarray(tau2, dtype=np.float64))
    eta = _GH_X[None, :] * np.sqrt(np.maximum(t2, 0.0))[:, None]  # (n, nodes)
    nominal = float(_siegmund(np.array([1.0]), h)[0])

    def rate_ratio(kappa: FloatArray) -> FloatArray:
        k = kappa[:, None]
        # rate with kappa and error eta over the exact-baseline rate; sigma^2 / 2 cancels up to kappa^2
        ratio: FloatArray = (_GH_W * k * k * nominal / _siegmund((1.0 - eta) / k, h)).sum(axis=1)
        return ratio

    lo = np.full(len(t2), MIN_TEMPERING)
    hi = np.ones(len(t2))
    ok_at_one = rate_ratio(hi) <= 1.0
    feasible = rate_ratio(lo) <= 1.0
    for _ in range(40):  # bisection to ~1e-12 of the (0.25, 1] range
        mid = 0.5 * (lo + hi)
        good = rate_ratio(mid) <= 1.0
        lo = np.where(good, mid, lo)
        hi = np.where(good, hi, mid)
    out: FloatArray = np.where(ok_at_one | (t2 <= 0.0), 1.0, np.where(feasible, lo, np.nan))
    return out


# The tempering as a function of tau2, tabled per ARL0 on a log grid (400 points a decade).
# Every freeze needs it for ~100 (component, baseline row) pairs, and forty bisection steps over
# them cost about half of a freeze: a fleet freezes thousands of reference windows at its start.
_TABLE_LOG10_RANGE = (-8.0, 1.0)
_TABLE_POINTS_PER_DECADE = 400


@functools.lru_cache(maxsize=16)
def _tempering_table(arl0: float) -> tuple[FloatArray, FloatArray]:
    lo, hi = _TABLE_LOG10_RANGE
    grid = np.logspace(lo, hi, int((hi - lo) * _TABLE_POINTS_PER_DECADE) + 1)
    kappa = _bisected_temperings(arl0, grid)
    # Less tempering never becomes safe as the error grows: make the table non-increasing (and
    # NaN, unresolvable, from the first unresolvable point on) against rounding in the bisection.
    unresolvable = np.maximum.accumulate(np.isnan(kappa))
    kappa = np.where(unresolvable, np.nan, np.minimum.accumulate(np.where(unresolvable, 1.0, kappa)))
    return grid, kappa


def estimation_temperings(arl0: float, tau2: FloatArray) -> FloatArray:
    """Vectorised :func:`estimation_tempering`; NaN where no ``kappa >= MIN_TEMPERING`` suffices.

    Read from a per-ARL0 table at the first grid point at or above each ``tau2``: the tempering
    falls as the error grows, so the value read errs towards more tempering (a safer component),
    by at most one grid step (0.6% in ``tau2``). Values off the table are bisected exactly.
    """
    t2 = np.atleast_1d(np.asarray(tau2, dtype=np.float64))
    grid, table = _tempering_table(float(arl0))
    out = np.ones(len(t2))
    on_table = (t2 > 0.0) & (t2 <= grid[-1])
    index = np.searchsorted(grid, t2[on_table], side="left")
    out[on_table] = table[index]
    off = (t2 > grid[-1]) | np.isnan(t2)
    if off.any():
        out[off] = _bisected_temperings(arl0, t2[off])
    return out


def estimation_tempering(arl0: float, tau2: float) -> float | None:
    """Extra exponent factor in (0, 1] for a component whose null drift has relative sd ``sqrt(tau2)``.

    Returns None when even ``MIN_TEMPERING`` cannot keep the window-averaged false-alarm rate at
    the exact-baseline rate (see the module docstring).
    """
    if not arl0 > 1.0:
        raise ValueError(f"arl0 must be > 1, got {arl0}")
    if tau2 <= 0.0:
        return 1.0
    kappa = float(_bisected_temperings(arl0, np.array([tau2]))[0])
    return None if math.isnan(kappa) else kappa


def dispersion_relative_var(n_reference: int) -> float:
    """Relative variance of a dispersion factor estimated from ``n_reference`` requests.

    ``Var(mean r^2) / E[r^2]^2 = (kurtosis - 1) / n``; 4/n assumes kurtosis 5, heavier than the
    Gaussian 3, because overdispersed request residuals have heavy tails.
    """
    return 4.0 / max(n_reference, 1)


def bernoulli_kl(p: float, q: float) -> float:
    """KL(Bernoulli(p) || Bernoulli(q)) in nats."""
    out = 0.0
    if p > 0.0:
        out += p * math.log(p / q)
    if p < 1.0:
        out += (1.0 - p) * math.log((1.0 - p) / (1.0 - q))
    return out


def cusum_log_threshold(arl0: float, kl_per_observation: float) -> float:
    """CUSUM threshold h with ARL0 ~= (e^h - h - 1) / KL(p0||p1) (Basseville & Nikiforov 1993).

    No overshoot correction, so the true ARL0 is somewhat larger than requested.
    """
    if not kl_per_observation > 0.0:
        raise ValueError("kl_per_observation must be > 0")
    target = arl0 * kl_per_observation
    lo, hi = 0.0, max(1.0, math.log(target + 1.0) + 5.0)
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if math.exp(mid) - mid - 1.0 < target:
            lo = mid
        else:
            hi = mid
    return hi


def kl_per_request(p0: Sequence[float], p1: Sequence[float], mean_trials: Sequence[float]) -> float:
    """Expected KL(p0||p1) of one request: sum over positions of mean trials times per-trial KL."""
    return sum(n * bernoulli_kl(a, b) for a, b, n in zip(p0, p1, mean_trials, strict=True))


# --------------------------------------------------------------------------- simulated threshold

LIBRARY_SIZE = 1 << 15  # simulated requests per group, resampled by every run
SIM_REQUESTS = 6_000_000  # most null requests simulated per calibration, all runs together
SIM_ALARMS = 400  # false alarms wanted at the simulated level: the ARL's relative sd is 1/sqrt(400)
MIN_SIM_ALARMS = 200  # fewest: levels up to SIM_REQUESTS / MIN_SIM_ALARMS are simulated directly
EXTRAPOLATION_SLOPE = 0.8  # d ln ARL0 / d h assumed beyond the simulated level (see the docstring)
FLOOR_FACTOR = 10.0  # the threshold never claims more than this factor over the Pollak bound
# float32 statistics: l and a run's shift of it are clipped so that no factor is 0 or subnormal
# (0 times an overflowed inf would be NaN; subnormals are slow), far outside what decides an alarm.
_L_RANGE = (-60.0, 40.0)
_SHIFT_RANGE = (-5.0, 5.0)
_LOG_MAX = 60.0  # a run whose statistic overflowed alarmed at any threshold
_CHUNK = 1 << 20  # float32 elements of exp(l) drawn at once
_MIN_RUNS = 64
_KEPT = 1 << 20  # running maxima kept per calibration (one every ``stride`` requests of a run)


def _moments(count: float, sx: FloatArray, sxx: FloatArray) -> tuple[FloatArray, FloatArray]:
    mu = sx / count
    cov = sxx / count - np.outer(mu, mu)
    return mu, 0.5 * (cov + cov.T)


def _library(rng: np.random.Generator, mu: FloatArray, cov: FloatArray, size: int) -> FloatArray:
    """``size`` requests ``x = (successes[K], trials[K])``: the group's step count and rates, as counts."""
    k = mu.shape[0] // 2
    n_mean, n_var = float(mu[k]), float(cov[k, k])
    if n_var > 1e-9 and n_mean > 0.0:
        shape = n_mean * n_mean / n_var
        tried = np.rint(rng.gamma(shape, n_mean / shape, size)).astype(np.int64)
    else:
        tried = np.full(size, max(round(n_mean), 0), dtype=np.int64)
    with np.errstate(invalid="ignore", divide="ignore"):
        p = np.nan_to_num(mu[:k] / mu[k:])
    # A request-level difficulty shared by its positions, sized by position 0's overdispersion.
    u = np.ones(size)
    e_nn = float(cov[k, k] + n_mean * n_mean - n_mean)  # E[n (n - 1)]
    if 0.0 < p[0] < 1.0 and e_nn > 0.0:
        resid = cov[0, 0] - 2.0 * p[0] * cov[0, k] + p[0] * p[0] * cov[k, k]
        var_p = (resid - p[0] * (1.0 - p[0]) * n_mean) / e_nn
        if var_p > 0.0:
            conc = max(p[0] * (1.0 - p[0]) / var_p - 1.0, 1e-3)
            u = rng.beta(p[0] * conc, (1.0 - p[0]) * conc, size) / p[0]
    x = np.zeros((size, 2 * k))
    for i in range(k):
        x[:, k + i] = tried
        s = rng.binomial(tried, np.clip(p[i] * u, 0.0, 1.0))
        x[:, i] = s
        if i + 1 < k:
            # Conditional trials: position i + 1 is tried where position i was accepted.
            ratio = float(mu[k + i + 1] / mu[i]) if mu[i] > 0.0 else 0.0
            tried = s if math.isclose(ratio, 1.0, rel_tol=1e-9) else rng.binomial(s, min(ratio, 1.0))
    return x


class _NullModel:
    """Simulated null requests of the reference's traffic: exp(l) of a library, and its groups.

    Groups appear in the library in proportion to their reference counts (so one uniform draw
    picks both); each group's l is standardised to its reference mean and covariance diagonal.
    """

    def __init__(
        self,
        rng: np.random.Generator,
        W: FloatArray,
        counts: FloatArray,
        sx: FloatArray,
        sxx: FloatArray,
        size: int,
    ) -> None:
        n_groups, g, dim = W.shape
        self.active = [c for c in range(n_groups) if counts[c] >= 2.0]
        total = float(sum(counts[c] for c in self.active))
        rows = [max(1, round(size * counts[c] / total)) for c in self.active]
        self.size = sum(rows)
        self.exp_l = np.empty((self.size, g), dtype=np.float32)
        self.group = np.repeat(np.arange(len(self.active)), rows)  # library row -> active group
        self.drift = np.zeros((len(self.active), g))  # reference mean of l per group
        self.err_sd = np.zeros((len(self.active), g, dim))  # l-space sd factor of the group's mean error
        self.var_err = np.zeros((len(self.active), g))  # relative variance of each l's variance estimate
        start = 0
        for j, c in enumerate(self.active):
            mu, cov = _moments(float(counts[c]), sx[c], sxx[c])
            lam, vec = np.linalg.eigh(cov)
            root = W[c] @ (vec * np.sqrt(np.maximum(lam, 0.0)))  # (G, 2K): l's covariance is root root'
            m = W[c] @ mu
            sd = np.sqrt((root * root).sum(axis=1))
            lib = _library(rng, mu, cov, rows[j]) @ W[c].T  # (rows, G)
            lib_sd = lib.std(axis=0)
            dev = lib - lib.mean(axis=0)
            dev2 = dev * dev  # not dev**4: a power ufunc call per element is ten times slower
            with np.errstate(invalid="ignore", divide="ignore"):
                kurtosis = np.nan_to_num((dev2 * dev2).mean(axis=0) / lib_sd**4, nan=1.0)
            scale = np.divide(sd, lib_sd, out=np.zeros(g), where=lib_sd > 0.0)
            lib = m + dev * scale
            self.exp_l[start : start + rows[j]] = np.exp(np.clip(lib, *_L_RANGE))
            start += rows[j]
            self.drift[j] = m
            self.err_sd[j] = root / math.sqrt(counts[c])
            # A sample variance of n requests has relative variance (kurtosis - 1) / n.
            self.var_err[j] = np.maximum(kurtosis - 1.0, 0.0) / counts[c]

    def run_factors(self, rng: np.random.Generator, runs: int) -> npt.NDArray[np.float32]:
        """Per run and group, exp of the shift of l from reference error: (runs, groups, G)."""
        n_active, g, dim = self.err_sd.shape
        shift = np.einsum("cgd,rcd->rcg", self.err_sd, rng.standard_normal((runs, n_active, dim)))
        # A dispersion misestimated by a factor 1 + e moves the tail exponent -2 m / v as a drift
        # of -m e would, so it is drawn as one.
        eps = rng.standard_normal((runs, n_active))[:, :, None] * np.sqrt(self.var_err)[None]
        shift -= self.drift[None] * eps
        out: npt.NDArray[np.float32] = np.exp(np.clip(shift, *_SHIFT_RANGE)).astype(np.float32)
        return out


def _simulate(
    model: _NullModel,
    weights: FloatArray,
    runs: int,
    length: int,
    stride: int,
    rng: np.random.Generator,
    reference_error: bool,
) -> npt.NDArray[np.float32]:
    """Running maximum of the log mixture SR statistic on null streams, every ``stride`` requests.

    Returns (runs, ceil(length / stride)); entry ``j`` covers requests up to ``(j + 1) * stride``.
    """
    g = weights.shape[0]
    n_active = len(model.active)
    if reference_error:
        factors = model.run_factors(rng, runs)  # (runs, groups, G)
    else:
        factors = np.ones((runs, n_active, g), dtype=np.float32)
    flat_factors = factors.transpose(1, 0, 2).reshape(n_active * runs, g)  # row: group * runs + run
    cols = np.arange(runs)
    w = np.repeat(weights.astype(np.float32)[None, :], runs, axis=0)
    ones = np.ones(g, dtype=np.float32)
    rw = np.zeros((runs, g), dtype=np.float32)  # w_g R_g per run
    stat = np.empty(runs, dtype=np.float32)
    top = np.zeros(runs, dtype=np.float32)
    kept = np.empty((-(-length // stride), runs), dtype=np.float32)
    # Requests per chunk: a multiple of the stride, about _CHUNK values of exp(l) drawn at once.
    step = stride * max(1, _CHUNK // max(runs * g * stride, 1))
    with np.errstate(over="ignore"):  # a run whose statistic overflows to inf has alarmed
        for t0 in range(0, length, step):
            s = min(step, length - t0)
            idx = rng.integers(0, model.size, (s, runs))
            e = np.take(model.exp_l, idx, axis=0)  # (s, runs, G)
            if n_active == 1:
                f = np.broadcast_to(factors[:, 0], e.shape)  # a view: the run's shift every request
            else:
                f = np.take(flat_factors, model.group[idx] * runs + cols, axis=0)
            for j in range(s):
                np.add(rw, w, out=rw)
                np.multiply(rw, e[j], out=rw)
                np.multiply(rw, f[j], out=rw)
                np.dot(rw, ones, out=stat)
                np.maximum(top, stat, out=top)
                t = t0 + j + 1
                if t % stride == 0 or t == length:
                    kept[(t - 1) // stride] = top
    with np.errstate(divide="ignore"):
        out: npt.NDArray[np.float32] = np.minimum(np.log(kept), np.float32(_LOG_MAX)).T
    return out


class _FirstPassage:
    """Censored-exponential ARL estimate of the simulated runs at any log threshold."""

    def __init__(self, log_max: npt.NDArray[np.float32], stride: int, length: int) -> None:
        runs, self.blocks = log_max.shape
        self.stride, self.length = stride, length
        self.top = float(np.max(log_max[:, -1])) if runs else 0.0
        # Offsetting run r by r * span makes the concatenated running maxima one sorted array.
        self.span = 2.0 * (abs(self.top) + 1.0) + 1.0
        lm = np.clip(log_max.astype(np.float64), -self.span / 2 + 0.5, self.span / 2 - 0.5)
        self.offset = np.arange(runs) * self.span
        self.flat = (lm + self.offset[:, None]).ravel()
        self.base = np.arange(runs) * self.blocks

    def arl(self, h: float) -> float:
        """Mean run length to ``log S >= h``: exposure over alarms (inf when none)."""
        block = np.searchsorted(self.flat, h + self.offset, side="left") - self.base  # (runs,)
        alarmed = block < self.blocks
        # An alarm in block j fell somewhere in its ``stride`` requests: count the middle one.
        length = np.where(alarmed, block * self.stride + 0.5 * (self.stride + 1), self.length)
        alarms = int(alarmed.sum())
        return float(np.minimum(length, self.length).sum()) / alarms if alarms else math.inf

    def solve(self, target: float) -> float:
        """The smallest log threshold whose estimated ARL reaches ``target``."""
        lo, hi = -1.0, self.top + 1e-6
        if self.arl(lo) >= target:
            return lo
        for _ in range(50):
            mid = 0.5 * (lo + hi)
            if self.arl(mid) < target:
                lo = mid
            else:
                hi = mid
        return hi


def _seed(*arrays: FloatArray | float) -> int:
    digest = hashlib.blake2b(digest_size=8)
    for a in arrays:
        digest.update(np.ascontiguousarray(np.asarray(a, dtype=np.float64)).tobytes())
    return int.from_bytes(digest.digest(), "little")


def _null_curve(
    *,
    W: FloatArray,
    weights: FloatArray,
    counts: FloatArray,
    sx: FloatArray,
    sxx: FloatArray,
    level: float,
    requests: int,
    seed: int,
    reference_error: bool = True,
) -> _FirstPassage:
    """Simulate ``requests`` null requests in runs of about ``level / 2`` and return their ARL curve."""
    rng = np.random.default_rng(seed)
    model = _NullModel(rng, W, counts, sx, sxx, LIBRARY_SIZE)
    # Runs much longer than the statistic's climb from zero (a few hundred requests) keep the
    # estimate an ARL from a fresh start; much shorter than the ARL itself, they are many.
    length = int(min(max(level / 2.0, 1_000.0), requests / _MIN_RUNS))
    runs = max(_MIN_RUNS, requests // length)
    stride = max(1, (runs * length) // _KEPT)
    lm = _simulate(model, weights, runs, length, stride, rng, reference_error)
    return _FirstPassage(lm, stride, length)


def simulated_log_threshold(
    *, W: FloatArray, weights: FloatArray, groups: Sequence[GroupStats], arl0: float
) -> float:
    """Log threshold at which the kernel's null ARL0 equals ``arl0``, simulated from the reference.

    ``W`` and ``weights`` are the frozen kernel's (``W[c]`` scores a request of group ``c``);
    ``groups[c]`` the reference requests scored by row ``c``. Deterministic (seeded by its
    inputs); clamped to ``[ln(arl0 / FLOOR_FACTOR), ln(arl0)]`` (see the module docstring).
    """
    bound = sr_log_threshold(arl0)
    if len(groups) != W.shape[0]:
        raise ValueError(f"{len(groups)} groups for a kernel of {W.shape[0]} rows")
    counts = np.array([float(g.count) for g in groups])
    if W.shape[1] == 0 or not (counts >= 2.0).any():
        return bound
    sx = np.stack([g.sx for g in groups])
    sxx = np.stack([g.sxx for g in groups])
    level = min(arl0, SIM_REQUESTS / MIN_SIM_ALARMS)
    requests = int(min(SIM_REQUESTS, SIM_ALARMS * level))
    seed = _seed(W, weights, counts, sx, sxx, arl0)
    curve = _null_curve(
        W=W, weights=weights, counts=counts, sx=sx, sxx=sxx, level=level, requests=requests, seed=seed
    )
    h = curve.solve(level)
    if arl0 > level:
        h += math.log(arl0 / level) / EXTRAPOLATION_SLOPE
    return float(min(bound, max(bound - math.log(FLOOR_FACTOR), h)))
