"""The frozen reference window: sufficient statistics of per-request counts, per traffic category.

A detector's baseline is estimated here, once, from the first requests after a (re)start, and never
updated while monitoring (a slowly drifting baseline would absorb the very drop it should detect).
Per request it keeps only ``count``, ``sum x`` and ``sum x x'`` of ``x = (successes, trials)``
per position, which is enough for the per-position rates, their standard errors and the
residual covariance that measures overdispersion, whatever the baseline turns out to be.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]
POOLED = "*"  # the group every request belongs to; categories without their own baseline use it


class ReferenceWindow:
    """Accumulates per-group sufficient statistics of ``x = (successes[K], trials[K])``."""

    def __init__(self, n_positions: int, max_categories: int = 32) -> None:
        self.n_positions = n_positions
        self.max_categories = max_categories
        dim = 2 * n_positions
        self._count: dict[str, int] = {POOLED: 0}
        self._sx: dict[str, FloatArray] = {POOLED: np.zeros(dim)}
        self._sxx: dict[str, FloatArray] = {POOLED: np.zeros((dim, dim))}
        # A frozen window is saved with every state of its detector: serialised once, not each time.
        self._state: dict[str, Any] | None = None

    @property
    def count(self) -> int:
        return self._count[POOLED]

    def add(self, x: FloatArray, category: str | None) -> None:
        """Add one request's vector ``x`` (length 2K) to the pooled group and to its category."""
        self.add_sums(1, x, np.outer(x, x), category)

    def add_sums(self, count: int, sx: FloatArray, sxx: FloatArray, category: str | None) -> None:
        """Add ``count`` requests given only their sums ``sum x`` and ``sum x x'`` (an edge aggregate)."""
        self._state = None
        keys = [POOLED]
        if category is not None and category != POOLED:
            if category in self._count or len(self._count) - 1 < self.max_categories:
                keys.append(category)
        dim = 2 * self.n_positions
        for key in keys:
            if key not in self._count:
                self._count[key] = 0
                self._sx[key] = np.zeros(dim)
                self._sxx[key] = np.zeros((dim, dim))
            self._count[key] += int(count)
            self._sx[key] += sx
            self._sxx[key] += sxx

    def add_many(self, x: FloatArray, categories: list[str | None] | None) -> None:
        """Add many requests at once (rows of ``x``); same sums as repeated :meth:`add` (integer counts)."""
        self._state = None
        cats: list[str | None] = list(categories) if categories is not None else [None] * len(x)
        dim = 2 * self.n_positions
        by_key: dict[str, list[int]] = {POOLED: list(range(len(x)))}
        n_known = len(self._count) - 1
        for i, c in enumerate(cats):
            if c is None or c == POOLED:
                continue
            if c not in self._count and c not in by_key:
                if n_known >= self.max_categories:
                    continue  # same cap as add(): later categories only join the pooled group
                n_known += 1
            by_key.setdefault(c, []).append(i)
        for key, rows in by_key.items():
            sub = x[rows]
            if key not in self._count:
                self._count[key] = 0
                self._sx[key] = np.zeros(dim)
                self._sxx[key] = np.zeros((dim, dim))
            self._count[key] += len(rows)
            self._sx[key] += sub.sum(axis=0)
            self._sxx[key] += sub.T @ sub

    def groups(self, min_requests: int) -> list[GroupStats]:
        """Pooled group first, then every category with at least ``min_requests`` requests."""
        out = [self._stats(POOLED)]
        for key in sorted(k for k in self._count if k != POOLED):
            if self._count[key] >= min_requests:
                out.append(self._stats(key))
        return out

    def rest(self, own: list[str]) -> GroupStats:
        """Pooled minus the categories that have their own baseline (their requests use the pooled rates)."""
        count = self._count[POOLED] - sum(self._count[k] for k in own)
        sx = self._sx[POOLED] - sum((self._sx[k] for k in own), np.zeros(2 * self.n_positions))
        sxx = self._sxx[POOLED] - sum(
            (self._sxx[k] for k in own), np.zeros((2 * self.n_positions, 2 * self.n_positions))
        )
        return GroupStats(POOLED, count, sx, sxx)

    def _stats(self, key: str) -> GroupStats:
        return GroupStats(key, self._count[key], self._sx[key].copy(), self._sxx[key].copy())

    def to_state(self) -> dict[str, Any]:
        if self._state is not None:
            return self._state
        self._state = {
            "n_positions": self.n_positions,
            "max_categories": self.max_categories,
            "groups": {
                k: {"count": self._count[k], "sx": self._sx[k].tolist(), "sxx": self._sxx[k].tolist()}
                for k in self._count
            },
        }
        return self._state

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> ReferenceWindow:
        out = cls(int(state["n_positions"]), int(state["max_categories"]))
        for key, g in state["groups"].items():
            out._count[key] = int(g["count"])
            out._sx[key] = np.asarray(g["sx"], dtype=np.float64)
            out._sxx[key] = np.asarray(g["sxx"], dtype=np.float64)
        return out


@dataclass(frozen=True)
class GroupStats:
    """Sufficient statistics of one group: ``count`` requests, ``sx = sum x``, ``sxx = sum x x'``."""

    name: str
    count: int
    sx: FloatArray
    sxx: FloatArray

    @property
    def k(self) -> int:
        return int(self.sx.shape[0]) // 2

    @property
    def successes(self) -> FloatArray:
        return self.sx[: self.k]

    @property
    def trials(self) -> FloatArray:
        return self.sx[self.k :]

    def rates(self, min_trials: float) -> FloatArray:
        """Per-position acceptance (add-half smoothed); NaN where fewer than ``min_trials`` trials."""
        n = self.trials
        p = (self.successes + 0.5) / (n + 1.0)
        return np.where(n >= min_trials, p, np.nan)

    def residual_cov(self, p: FloatArray) -> FloatArray:
        """``sum over requests of e e'`` with ``e = s - p * n`` (NaN rates count as 0)."""
        k = self.k
        p0 = np.nan_to_num(p)
        ss, sn = self.sxx[:k, :k], self.sxx[:k, k:]
        ns, nn = self.sxx[k:, :k], self.sxx[k:, k:]
        pp = np.diag(p0)
        out: FloatArray = ss - pp @ ns - sn @ pp + pp @ nn @ pp
        return out
