"""The workload-mix side monitor: has the traffic itself changed (category shares, prompt length)?

It does not judge the drafter. The main detector is risk-adjusted (each request is scored against
its own category's baseline), so a pure change of mix does not fire it; this monitor says whether
the mix moved, and :meth:`MixMonitor.attribution` splits a pooled hit-rate change into the part the
new mix explains (reference per-category rates reweighted by the recent mix) and the rest.

Statistics are exponentially weighted over an effective ``window`` of requests and compared with a
frozen reference window. A mix shift is flagged when the total-variation distance between recent
and reference category shares reaches ``min_shift`` *and* its G-test (likelihood-ratio) statistic
reaches ``2 ln(arl0)``; or when the mean log prompt length moved by ``min_length_shift`` with a
z-score of ``sqrt(2 ln(arl0))``. This is a descriptive side signal, not an ARL-calibrated test.

>>> import random
>>> from controlplane.drift import MixMonitor, RequestObservation
>>> rng = random.Random(5)
>>> def request(code_share):
...     code = rng.random() < code_share
...     return RequestObservation.from_counts(
...         k=1, verify_steps=10, accepted_per_position=[5 if code else 8], drafted_tokens=10,
...         accepted_tokens=5 if code else 8, category="code" if code else "prose")
>>> monitor = MixMonitor(reference_size=500, window=200)
>>> for i in range(3_000):
...     _ = monitor.update(request(0.2 if i < 1_500 else 0.6))
...     if monitor.drift_detected:
...         break
>>> i
1534
>>> a = monitor.attribution()
>>> round(a.reference_rate, 2), round(a.expected_rate_from_mix, 2), a.verdict
(0.74, 0.71, 'mix shift')
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from controlplane.drift.observation import RequestObservation

STATE_VERSION = 1
OTHER = "(other)"  # categories beyond max_categories, and requests without a category label


@dataclass(frozen=True, slots=True)
class MixAttribution:
    """How much of a pooled hit-rate change the recent workload mix explains."""

    reference_shares: dict[str, float]
    recent_shares: dict[str, float]
    total_variation: float
    prompt_length_ratio: float | None  # recent / reference geometric mean prompt length
    reference_rate: float
    expected_rate_from_mix: float
    observed_rate: float
    explained_fraction: float  # (reference - expected) / (reference - observed), clipped to [0, 1]
    verdict: str  # "mix shift", "drafter", "mix shift and drafter" or "none"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class MixMonitor:
    """Side monitor of category shares and prompt length (see module docstring)."""

    def __init__(
        self,
        *,
        arl0: float = 10_000.0,
        min_shift: float = 0.1,
        min_length_shift: float = 0.25,
        min_drop: float = 0.05,
        reference_size: int = 1_000,
        window: int = 500,
        cooldown: int = 0,
        max_categories: int = 32,
    ) -> None:
        if not arl0 > 1.0 or not 0.0 < min_shift <= 1.0 or window < 2 or reference_size < 1:
            raise ValueError("invalid MixMonitor settings")
        self.arl0 = float(arl0)
        self.min_shift = float(min_shift)
        self.min_length_shift = float(min_length_shift)
        self.min_drop = float(min_drop)
        self.reference_size = int(reference_size)
        self.window = int(window)
        self.cooldown = int(cooldown)
        self.max_categories = int(max_categories)
        self._decay = 1.0 - 1.0 / self.window
        self.rebaseline()

    def rebaseline(self) -> None:
        """Start a new reference window."""
        # Per category: [requests, successes, trials]; reference and decayed recent.
        self._ref: dict[str, list[float]] = {}
        self._ref_n = 0
        self._ref_len = [0.0, 0.0, 0.0]  # count, sum log length, sum squared log length
        self._cooldown_left = 0
        self._clear()

    def reset(self) -> None:
        """Clear the alarm and the recent window; ignore the next ``cooldown`` requests."""
        self._clear()
        self._cooldown_left = self.cooldown

    def _clear(self) -> None:
        self._recent: dict[str, list[float]] = {}
        self._recent_weight = 0.0
        self._recent_len = [0.0, 0.0]  # decayed count, decayed sum of log length
        self._examined = 0
        self._alarm: MixAttribution | None = None

    def _key(self, category: str | None, table: dict[str, list[float]]) -> str:
        if category is None:
            return OTHER
        if category in table or category in self._ref or len(table) < self.max_categories:
            return category
        return OTHER

    def update(self, x: RequestObservation) -> MixMonitor:
        """Advance by one request; returns self."""
        s = float(sum(x.accepted_per_position))
        n = float(x.verify_steps + sum(x.accepted_per_position[:-1]))
        log_len = math.log1p(x.prompt_tokens) if x.prompt_tokens is not None else None
        if self._ref_n < self.reference_size:
            row = self._ref.setdefault(self._key(x.category, self._ref), [0.0, 0.0, 0.0])
            row[0] += 1.0
            row[1] += s
            row[2] += n
            self._ref_n += 1
            if log_len is not None:
                self._ref_len[0] += 1.0
                self._ref_len[1] += log_len
                self._ref_len[2] += log_len * log_len
            return self
        if self._alarm is not None:
            return self
        if self._cooldown_left > 0:
            self._cooldown_left -= 1
            return self
        d = self._decay
        for row in self._recent.values():
            row[0] *= d
            row[1] *= d
            row[2] *= d
        row = self._recent.setdefault(self._key(x.category, self._recent), [0.0, 0.0, 0.0])
        row[0] += 1.0
        row[1] += s
        row[2] += n
        self._recent_weight = self._recent_weight * d + 1.0
        if log_len is not None:
            self._recent_len[0] = self._recent_len[0] * d + 1.0
            self._recent_len[1] = self._recent_len[1] * d + log_len
        self._examined += 1
        if self._examined >= self.window and self._shifted():
            self._alarm = self.attribution()
        return self

    def update_window(self, groups: list[tuple[str | None, int, float, float, list[float]]]) -> MixMonitor:
        """Advance by one window of aggregated requests: ``(category, requests, successes, trials,
        [prompt count, sum log1p(prompt), sum of squares])`` per category.

        The window's requests are weighted as if they all arrived at its end (the exponential
        weights inside one window are not recoverable from sums); with windows much shorter than
        ``window`` requests that changes the recent shares by a fraction of one window's weight.
        """
        count = sum(int(g[1]) for g in groups)
        if count <= 0:
            return self
        if self._ref_n < self.reference_size:
            for category, c, successes, trials, prompt in groups:
                row = self._ref.setdefault(self._key(category, self._ref), [0.0, 0.0, 0.0])
                row[0] += c
                row[1] += successes
                row[2] += trials
                for i in range(3):
                    self._ref_len[i] += prompt[i]
            self._ref_n += count
            return self
        if self._alarm is not None:
            return self
        if self._cooldown_left > 0:
            self._cooldown_left = max(0, self._cooldown_left - count)
            return self
        d = self._decay**count
        for row in self._recent.values():
            row[0] *= d
            row[1] *= d
            row[2] *= d
        self._recent_weight *= d
        self._recent_len[0] *= d
        self._recent_len[1] *= d
        for category, c, successes, trials, prompt in groups:
            row = self._recent.setdefault(self._key(category, self._recent), [0.0, 0.0, 0.0])
            row[0] += c
            row[1] += successes
            row[2] += trials
            self._recent_weight += c
            self._recent_len[0] += prompt[0]
            self._recent_len[1] += prompt[1]
        self._examined += count
        if self._examined >= self.window and self._shifted():
            self._alarm = self.attribution()
        return self

    def _effective_n(self) -> float:
        # Kish effective sample size of exponential weights over the requests seen so far.
        d, m = self._decay, self._examined
        total = (1.0 - d**m) / (1.0 - d)
        squares = (1.0 - d ** (2 * m)) / (1.0 - d * d)
        return total * total / squares

    def _shifted(self) -> bool:
        ref_shares, recent_shares = self._shares()
        n_eff = self._effective_n()
        tv = 0.5 * sum(
            abs(recent_shares.get(c, 0.0) - ref_shares.get(c, 0.0)) for c in ref_shares | recent_shares
        )
        if tv >= self.min_shift:
            g = 0.0
            for c, p in recent_shares.items():
                if p > 0.0:
                    # Unseen-in-reference categories get half a request of reference mass.
                    q = max(ref_shares.get(c, 0.0), 0.5 / self._ref_n)
                    g += 2.0 * n_eff * p * math.log(p / q)
            if g >= 2.0 * math.log(self.arl0):
                return True
        count, total, squares = self._ref_len
        if count >= 2 and self._recent_len[0] > 0:
            mean = total / count
            sd = math.sqrt(max(squares / count - mean * mean, 1e-12))
            shift = self._recent_len[1] / self._recent_len[0] - mean
            n_len = n_eff * self._recent_len[0] / max(self._recent_weight, 1e-12)
            if abs(shift) >= self.min_length_shift and abs(shift) / sd * math.sqrt(n_len) >= math.sqrt(
                2.0 * math.log(self.arl0)
            ):
                return True
        return False

    def _shares(self) -> tuple[dict[str, float], dict[str, float]]:
        ref = {c: row[0] / self._ref_n for c, row in self._ref.items()} if self._ref_n else {}
        w = self._recent_weight
        recent = {c: row[0] / w for c, row in self._recent.items()} if w > 0 else {}
        return ref, recent

    @property
    def drift_detected(self) -> bool:
        """True from a detected mix shift until :meth:`reset`."""
        return self._alarm is not None

    def attribution(self) -> MixAttribution:
        """Split the recent pooled hit-rate change into the mix-explained part and the rest."""
        if self._alarm is not None:
            return self._alarm
        ref_shares, recent_shares = self._shares()
        ref_s = sum(r[1] for r in self._ref.values())
        ref_n = sum(r[2] for r in self._ref.values())
        reference_rate = ref_s / ref_n if ref_n else float("nan")
        rec_n = sum(r[2] for r in self._recent.values())
        observed = sum(r[1] for r in self._recent.values()) / rec_n if rec_n else reference_rate
        expected = 0.0
        for c, row in self._recent.items():
            ref_row = self._ref.get(c)
            rate = ref_row[1] / ref_row[2] if ref_row and ref_row[2] > 0 else reference_rate
            expected += (row[2] / rec_n) * rate if rec_n else 0.0
        if not rec_n:
            expected = reference_rate
        total_drop = reference_rate - observed
        mix_drop = reference_rate - expected
        explained = min(1.0, max(0.0, mix_drop / total_drop)) if total_drop > 0 else 0.0
        tv = 0.5 * sum(
            abs(recent_shares.get(c, 0.0) - ref_shares.get(c, 0.0)) for c in ref_shares | recent_shares
        )
        count, total, _ = self._ref_len
        length_ratio = None
        if count > 0 and self._recent_len[0] > 0:
            length_ratio = math.exp(self._recent_len[1] / self._recent_len[0] - total / count)
        mix_moved = tv >= self.min_shift or (
            length_ratio is not None and abs(math.log(length_ratio)) >= self.min_length_shift
        )
        drafter = expected - observed >= self.min_drop  # a drop the new mix does not explain
        verdict = {
            (True, True): "mix shift and drafter",
            (True, False): "mix shift",
            (False, True): "drafter",
            (False, False): "none",
        }[(mix_moved, drafter)]
        return MixAttribution(
            reference_shares=ref_shares,
            recent_shares=recent_shares,
            total_variation=tv,
            prompt_length_ratio=length_ratio,
            reference_rate=reference_rate,
            expected_rate_from_mix=expected,
            observed_rate=observed,
            explained_fraction=explained,
            verdict=verdict,
        )

    def config(self) -> dict[str, Any]:
        return {
            "arl0": self.arl0,
            "min_shift": self.min_shift,
            "min_length_shift": self.min_length_shift,
            "min_drop": self.min_drop,
            "reference_size": self.reference_size,
            "window": self.window,
            "cooldown": self.cooldown,
            "max_categories": self.max_categories,
        }

    def to_state(self) -> dict[str, Any]:
        """Full state as a JSON-able dict."""
        return {
            "type": "MixMonitor",
            "version": STATE_VERSION,
            "config": self.config(),
            "ref": {c: list(v) for c, v in self._ref.items()},
            "ref_n": self._ref_n,
            "ref_len": list(self._ref_len),
            "recent": {c: list(v) for c, v in self._recent.items()},
            "recent_weight": self._recent_weight,
            "recent_len": list(self._recent_len),
            "examined": self._examined,
            "cooldown_left": self._cooldown_left,
            "alarm": None if self._alarm is None else self._alarm.to_dict(),
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> MixMonitor:
        if state.get("type") != "MixMonitor" or state.get("version") != STATE_VERSION:
            raise ValueError("not a MixMonitor state")
        out = cls(**state["config"])
        out._ref = {c: [float(u) for u in v] for c, v in state["ref"].items()}
        out._ref_n = int(state["ref_n"])
        out._ref_len = [float(u) for u in state["ref_len"]]
        out._recent = {c: [float(u) for u in v] for c, v in state["recent"].items()}
        out._recent_weight = float(state["recent_weight"])
        out._recent_len = [float(u) for u in state["recent_len"]]
        out._examined = int(state["examined"])
        out._cooldown_left = int(state["cooldown_left"])
        out._alarm = None if state["alarm"] is None else MixAttribution(**state["alarm"])
        return out
