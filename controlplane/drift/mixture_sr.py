"""The main hit-rate drift detector: a mixture Shiryaev-Roberts over drop sizes and draft positions.

One observation is one request (its per-position conditional counts), never one token, so the
dependence of tokens within a request cannot make it over-confident. Lifecycle:

1. **Reference.** The first ``reference_size`` requests estimate the per-position baseline
   acceptance (per traffic category too when ``risk_adjust``), and the overdispersion of requests.
2. **Monitoring.** Each component ``g`` of the mixture is a drop hypothesis: a relative drop ``r``
   of every position (the "all" set) or of one position; its per-request log-likelihood ratio is
   linear in the counts, ``l_g = W_g . (successes, trials)``, with ``W_g`` built from the
   request's own category baseline (the risk adjustment of Steiner et al. 2000, so a pure change
   of workload mix does not look like a drop). ``R_g <- (1 + R_g) exp(l_g)`` and the alarm is
   ``sum_g w_g R_g >= exp(threshold)``. Overdispersion and baseline uncertainty are handled by
   tempering each ``l_g`` (see :mod:`controlplane.drift.calibration`), so the requested ARL0 holds
   at the Pollak bound ``threshold = ln ARL0`` without simulation; the baseline-error tempering is
   sized per baseline row (pooled, or a category's own), because a category with few reference
   requests has a noisier baseline and a mix shift can make it most of the traffic. That bound
   holds several times the requested ARL0, so by default (``threshold="simulated"``) the
   threshold is the one at which simulated null traffic of the reference's own moments reaches
   the requested ARL0, computed once at freezing and kept in the state. Drops smaller than
   ``min_drop`` (absolute points of acceptance) have no component. The weights: ``1 -
   single_share`` on the all-positions drops, ``single_share`` on the one-position drops, uniform
   over the ``n_grid`` log-spaced sizes within a set; each component pays ``ln(1 / w_g)`` nats of
   delay, so most weight goes where most drops are (a stale drafter degrades every position), and
   one-position drops stay detectable.
3. **Alarm.** The alarm latches (``drift_detected`` stays True, the statistic freezes) until
   :meth:`MixtureSR.reset`, which starts a ``cooldown`` of ignored requests (realignment and
   canary run meanwhile); :meth:`MixtureSR.rebaseline` starts a new reference window after a
   promotion. A companion CUSUM per component estimates the change point, which gives the
   evidence (current estimate, drop, position most affected, detection delay).

>>> import random
>>> from controlplane.drift import MixtureSR, RequestObservation
>>> def request(rng, p, k=4, steps=20):
...     accepted, tried = [], steps
...     for _ in range(k):
...         tried = sum(rng.random() < p for _ in range(tried))
...         accepted.append(tried)
...     return RequestObservation.from_counts(
...         k=k, verify_steps=steps, accepted_per_position=accepted,
...         drafted_tokens=k * steps, accepted_tokens=sum(accepted))
>>> rng = random.Random(7)
>>> detector = MixtureSR(arl0=10_000, reference_size=300)
>>> for i in range(2_000):
...     _ = detector.update(request(rng, 0.8 if i < 1_000 else 0.7))
...     if detector.drift_detected:
...         break
>>> i
1003
>>> e = detector.evidence()
>>> round(e.baseline_rate, 2), round(e.current_estimate, 2), e.records_examined
(0.8, 0.68, 704)
"""

from __future__ import annotations

import base64
import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from controlplane.drift.calibration import (
    dispersion_relative_var,
    estimation_temperings,
    simulated_log_threshold,
    sr_log_threshold,
)
from controlplane.drift.evidence import DriftEvidence
from controlplane.drift.observation import RequestObservation
from controlplane.drift.reference import POOLED, FloatArray, ReferenceWindow

STATE_VERSION = 1
_PACKED_PREFIX = "b64:"
THRESHOLDS = ("simulated", "bound")
_MAX_STATISTIC = 1e300  # far above any alarm level, and its sum over components stays finite
_LOG_MAX_STATISTIC = math.log(_MAX_STATISTIC)
_MAX_LOG_LR = 700.0  # exp() overflows past ~709; any such request alarms anyway


def pack_array(values: npt.NDArray[Any]) -> str:
    """A running-state array as text that JSON carries: its little-endian bytes in base64.

    A fleet monitor writes every detector's state on every pass; printing a few hundred floats as
    decimals cost more than advancing the detector, and the bytes round-trip exactly."""
    little = values.astype(values.dtype.newbyteorder("<"), copy=False)
    return _PACKED_PREFIX + base64.b64encode(np.ascontiguousarray(little).tobytes()).decode("ascii")


def unpack_array(value: str | Sequence[Any], dtype: type[np.generic]) -> npt.NDArray[Any]:
    """:func:`pack_array`'s inverse, flat; a list (states written before packing) is read as is."""
    if isinstance(value, str):
        if not value.startswith(_PACKED_PREFIX):
            raise ValueError("a packed array starts with 'b64:'")
        raw = base64.b64decode(value[len(_PACKED_PREFIX) :], validate=True)
        return np.frombuffer(raw, dtype=np.dtype(dtype).newbyteorder("<")).astype(dtype)
    return np.asarray(value, dtype=dtype).ravel()


def _fit(v: Any, n: int) -> FloatArray:
    """A vector padded with zeros or cut to ``n`` entries (aggregates of a shorter or longer k)."""
    a = np.asarray(v, dtype=np.float64).ravel()
    out = np.zeros(n)
    m = min(n // 2, a.size // 2)
    # x = (successes[K], trials[K]): pad each half separately.
    out[:m] = a[:m]
    out[n // 2 : n // 2 + m] = a[a.size // 2 : a.size // 2 + m]
    return out


def _fit_matrix(v: Any, n: int) -> FloatArray:
    a = np.asarray(v, dtype=np.float64)
    if a.shape == (n, n):
        return a
    half = a.shape[0] // 2
    m = min(n // 2, half)
    idx_from = np.r_[0:m, half : half + m]
    idx_to = np.r_[0:m, n // 2 : n // 2 + m]
    out = np.zeros((n, n))
    out[np.ix_(idx_to, idx_to)] = a[np.ix_(idx_from, idx_from)]
    return out


def _kernel_digest(W: FloatArray, weights: FloatArray, method: str) -> str:
    """Identifies the kernel a stored threshold was computed for."""
    digest = hashlib.blake2b(method.encode(), digest_size=16)
    digest.update(np.ascontiguousarray(W).tobytes())
    digest.update(np.ascontiguousarray(weights).tobytes())
    return digest.hexdigest()


@dataclass(frozen=True)
class SRKernel:
    """The frozen arithmetic of a monitoring detector, for vectorised simulation (bench) and inspection.

    ``W[c, g]`` maps a request of group ``c`` (``x = successes[K] ++ trials[K]``) to component
    ``g``'s tempered log-likelihood ratio; ``weights[g]`` are the mixture weights;
    ``p0[c]`` the group's baseline rates; ``groups`` maps a category to its row (0 = pooled).
    """

    W: FloatArray
    weights: FloatArray
    p0: FloatArray
    log_threshold: float
    groups: dict[str, int]
    labels: list[str]
    dispersion: list[float]


class MixtureSR:
    """Mixture Shiryaev-Roberts detector of a drop in per-position acceptance (see module docstring)."""

    def __init__(
        self,
        *,
        arl0: float = 10_000.0,
        min_drop: float = 0.05,
        max_rel_drop: float = 0.5,
        n_grid: int = 5,
        n_positions: int = 4,
        reference_size: int = 1_000,
        cooldown: int = 0,
        single_positions: bool = True,
        risk_adjust: bool = True,
        min_category_requests: int = 50,
        min_trials: int = 50,
        dispersion: bool = True,
        single_share: float = 0.05,
        threshold: str = "simulated",
        calibrate_on_freeze: bool = True,
    ) -> None:
        if not arl0 > 1.0:
            raise ValueError("arl0 must be > 1")
        if threshold not in THRESHOLDS:
            raise ValueError(f"threshold must be one of {THRESHOLDS}, got {threshold!r}")
        if not 0.0 < min_drop < 1.0 or not 0.0 < max_rel_drop < 1.0:
            raise ValueError("min_drop and max_rel_drop must lie in (0, 1)")
        if not 0.0 <= single_share < 1.0:
            raise ValueError("single_share must lie in [0, 1)")
        if n_grid < 1 or n_positions < 1 or reference_size < 1 or cooldown < 0:
            raise ValueError("n_grid, n_positions, reference_size must be >= 1 and cooldown >= 0")
        self.arl0 = float(arl0)
        self.min_drop = float(min_drop)
        self.max_rel_drop = float(max_rel_drop)
        self.n_grid = int(n_grid)
        self.n_positions = int(n_positions)
        self.reference_size = int(reference_size)
        self.cooldown = int(cooldown)
        self.single_positions = bool(single_positions)
        self.risk_adjust = bool(risk_adjust)
        self.min_category_requests = int(min_category_requests)
        self.min_trials = int(min_trials)
        self.dispersion = bool(dispersion)
        self.single_share = float(single_share)
        self.threshold_method = threshold
        # False: freeze at the Pollak bound and simulate the threshold later (calibrate()), so a
        # monitor that freezes thousands of detectors at once can spread the simulations out.
        self.calibrate_on_freeze = bool(calibrate_on_freeze)
        self.rebaseline()

    # ----------------------------------------------------------------------------------- lifecycle

    def rebaseline(self) -> None:
        """Forget the baseline and start a new reference window (after a drafter promotion)."""
        self._reference = ReferenceWindow(self.n_positions)
        self._kernel: SRKernel | None = None
        self._alarm_level = math.inf  # the statistic (not its log) that alarms; set by _bind
        self._cooldown_left = 0
        self._alarms = 0
        self._clear_statistic()

    def reset(self) -> None:
        """Clear the alarm and the statistic, keep the baseline, and ignore the next ``cooldown`` requests."""
        self._clear_statistic()
        self._cooldown_left = self.cooldown if self._kernel is not None else 0

    def _clear_statistic(self) -> None:
        g = 0 if self._kernel is None else self._kernel.W.shape[1]
        k = self.n_positions
        self._rw = np.zeros(g)  # weight times Shiryaev-Roberts statistic, per component
        self._cusum = np.zeros(g)
        self._cum = np.zeros(3 * k)  # running successes, trials, baseline-expected successes
        self._snapshot = np.zeros((g, 3 * k))  # _cum at each component's last CUSUM zero
        self._start = np.zeros(g, dtype=np.int64)
        self._examined = 0
        self._stat = 0.0
        self._alarm: DriftEvidence | None = None

    # -------------------------------------------------------------------------------------- update

    def update(self, x: RequestObservation) -> MixtureSR:
        """Advance by one request; returns self (river's interface)."""
        k = self.n_positions
        if self._kernel is None:
            vec = np.array(x.successes(k) + x.trials(k), dtype=np.float64)
            self._reference.add(vec, x.category if self.risk_adjust else None)
            if self._reference.count >= self.reference_size:
                self._freeze()
            return self
        if self._alarm is not None:
            return self  # latched: the evidence stays as it was at the alarm
        if self._cooldown_left > 0:
            self._cooldown_left -= 1
            return self
        self._examined += 1
        if self._g == 0:
            return self
        # Per-request cost is dominated by numpy call overhead on tiny arrays, so everything
        # below writes into buffers preallocated at freeze time (no allocation per request).
        vec = self._x
        vec[:] = x.successes(k) + x.trials(k)
        c = self._groups.get(x.category, 0) if x.category is not None else 0
        # One product gives the running-sum increments (successes, trials, baseline-expected
        # successes) and every component's log-likelihood ratio.
        np.dot(self._Mc[c], vec, out=self._y)
        self._cum += self._y_cum
        llr = self._llr
        np.minimum(llr, _MAX_LOG_LR, out=llr)
        # Companion CUSUM: its last zero is the change-point estimate behind the evidence.
        w = self._cusum
        w += llr
        reset = np.less_equal(w, 0.0, out=self._reset)
        np.maximum(w, 0.0, out=w)
        np.copyto(self._snapshot, self._cum, where=self._reset_col)
        np.copyto(self._start, self._examined, where=reset)
        rw = self._rw  # w_g * R_g
        rw += self._weights
        rw *= np.exp(llr, out=llr)
        self._stat = float(np.dot(rw, self._ones))
        if self._stat >= self._alarm_level:
            self._alarms += 1
            self._alarm = self.evidence()
        return self

    def update_window(self, groups: Sequence[tuple[str | None, int, Any, Any]]) -> MixtureSR:
        """Advance by one window of aggregated requests: ``(category, count, sum x, sum x x')`` per
        category, ``x = (successes[K], trials[K])``. Costs one step per window, not per request.
        ``sum x x'`` is read only while the reference window fills, so a caller may pass a
        function returning it instead (unpacking it costs more than the monitoring step).

        Every log-likelihood ratio is linear in the counts, so a window's is the sum of its
        requests'. The window enters the Shiryaev-Roberts recursion as ``m`` requests whose
        change, if any, started at the window's start: ``R <- (R + m w) exp(l_window)``, so
        ``R - (requests seen)`` stays a martingale under no change and the false-alarm bound in
        requests holds as for :meth:`update`. A change inside a window is dated to the window's
        start, so the alarm comes at the end of the window in which the per-request detector
        would have alarmed, or (rarely) the next one. During the reference window a whole window
        joins the reference, its second moments included (overdispersion is measured as before).
        """
        k = self.n_positions
        count = sum(int(c) for _, c, _, _ in groups)
        if count <= 0:
            return self
        if self._kernel is None:
            for category, c, sx, sxx in groups:
                if c > 0:
                    group = category if self.risk_adjust else None
                    moments = sxx() if callable(sxx) else sxx
                    self._reference.add_sums(int(c), _fit(sx, 2 * k), _fit_matrix(moments, 2 * k), group)
            if self._reference.count >= self.reference_size:
                self._freeze()
            return self
        if self._alarm is not None:
            return self
        if self._cooldown_left > 0:
            self._cooldown_left = max(0, self._cooldown_left - count)
            return self
        self._examined += count
        if self._g == 0:
            return self
        y = np.zeros(3 * k + self._g)
        for category, c, sx, _ in groups:
            if c <= 0:
                continue
            row = self._groups.get(category, 0) if category is not None else 0
            y += self._Mc[row] @ _fit(sx, 2 * k)
        self._cum += y[: 3 * k]
        llr = np.minimum(y[3 * k :], _MAX_LOG_LR)
        w = self._cusum
        w += llr
        reset = w <= 0.0
        np.maximum(w, 0.0, out=w)
        self._snapshot[reset] = self._cum
        self._start[reset] = self._examined
        # A window's ratio can be astronomically large: the product is taken in logs and capped,
        # so it never overflows and the state stays JSON.
        log_rw = np.log(self._rw + self._weights * count) + llr
        self._rw = np.exp(np.minimum(log_rw, _LOG_MAX_STATISTIC))
        self._stat = float(self._rw.sum())
        if self._stat >= self._alarm_level:
            self._alarms += 1
            self._alarm = self.evidence()
        return self

    def fit_reference(
        self,
        successes: FloatArray,
        trials: FloatArray,
        categories: list[str | None] | None = None,
    ) -> MixtureSR:
        """Estimate the baseline from a whole reference window at once and start monitoring.

        ``successes`` and ``trials`` are ``(n_requests, n_positions)`` conditional counts (e.g.
        replayed records after a promotion); the result equals feeding them through :meth:`update`.
        """
        s = np.asarray(successes, dtype=np.float64)
        t = np.asarray(trials, dtype=np.float64)
        if s.shape != t.shape or s.ndim != 2 or s.shape[1] != self.n_positions:
            raise ValueError(f"successes and trials must both be (n, {self.n_positions})")
        self.rebaseline()
        self._reference.add_many(np.concatenate([s, t], axis=1), categories if self.risk_adjust else None)
        self._freeze()
        return self

    @property
    def drift_detected(self) -> bool:
        """True from the alarm until :meth:`reset` (the latch)."""
        return self._alarm is not None

    @property
    def in_reference(self) -> bool:
        """True while the baseline is still being estimated."""
        return self._kernel is None

    @property
    def records_examined(self) -> int:
        """Requests monitored since the last reset (reference window and cooldown excluded)."""
        return self._examined

    @property
    def statistic(self) -> float:
        """Log of the mixture Shiryaev-Roberts statistic (``-inf`` before any monitored request)."""
        return math.log(self._stat) if self._stat > 0.0 else float("-inf")

    @property
    def threshold(self) -> float:
        """Log alarm level in use (the Pollak bound ``ln ARL0`` until the reference window freezes)."""
        return sr_log_threshold(self.arl0) if self._kernel is None else self._kernel.log_threshold

    @property
    def kernel(self) -> SRKernel | None:
        """The frozen arithmetic (None during the reference window)."""
        return self._kernel

    # ------------------------------------------------------------------------------------ evidence

    def evidence(self) -> DriftEvidence:
        """The alarm's evidence when latched, else the current figures (for a status page)."""
        if self._alarm is not None:
            return self._alarm
        k = self.n_positions
        kernel = self._kernel
        if kernel is None or kernel.W.shape[1] == 0:
            return DriftEvidence(
                baseline_rate=float("nan"),
                current_estimate=float("nan"),
                drop=0.0,
                position_most_affected=None,
                baseline_per_position=[],
                estimate_per_position=[],
                statistic=self.statistic,
                threshold=self.threshold,
                records_examined=self._examined,
                detection_delay_estimate=0,
                component="",
            )
        g = int(np.argmax(self._rw))
        since = self._cum - self._snapshot[g]
        s, n, e = since[:k], since[k : 2 * k], since[2 * k :]
        total_n = float(n.sum())
        if total_n > 0.0:
            base = float(e.sum()) / total_n
            est = float(s.sum()) / total_n
            with np.errstate(invalid="ignore", divide="ignore"):
                base_i = np.where(n > 0, e / n, np.nan)
                est_i = np.where(n > 0, s / n, np.nan)
                # Most affected = most significant shortfall, not the largest raw drop, so that
                # a rarely tried position with three trials cannot win on noise.
                z = np.where(n > 0, (e - s) / np.sqrt(np.maximum(e * (1.0 - base_i), 1e-12)), -np.inf)
            position: int | None = int(np.argmax(z))
        else:
            base_i = est_i = np.full(k, np.nan)
            p = kernel.p0[0]
            base = est = float(np.nanmean(p))
            position = None
        return DriftEvidence(
            baseline_rate=base,
            current_estimate=est,
            drop=base - est,
            position_most_affected=position,
            baseline_per_position=[float(v) for v in base_i],
            estimate_per_position=[float(v) for v in est_i],
            statistic=self.statistic,
            threshold=self.threshold,
            records_examined=self._examined,
            detection_delay_estimate=int(self._examined - self._start[g]),
            component=kernel.labels[g],
        )

    # ------------------------------------------------------------------------------------- freezing

    def _freeze(self, stored_threshold: dict[str, Any] | None = None) -> None:
        """Turn the reference window into the monitoring kernel (deterministic: from_state re-runs it).

        ``stored_threshold`` is a state's threshold entry: used as is when it was computed for
        this very kernel, so that restoring a state never repeats the simulation.
        """
        ref = self._reference
        k = self.n_positions
        groups = ref.groups(self.min_category_requests if self.risk_adjust else 1 << 62)
        p_pool = groups[0].rates(self.min_trials)
        rates = [p_pool] + [
            np.where(np.isnan(r), p_pool, r) for r in (g.rates(self.min_trials) for g in groups[1:])
        ]
        own = [g.name for g in groups[1:]]
        # Dispersion and baseline error are measured on disjoint request sets, each with the
        # baseline its requests are scored against ("rest" = requests on the pooled baseline).
        stat_groups = [ref.rest(own), *groups[1:]]
        p0 = np.vstack(rates)  # (C, K)
        monitored = ~np.isnan(p_pool)
        p0 = np.where(monitored, p0, np.nan)
        trials = np.vstack([g.trials for g in stat_groups])  # (C, K)
        counts = np.array([g.count for g in stat_groups], dtype=np.float64)
        resid = [g.residual_cov(p) for g, p in zip(stat_groups, rates, strict=True)]
        total = float(counts.sum())
        pooled_trials = groups[0].trials

        sets: list[tuple[str, FloatArray]] = []
        if monitored.any():
            sets.append(("all", monitored.astype(np.float64)))
            if self.single_positions and monitored.sum() > 1:
                for i in np.flatnonzero(monitored):
                    sets.append((f"position {i}", (np.arange(k) == i).astype(np.float64)))

        rows: list[FloatArray] = []
        labels: list[str] = []
        set_of: list[int] = []
        phis: list[float] = []
        tau2s: list[FloatArray] = []
        var_phi = dispersion_relative_var(int(total)) if self.dispersion else 0.0
        q0 = 1.0 - p0
        # Requests of group c are scored against baseline row c, which was estimated from
        # n_base[c] reference requests: the pooled row from all of them, a category row from its
        # own. Its baseline error (and so its tempering) is sized per row, because after a mix
        # shift the thinner category's noisier baseline may carry most of the traffic.
        n_base = counts.copy()
        n_base[0] = total
        row_trials = trials.copy()
        row_trials[0] = pooled_trials
        per_request = row_trials / np.maximum(n_base, 1.0)[:, None]  # mean trials per request, per row
        pq = np.nan_to_num(p0 * q0)
        for si, (name, mask) in enumerate(sets):
            on = mask > 0
            pbar = float((pooled_trials[on] * p_pool[on]).sum() / pooled_trials[on].sum())
            r_lo = min(self.min_drop / pbar, self.max_rel_drop)
            drops = (
                np.geomspace(r_lo, self.max_rel_drop, self.n_grid)
                if r_lo < self.max_rel_drop
                else np.array([r_lo])
            )
            # Every drop size of the set at once (axis 0): a fleet freezes thousands of windows.
            p1 = p0[None] * (1.0 - drops)[:, None, None]  # (R, C, K)
            q1 = 1.0 - p1
            with np.errstate(invalid="ignore"):
                b = np.where(on, np.log(q1 / q0), 0.0)  # coefficient on trials
                a = np.where(on, np.log(p1 / p0), 0.0) - b  # coefficient on successes
            a = np.nan_to_num(a)
            b = np.nan_to_num(b)
            model_var = (a * a * pq * trials).sum(axis=(1, 2))  # binomial variance of sum l over the window
            phi = np.ones(len(drops))
            if self.dispersion:
                observed = sum(
                    np.einsum("rk,kl,rl->r", a[:, c], resid[c], a[:, c]) for c in range(len(stat_groups))
                )
                phi = np.maximum(1.0, observed / np.where(model_var > 0.0, model_var, 1.0))
            temper = 1.0 / phi
            # Tempered per-request variance of l for a request of each row, and the relative
            # sd of that row's null drift due to its baseline error.
            sigma2 = (temper * temper * phi)[:, None] * (a * a * pq * per_request).sum(axis=2)  # (R, C)
            with np.errstate(divide="ignore"):
                tau2_rows = np.where(sigma2 > 0.0, 4.0 / (n_base * sigma2), np.inf) + var_phi
            for d, r in enumerate(drops.tolist()):
                if model_var[d] <= 0.0:
                    continue
                tau2s.append(tau2_rows[d])
                rows.append(temper[d] * np.concatenate([a[d], b[d]], axis=1))  # (C, 2K)
                labels.append(f"{name} -{r:.3f}")
                set_of.append(si)
                phis.append(float(phi[d]))
        if rows:
            tau2 = np.stack(tau2s)  # (G, C)
            finite = np.isfinite(tau2)
            kappa = np.full(tau2.shape, np.nan)
            kappa[finite] = estimation_temperings(self.arl0, tau2[finite])
            # A row that no tempering can make safe gives this component no evidence; a component
            # with no row left is dropped (its expected delay is beyond what the window resolves).
            keep = [g for g in range(len(rows)) if not np.isnan(kappa[g]).all()]
            rows = [rows[g] * np.nan_to_num(kappa[g])[:, None] for g in keep]
            labels = [labels[g] for g in keep]
            set_of = [set_of[g] for g in keep]
            phis = [phis[g] for g in keep]

        g_count = len(rows)
        W = np.stack(rows, axis=1) if rows else np.zeros((p0.shape[0], 0, 2 * k))
        weights = np.zeros(g_count)
        kept_sets = sorted(set(set_of))
        if kept_sets:
            has_all = 0 in kept_sets and sets[0][0] == "all"
            singles = [s for s in kept_sets if sets[s][0] != "all"]
            share_all = (1.0 - self.single_share if singles else 1.0) if has_all else 0.0
            share_single = (1.0 - share_all) / len(singles) if singles else 0.0
            for g, si in enumerate(set_of):
                n_in_set = set_of.count(si)
                weights[g] = (share_all if sets[si][0] == "all" else share_single) / n_in_set
        digest = _kernel_digest(W, weights, self.threshold_method)
        self._calibration_pending = False
        if stored_threshold is not None and stored_threshold.get("kernel") == digest:
            log_threshold = float(stored_threshold["log"])
            self._calibration_pending = bool(stored_threshold.get("pending", False))
        elif self.threshold_method == "simulated" and self.calibrate_on_freeze:
            log_threshold = simulated_log_threshold(W=W, weights=weights, groups=stat_groups, arl0=self.arl0)
        else:
            log_threshold = sr_log_threshold(self.arl0)
            self._calibration_pending = self.threshold_method == "simulated"
        self._threshold_digest = digest
        self._kernel = SRKernel(
            W=W,
            weights=weights,
            p0=np.nan_to_num(p0),
            log_threshold=log_threshold,
            groups={name: i for i, name in enumerate([POOLED, *own])},
            labels=labels,
            dispersion=phis,
        )
        # Per group: identity rows (running counts), baseline-expected successes, then W.
        n_groups = p0.shape[0]
        M = np.zeros((n_groups, 3 * k + g_count, 2 * k))
        M[:, : 2 * k, :] = np.eye(2 * k)
        for c in range(n_groups):
            M[c, 2 * k : 3 * k, k:] = np.diag(self._kernel.p0[c])
        M[:, 3 * k :, :] = W
        self._M = M
        self._bind()

    def _bind(self) -> None:
        """Preallocated per-request buffers and views over the frozen kernel (not state: rebuilt)."""
        kernel = self._kernel
        assert kernel is not None
        k = self.n_positions
        g = kernel.W.shape[1]
        self._g = g
        self._groups = kernel.groups
        self._weights = kernel.weights
        self._Mc = [np.ascontiguousarray(m) for m in self._M]
        self._x = np.zeros(2 * k)
        self._y = np.zeros(3 * k + g)
        self._y_cum = self._y[: 3 * k]
        self._llr = self._y[3 * k :]
        self._ones = np.ones(g)
        self._reset = np.zeros(g, dtype=bool)
        self._reset_col = self._reset[:, None]
        # The bound keeps ARL0 itself as the level (exp(ln ARL0) may differ from it in the last bit).
        bound = self.threshold_method == "bound" or self._calibration_pending
        self._alarm_level = self.arl0 if bound else math.exp(kernel.log_threshold)
        self._clear_statistic()

    @property
    def calibration_pending(self) -> bool:
        """True while a frozen detector still runs at the Pollak bound awaiting :meth:`calibrate`."""
        return self._kernel is not None and self._calibration_pending

    def calibrate(self) -> bool:
        """Simulate the threshold of a detector frozen with ``calibrate_on_freeze=False``; the
        statistic carries on (a lower level can only make the next update alarm sooner). Returns
        whether it calibrated anything."""
        kernel = self._kernel
        if kernel is None or not self._calibration_pending:
            return False
        groups = self._reference.groups(self.min_category_requests if self.risk_adjust else 1 << 62)
        own = [g.name for g in groups[1:]]
        stat_groups = [self._reference.rest(own), *groups[1:]]
        log_threshold = simulated_log_threshold(
            W=kernel.W, weights=kernel.weights, groups=stat_groups, arl0=self.arl0
        )
        self._kernel = replace(kernel, log_threshold=log_threshold)
        self._calibration_pending = False
        self._alarm_level = math.exp(log_threshold)
        return True

    # ---------------------------------------------------------------------------------------- state

    def config(self) -> dict[str, Any]:
        return {
            "arl0": self.arl0,
            "min_drop": self.min_drop,
            "max_rel_drop": self.max_rel_drop,
            "n_grid": self.n_grid,
            "n_positions": self.n_positions,
            "reference_size": self.reference_size,
            "cooldown": self.cooldown,
            "single_positions": self.single_positions,
            "risk_adjust": self.risk_adjust,
            "min_category_requests": self.min_category_requests,
            "min_trials": self.min_trials,
            "dispersion": self.dispersion,
            "single_share": self.single_share,
            "threshold": self.threshold_method,
            "calibrate_on_freeze": self.calibrate_on_freeze,
        }

    def to_state(self) -> dict[str, Any]:
        """Full state as a JSON-able dict; :meth:`from_state` continues bit-identically."""
        return {
            "type": "MixtureSR",
            "version": STATE_VERSION,
            "config": self.config(),
            "reference": self._reference.to_state(),
            "frozen": self._kernel is not None,
            "threshold": None
            if self._kernel is None
            else {
                "log": self._kernel.log_threshold,
                "kernel": self._threshold_digest,
                "pending": self._calibration_pending,
            },
            "rw": pack_array(self._rw),
            "cusum": pack_array(self._cusum),
            "cum": pack_array(self._cum),
            "snapshot": pack_array(self._snapshot),
            "start": pack_array(self._start),
            "examined": self._examined,
            "stat": self._stat,
            "cooldown_left": self._cooldown_left,
            "alarms": self._alarms,
            "alarm": None if self._alarm is None else self._alarm.to_dict(),
        }

    @classmethod
    def from_state(cls, state: dict[str, Any], *, calibrate_on_freeze: bool | None = None) -> MixtureSR:
        """Restore a state; ``calibrate_on_freeze`` overrides the stored choice (a fleet monitor
        restoring a state written without its threshold defers the simulation, see calibrate())."""
        if state.get("type") != "MixtureSR" or state.get("version") != STATE_VERSION:
            raise ValueError(
                f"not a MixtureSR state v{STATE_VERSION}: {state.get('type')} v{state.get('version')}"
            )
        config = dict(state["config"])
        if calibrate_on_freeze is not None:
            config["calibrate_on_freeze"] = calibrate_on_freeze
        out = cls(**config)
        out._reference = ReferenceWindow.from_state(state["reference"])
        if state["frozen"]:
            # A state saved without its threshold (or for another kernel) gets it computed again.
            out._freeze(state.get("threshold"))
        g = 0 if out._kernel is None else out._kernel.W.shape[1]
        out._cooldown_left = int(state["cooldown_left"])
        out._alarms = int(state["alarms"])
        out._alarm = None if state["alarm"] is None else DriftEvidence.from_dict(state["alarm"])
        rw = unpack_array(state["rw"], np.float64)
        if rw.size != g:
            # Saved by a version whose calibration kept other components: the baseline (the
            # reference window) still holds, so keep it and the latch, and restart the statistic.
            return out
        out._rw = rw.reshape(g)
        out._cusum = unpack_array(state["cusum"], np.float64).reshape(g)
        out._cum = unpack_array(state["cum"], np.float64).reshape(3 * out.n_positions)
        out._snapshot = unpack_array(state["snapshot"], np.float64).reshape(g, 3 * out.n_positions)
        out._start = unpack_array(state["start"], np.int64).reshape(g)
        out._examined = int(state["examined"])
        out._stat = float(state["stat"])
        return out
