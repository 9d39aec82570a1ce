"""The live judge's running per-arm sums: everything a canary decision, its figures and the
guardrails read from acceptance records, kept as sufficient statistics that round-trip through
JSON, so each judge tick folds only the records it has not seen. Pure: no database.

Nothing here needs a per-record buffer. The two primary metrics are Welford sums
(:class:`controlplane.canary.statistics.ArmAccumulator`); the token counts are integer totals; the
request-level standard error of the hit rate (``policy.request_level_spread``, the cluster-robust
variance ``sum((a_i - p d_i)^2) n / (n - 1) / D^2``) expands into integer sums of ``d^2``, ``a d``
and ``a^2``, so it is computed exactly, never from a float cancellation. Folding the same records
in the same (id) order gives the same floats whether they arrive in one batch or many.

The same sums are also kept per request category (``AcceptanceRecordRow.category``), so the
decision can refuse a candidate that wins on the overall mix while losing one kind of traffic.
A client chooses category names, so at most :data:`CATEGORY_LIMIT` named categories get their
own sums: the first ones seen in record (id) order, which in steady traffic are the frequent
ones (a category with share ``s`` shows up within about ``1 / s`` requests); later names pool
into :data:`OTHER_CATEGORIES`. Records without a category share :data:`UNCATEGORISED`. Admission
by id order keeps an incremental tally and a recount identical.

An edge that sums its traffic per window (``controlplane.ingest.aggregates.WindowAggregate``)
sends these same sums: :meth:`ArmTally.add_aggregate` merges one window's sums, so per-request
records and window aggregates feed one tally. The primary metrics arrive as ``[n, sum, sum of
squares]`` and are merged as Welford states (Chan et al.), equal to adding the window's requests
one by one up to float rounding; the token counts and the spread are integers, added exactly.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from controlplane import speculation_math
from controlplane.canary.statistics import (
    LATENCY_MS_PER_TOKEN,
    TOKENS_PER_STEP,
    ArmAccumulator,
    MetricAccumulator,
)

# 2 added the per-category sums; a version-1 state (written before) is still read: its earlier
# records are in the per-arm sums only, and the per-category sums start from the next record.
TALLY_VERSION = 2
READABLE_TALLY_VERSIONS = (1, 2)
UNCATEGORISED = ""  # records without a category (``None`` or empty), as the rollups key them
OTHER_CATEGORIES = "other"  # named categories beyond the limit, pooled
CATEGORY_LIMIT = 16  # named categories with their own sums per tally


def category_key(category: str | None) -> str:
    """The bucket name of a record's category before the limit applies (``None`` -> uncategorised)."""
    return category if category else UNCATEGORISED


def _three_sums(sums: Sequence[float]) -> tuple[float, float, float]:
    if len(sums) != 3:
        raise ValueError("a metric's sums are [n, sum, sum of squares]")
    return float(sums[0]), float(sums[1]), float(sums[2])


def _add_positions(into: list[int], counts: Iterable[Any]) -> None:
    per_position = [int(c) for c in counts]
    if len(per_position) > len(into):
        into += [0] * (len(per_position) - len(into))
    for i, count in enumerate(per_position):
        into[i] += count


@dataclass
class ArmTally:
    """One arm's sums over the records and window aggregates folded so far."""

    stats: ArmAccumulator = field(default_factory=ArmAccumulator)  # the decision's per-request metrics
    timed: int = 0  # requests with a latency (the figures' request count)
    tokens_per_step_sum: float = 0.0
    ms_per_token_sum: float = 0.0
    drafted: int = 0
    accepted: int = 0
    verify_steps: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    # Over requests that drafted anything: the hit rate's request-level spread.
    spread_requests: int = 0
    spread_drafted: int = 0
    spread_accepted: int = 0
    drafted_squared: int = 0
    accepted_drafted: int = 0
    accepted_squared: int = 0

    def add(self, row: Any) -> None:
        """Fold one acceptance record (any object with the record's count and latency fields)."""
        generated = int(row.generated_tokens or 0)
        steps = int(row.verify_steps or 0)
        if generated <= 0:
            return
        latency = speculation_math.ms_per_token(row.inter_token_ms, row.total_ms, row.ttft_ms, generated)
        if latency is not None:  # the two primary metrics stay paired request by request
            tokens_per_step = speculation_math.tokens_per_step(generated, steps)
            self.timed += 1
            self.tokens_per_step_sum += tokens_per_step
            self.ms_per_token_sum += latency
            if tokens_per_step > 0 and latency > 0:  # the statistics refuse empty requests
                self.stats.add(tokens_per_step=tokens_per_step, latency_ms_per_token=latency)
        self.verify_steps += steps
        _add_positions(self.accepted_per_position, row.accepted_per_position or [])
        self.add_counts(int(row.drafted_tokens or 0), int(row.accepted_tokens or 0))

    def add_aggregate(self, agg: Any) -> None:
        """Fold one window aggregate (any object with ``WindowAggregate``'s fields): its requests'
        sums merged at once.

        The metric sums cover the requests where both metrics are positive, exactly those
        :meth:`add` passes to the statistics. ``timed_requests`` also counts requests timed at
        zero latency (an engine reporting a total equal to its TTFT), whose tokens per step the
        window does not carry: each is counted at the window's mean, so the figures' request
        count stays exact and the mean tokens per step unchanged. Unlike :meth:`add`, the token
        totals also hold requests that generated nothing (a window does not tell them apart).
        """
        tokens_per_step_sums = _three_sums(agg.tokens_per_step)
        latency_sums = _three_sums(agg.ms_per_token)
        tokens_per_step = MetricAccumulator.from_sums(*tokens_per_step_sums)
        latency = MetricAccumulator.from_sums(*latency_sums)
        self.stats.merge(ArmAccumulator({TOKENS_PER_STEP: tokens_per_step, LATENCY_MS_PER_TOKEN: latency}))
        timed = int(agg.timed_requests)
        zero_latency = max(timed - tokens_per_step.n, 0)
        if tokens_per_step.n:
            mean_tokens_per_step = tokens_per_step.mean
        else:
            steps, generated = int(agg.verify_steps), int(agg.generated_tokens)
            mean_tokens_per_step = speculation_math.tokens_per_step(generated, steps)
        self.timed += timed
        self.tokens_per_step_sum += tokens_per_step_sums[1] + zero_latency * mean_tokens_per_step
        self.ms_per_token_sum += latency_sums[1]  # zero-latency requests add nothing here
        self.verify_steps += int(agg.verify_steps)
        if int(agg.speculated_requests) > 0:  # else no request carried per-position counts
            _add_positions(self.accepted_per_position, agg.accepted_per_position)
        self.drafted += int(agg.drafted_tokens)
        self.accepted += int(agg.accepted_tokens)
        spread = [int(v) for v in agg.spread]
        if len(spread) != 6:
            raise ValueError("an aggregate's spread holds six sums")
        self.spread_requests += spread[0]
        self.spread_drafted += spread[1]
        self.spread_accepted += spread[2]
        self.drafted_squared += spread[3]
        self.accepted_drafted += spread[4]
        self.accepted_squared += spread[5]

    def add_counts(self, drafted: int, accepted: int) -> None:
        """Fold one request's drafted and accepted tokens (all the post-promotion watch reads)."""
        self.drafted += drafted
        self.accepted += accepted
        if drafted > 0:
            self.spread_requests += 1
            self.spread_drafted += drafted
            self.spread_accepted += accepted
            self.drafted_squared += drafted * drafted
            self.accepted_drafted += accepted * drafted
            self.accepted_squared += accepted * accepted

    @property
    def hit_rate(self) -> float | None:
        return speculation_math.hit_rate(self.accepted, self.drafted)

    def hit_rate_spread(self) -> tuple[float | None, float | None]:
        """Standard error and design effect of the pooled hit rate, as
        ``policy.request_level_spread`` computes them from every request's (drafted, accepted)."""
        n, total, accepted = self.spread_requests, self.spread_drafted, self.spread_accepted
        if n < 2 or total <= 0 or not 0 < accepted < total:
            return None, None
        # total^2 * sum((a - p d)^2), with p = accepted / total, in exact integers.
        scaled = (
            self.accepted_squared * total * total
            - 2 * accepted * self.accepted_drafted * total
            + accepted * accepted * self.drafted_squared
        )
        variance = scaled / total**4 * n / (n - 1)
        p = accepted / total
        return math.sqrt(max(variance, 0.0)), variance / (p * (1 - p) / total)

    def to_state(self) -> dict[str, Any]:
        return {
            "stats": self.stats.to_state(),
            "timed": self.timed,
            "tokens_per_step_sum": self.tokens_per_step_sum,
            "ms_per_token_sum": self.ms_per_token_sum,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "verify_steps": self.verify_steps,
            "accepted_per_position": list(self.accepted_per_position),
            "spread": [
                self.spread_requests,
                self.spread_drafted,
                self.spread_accepted,
                self.drafted_squared,
                self.accepted_drafted,
                self.accepted_squared,
            ],
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> ArmTally:
        spread = [int(v) for v in state["spread"]]
        if len(spread) != 6:
            raise ValueError("an arm tally's spread holds six sums")
        return cls(
            stats=ArmAccumulator.from_state(state["stats"]),
            timed=int(state["timed"]),
            tokens_per_step_sum=float(state["tokens_per_step_sum"]),
            ms_per_token_sum=float(state["ms_per_token_sum"]),
            drafted=int(state["drafted"]),
            accepted=int(state["accepted"]),
            verify_steps=int(state["verify_steps"]),
            accepted_per_position=[int(c) for c in state["accepted_per_position"]],
            spread_requests=spread[0],
            spread_drafted=spread[1],
            spread_accepted=spread[2],
            drafted_squared=spread[3],
            accepted_drafted=spread[4],
            accepted_squared=spread[5],
        )


@dataclass
class JudgeTally:
    """Every arm's tally plus how many requests were folded (``max_requests`` caps them), and the
    same tallies split by category: ``categories[bucket][arm]``. ``category_records`` counts the
    requests in the category split (fewer than ``records`` only for a tally restored from a state
    written before categories were kept). ``records`` counts a window aggregate's requests too;
    ``aggregated_requests`` says how many of them came in aggregates."""

    arms: dict[str, ArmTally]
    records: int = 0
    categories: dict[str, dict[str, ArmTally]] = field(default_factory=dict)
    category_records: int = 0
    aggregated_requests: int = 0

    @classmethod
    def empty(cls, arm_names: Iterable[str]) -> JudgeTally:
        return cls({name: ArmTally() for name in arm_names})

    def bucket_of(self, category: str | None) -> str:
        """The bucket a record of ``category`` is folded into now."""
        key = category_key(category)
        if key in self.categories or key in (UNCATEGORISED, OTHER_CATEGORIES):
            return key
        named = sum(1 for name in self.categories if name not in (UNCATEGORISED, OTHER_CATEGORIES))
        return key if named < CATEGORY_LIMIT else OTHER_CATEGORIES

    def _category_tallies(self, category: str | None) -> dict[str, ArmTally]:
        bucket = self.bucket_of(category)
        per_arm = self.categories.get(bucket)
        if per_arm is None:
            per_arm = self.categories[bucket] = {name: ArmTally() for name in self.arms}
        return per_arm

    def fold(self, arm: str, row: Any) -> None:
        self.arms[arm].add(row)
        self._category_tallies(getattr(row, "category", None))[arm].add(row)
        self.category_records += 1
        self.records += 1

    def fold_aggregate(self, arm: str, agg: Any) -> None:
        """Fold one window aggregate of ``arm`` (its category, like a record's, picks the bucket)."""
        self.arms[arm].add_aggregate(agg)
        self._category_tallies(agg.category)[arm].add_aggregate(agg)
        requests = int(agg.requests)
        self.category_records += requests
        self.records += requests
        self.aggregated_requests += requests

    def fold_counts(self, arm: str, row: Any) -> None:
        self.arms[arm].add_counts(int(row.drafted_tokens or 0), int(row.accepted_tokens or 0))
        self.records += 1

    def copy(self) -> JudgeTally:
        return copy.deepcopy(self)

    def to_state(self) -> dict[str, Any]:
        return {
            "version": TALLY_VERSION,
            "records": self.records,
            "arms": {name: tally.to_state() for name, tally in self.arms.items()},
            "category_records": self.category_records,
            "aggregated_requests": self.aggregated_requests,
            "categories": {
                bucket: {name: tally.to_state() for name, tally in per_arm.items()}
                for bucket, per_arm in self.categories.items()
            },
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any], arm_names: Iterable[str]) -> JudgeTally:
        """Restore a stored tally; ValueError for a state this code did not write."""
        if state.get("version") not in READABLE_TALLY_VERSIONS:
            raise ValueError(f"unsupported judge state version {state.get('version')!r}")
        names = tuple(arm_names)
        try:
            arms = {name: ArmTally.from_state(state["arms"][name]) for name in names}
            stored = state.get("categories") or {}
            if not isinstance(stored, Mapping):
                raise TypeError("categories must be an object")
            categories = {
                str(bucket): {name: ArmTally.from_state(per_arm[name]) for name in names}
                for bucket, per_arm in stored.items()
            }
            return cls(
                arms,
                int(state["records"]),
                categories,
                int(state.get("category_records", 0)),
                int(state.get("aggregated_requests", 0)),  # absent from states written before
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed judge state: {exc!r}") from exc
