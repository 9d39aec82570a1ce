"""The oracle Bernoulli CUSUM: knows the true pre- and post-change per-position rates.

It is the yardstick of the benchmark (Lorden's bound is attained by CUSUM with known rates), not
a production detector: real deployments know neither rate. Same interface and state format as
the other detectors. Its per-request log-likelihood ratio sums the per-trial Bernoulli ratios
over positions: ``l = sum_i s_i ln(p1_i/p0_i) + (n_i - s_i) ln(q1_i/q0_i)``.

>>> import random
>>> from controlplane.drift import OracleCUSUM, RequestObservation
>>> rng = random.Random(3)
>>> def request(p, steps=20):
...     accepted, tried = [], steps
...     for _ in range(4):
...         tried = sum(rng.random() < p for _ in range(tried))
...         accepted.append(tried)
...     return RequestObservation.from_counts(k=4, verify_steps=steps, accepted_per_position=accepted,
...                                           drafted_tokens=80, accepted_tokens=sum(accepted))
>>> detector = OracleCUSUM(p0=[0.8] * 4, p1=[0.7] * 4, threshold=9.0)
>>> for i in range(1_000):
...     _ = detector.update(request(0.8 if i < 500 else 0.7))
...     if detector.drift_detected:
...         break
>>> i, detector.evidence().detection_delay_estimate
(506, 12)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from controlplane.drift.calibration import cusum_log_threshold, kl_per_request
from controlplane.drift.evidence import DriftEvidence
from controlplane.drift.observation import RequestObservation

STATE_VERSION = 1


class OracleCUSUM:
    """Page's CUSUM on per-position Bernoulli trials with known ``p0`` and ``p1`` (one entry per position).

    ``threshold`` is the log alarm level ``h``; when omitted it is derived from ``arl0`` with the
    Basseville-Nikiforov approximation, which needs the mean trials per request per position
    (``mean_trials``) and assumes independent trials (the benchmark bisects ``h`` instead).
    """

    def __init__(
        self,
        *,
        p0: Sequence[float],
        p1: Sequence[float],
        threshold: float | None = None,
        arl0: float = 10_000.0,
        mean_trials: Sequence[float] | None = None,
        cooldown: int = 0,
    ) -> None:
        if len(p0) != len(p1) or not p0:
            raise ValueError("p0 and p1 need one rate per position")
        if not all(0.0 < a < 1.0 and 0.0 < b < 1.0 for a, b in zip(p0, p1, strict=True)):
            raise ValueError("rates must lie in (0, 1)")
        self.p0 = [float(v) for v in p0]
        self.p1 = [float(v) for v in p1]
        self.arl0 = float(arl0)
        self.cooldown = int(cooldown)
        self.mean_trials = None if mean_trials is None else [float(v) for v in mean_trials]
        if threshold is None:
            if self.mean_trials is None:
                raise ValueError("give threshold, or mean_trials to derive it from arl0")
            threshold = cusum_log_threshold(self.arl0, kl_per_request(self.p0, self.p1, self.mean_trials))
        self.h = float(threshold)
        self._a = [math.log(b / a) - math.log((1.0 - b) / (1.0 - a)) for a, b in zip(p0, p1, strict=True)]
        self._b = [math.log((1.0 - b) / (1.0 - a)) for a, b in zip(p0, p1, strict=True)]
        self._cooldown_left = 0
        self._clear()

    def _clear(self) -> None:
        k = len(self.p0)
        self._w = 0.0
        self._examined = 0
        self._start = 0
        self._since = [0.0] * (2 * k)
        self._alarm: DriftEvidence | None = None

    def update(self, x: RequestObservation) -> OracleCUSUM:
        """Advance by one request; returns self."""
        if self._alarm is not None:
            return self
        if self._cooldown_left > 0:
            self._cooldown_left -= 1
            return self
        k = len(self.p0)
        s, n = x.successes(k), x.trials(k)
        llr = sum(a * si + b * ni for a, b, si, ni in zip(self._a, self._b, s, n, strict=True))
        self._examined += 1
        self._w += llr
        if self._w <= 0.0:
            self._w = 0.0
            self._start = self._examined
            self._since = [0.0] * (2 * k)
        else:
            self._since = [u + v for u, v in zip(self._since, s + n, strict=True)]
        if self._w >= self.h:
            self._alarm = self.evidence()
        return self

    @property
    def drift_detected(self) -> bool:
        return self._alarm is not None

    def reset(self) -> None:
        """Clear the alarm and the statistic; ignore the next ``cooldown`` requests."""
        self._clear()
        self._cooldown_left = self.cooldown

    @property
    def statistic(self) -> float:
        return self._w

    def evidence(self) -> DriftEvidence:
        if self._alarm is not None:
            return self._alarm
        k = len(self.p0)
        s, n = self._since[:k], self._since[k:]
        total = sum(n)
        est_i = [si / ni if ni else float("nan") for si, ni in zip(s, n, strict=True)]
        base = sum(p * ni for p, ni in zip(self.p0, n, strict=True)) / total if total else sum(self.p0) / k
        est = sum(s) / total if total else base
        drops = [p - e if ni else -math.inf for p, e, ni in zip(self.p0, est_i, n, strict=True)]
        return DriftEvidence(
            baseline_rate=base,
            current_estimate=est,
            drop=base - est,
            position_most_affected=max(range(k), key=lambda i: drops[i]) if total else None,
            baseline_per_position=list(self.p0),
            estimate_per_position=est_i,
            statistic=self._w,
            threshold=self.h,
            records_examined=self._examined,
            detection_delay_estimate=self._examined - self._start,
            component="oracle",
        )

    def to_state(self) -> dict[str, Any]:
        return {
            "type": "OracleCUSUM",
            "version": STATE_VERSION,
            "config": {
                "p0": self.p0,
                "p1": self.p1,
                "threshold": self.h,
                "arl0": self.arl0,
                "mean_trials": self.mean_trials,
                "cooldown": self.cooldown,
            },
            "w": self._w,
            "examined": self._examined,
            "start": self._start,
            "since": list(self._since),
            "cooldown_left": self._cooldown_left,
            "alarm": None if self._alarm is None else self._alarm.to_dict(),
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> OracleCUSUM:
        if state.get("type") != "OracleCUSUM" or state.get("version") != STATE_VERSION:
            raise ValueError("not an OracleCUSUM state")
        out = cls(**state["config"])
        out._w = float(state["w"])
        out._examined = int(state["examined"])
        out._start = int(state["start"])
        out._since = [float(v) for v in state["since"]]
        out._cooldown_left = int(state["cooldown_left"])
        out._alarm = None if state["alarm"] is None else DriftEvidence.from_dict(state["alarm"])
        return out
