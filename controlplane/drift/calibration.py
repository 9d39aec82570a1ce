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
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

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


def estimation_temperings(arl0: float, tau2: FloatArray) -> FloatArray:
    """Vectorised :func:`estimation_tempering`; NaN where no ``kappa >= MIN_TEMPERING`` suffices."""
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


def estimation_tempering(arl0: float, tau2: float) -> float | None:
    """Extra exponent factor in (0, 1] for a component whose null drift has relative sd ``sqrt(tau2)``.

    Returns None when even ``MIN_TEMPERING`` cannot keep the window-averaged false-alarm rate at
    the exact-baseline rate (see the module docstring).
    """
    if not arl0 > 1.0:
        raise ValueError(f"arl0 must be > 1, got {arl0}")
    if tau2 <= 0.0:
        return 1.0
    kappa = float(estimation_temperings(arl0, np.array([tau2]))[0])
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
