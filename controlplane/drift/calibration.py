"""Thresholds from a requested ARL0 (mean requests between false alarms), with the corrections
that make the requested figure hold on real traffic rather than on an idealised i.i.d. stream.

Three effects, each turned into a number here:

* **Shiryaev-Roberts bound.** ``R_n - n`` is a martingale under no change when every factor is a
  true likelihood ratio, so alarming at ``R_n >= A`` gives ARL0 >= A (Pollak 1987): ``ln A = ln ARL0``.
* **Overdispersion.** Tokens of one request share its prompt, so per-request counts vary more
  than binomial by a factor ``phi`` (the design effect). A binomial log-likelihood ratio then
  has ``E[exp(l)] > 1`` and the martingale argument fails; raising it to ``1/phi``
  (quasi-likelihood tempering) restores ``E[exp(l / phi)] ~= 1`` to second order.
* **Estimated baseline.** The baseline comes from a finite reference window. An error ``b`` in it
  shifts the null drift of each likelihood-ratio component, and the run length scales like
  ``A^(1 - eta)`` with ``eta ~ N(0, tau^2)``. Averaged over reference windows, the false-alarm
  *rate* is ``E[A^-(1-eta)] = A^-1 exp(tau^2 (ln A)^2 / 2)``; an extra tempering of each
  component's exponent by ``kappa = ln ARL0 / u`` (``u`` the root of ``u - tau^2 u^2 / 2 = ln ARL0``)
  keeps that rate at or below ``1/ARL0``. Components whose baseline is too uncertain for any
  tempering (``2 tau^2 ln ARL0 >= 1``) are not monitored.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def sr_log_threshold(arl0: float) -> float:
    """Log of the Shiryaev-Roberts alarm level that guarantees ARL0 >= ``arl0`` for true likelihood ratios."""
    if not arl0 > 1.0:
        raise ValueError(f"arl0 must be > 1, got {arl0}")
    return math.log(arl0)


def estimation_tempering(arl0: float, tau2: float) -> float | None:
    """Extra exponent factor in (0, 1] for a component whose null drift has relative sd ``sqrt(tau2)``.

    Returns None when no tempering can keep the window-averaged false-alarm rate at ``1/arl0``.
    """
    log_g = math.log(arl0)
    if tau2 <= 0.0:
        return 1.0
    disc = 1.0 - 2.0 * tau2 * log_g
    if disc <= 0.0:
        return None
    u = (1.0 - math.sqrt(disc)) / tau2
    return log_g / u


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
