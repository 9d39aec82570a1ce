"""A deployment's adaptation policy and the pure rules that act on it.

``AdaptationPolicy`` validates ``Deployment.adaptation_policy``: the standing no-speculation share,
the "does speculation pay" test's level and sample size, a first drafter for a deployment that has
none, continuous realignment (every so many new traces or minutes) and the daily GPU budget of the
automatic realignments. The trigger rules (``choose_trigger``) and the GPU budget arithmetic
(``gpu_seconds_used``) are pure functions over plain values: the service
(``controlplane.adaptation.service``) reads the database and feeds them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, fields
from datetime import datetime, timedelta
from typing import Any, ClassVar

DAY = timedelta(days=1)
MAX_BASELINE_SHARE = 0.5
MAX_PAYS_ALPHA = 0.2
MAX_GPU_SECONDS_PER_DAY = 86_400.0 * 64  # a day of a 64-GPU node: anything above is a typo
MAX_EVERY_MINUTES = 30 * 24 * 60.0

# Trigger names, as ``Job.trigger`` records them (controlplane.jobs.service.TRIGGERS).
FIRST_DRAFTER = "first_drafter"
CONTINUOUS = "continuous"


class AdaptationPolicyError(ValueError):
    """An adaptation policy with unknown or out-of-range fields; ``problems`` names each one as
    ``{"field": ..., "message": ...}``."""

    def __init__(self, problems: list[dict[str, str]]) -> None:
        super().__init__("; ".join(f"{p['field']}: {p['message']}" for p in problems))
        self.problems = problems


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _is_whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# field -> (check, message when it fails)
_RULES: dict[str, tuple[Any, str]] = {
    "standing_baseline_share": (
        lambda v: _is_number(v) and 0 <= v <= MAX_BASELINE_SHARE,
        f"must be a share in [0, {MAX_BASELINE_SHARE}] (0: no standing no-speculation arm)",
    ),
    "pays_alpha": (
        lambda v: _is_number(v) and 0 < v <= MAX_PAYS_ALPHA,
        f"must be in (0, {MAX_PAYS_ALPHA}]",
    ),
    "pays_min_requests_per_arm": (
        lambda v: _is_whole(v) and 5 <= v <= 1_000_000,
        "must be an integer in [5, 1000000]",
    ),
    "continuous": (lambda v: isinstance(v, bool), "must be true or false"),
    "continuous_every_traces": (
        lambda v: _is_whole(v) and 10 <= v <= 10_000_000,
        "must be an integer in [10, 10000000]",
    ),
    "continuous_every_minutes": (
        lambda v: _is_number(v) and (v == 0 or 1 <= v <= MAX_EVERY_MINUTES),
        f"must be 0 (off) or a number of minutes in [1, {MAX_EVERY_MINUTES:g}]",
    ),
    "gpu_seconds_per_day": (
        lambda v: _is_number(v) and 0 <= v <= MAX_GPU_SECONDS_PER_DAY,
        f"must be a number of seconds in [0, {MAX_GPU_SECONDS_PER_DAY:g}] (0: no automatic realignment)",
    ),
    "first_drafter": (lambda v: isinstance(v, bool), "must be true or false"),
}


@dataclass(frozen=True, slots=True)
class AdaptationPolicy:
    """How a deployment adapts its drafter by itself (every field may be stored on the deployment).

    ``standing_baseline_share``: the share of live traffic that always runs without speculation, so
    that whether speculation pays is measured all the time (0: none); ``pays_alpha`` and
    ``pays_min_requests_per_arm``: that test's level and the requests it needs per arm;
    ``first_drafter``: train a first drafter, from the target's own weights, for a deployment that
    speculates with none; ``continuous``: realign every ``continuous_every_traces`` new traces or
    every ``continuous_every_minutes`` (0: off), besides the drift trigger;
    ``gpu_seconds_per_day``: what the deployment's jobs may run in any 24 hours before an
    automatic realignment is skipped.
    """

    standing_baseline_share: float = 0.05
    pays_alpha: float = 0.05
    pays_min_requests_per_arm: int = 30
    continuous: bool = False
    continuous_every_traces: int = 2000
    continuous_every_minutes: float = 0.0
    gpu_seconds_per_day: float = 3600.0
    first_drafter: bool = True

    FIELDS: ClassVar[tuple[str, ...]] = (
        "standing_baseline_share",
        "pays_alpha",
        "pays_min_requests_per_arm",
        "continuous",
        "continuous_every_traces",
        "continuous_every_minutes",
        "gpu_seconds_per_day",
        "first_drafter",
    )

    def __post_init__(self) -> None:
        problems = _problems(self.as_dict())
        if problems:
            raise AdaptationPolicyError(problems)

    @classmethod
    def for_deployment(cls, stored: Mapping[str, Any] | None) -> AdaptationPolicy:
        """The policy a deployment runs under: its stored fields over the defaults. A stored value
        that no longer passes (written before a rule tightened) falls back to the default rather
        than stopping the loop; writes are validated (``validate_changes``)."""
        values = {k: v for k, v in (stored or {}).items() if k in cls.FIELDS}
        good = {k: v for k, v in values.items() if not _problems({k: v})}
        return cls(**good)

    @classmethod
    def validate_changes(cls, changes: Mapping[str, Any]) -> dict[str, Any]:
        """Check fields a caller wants to store; AdaptationPolicyError names every bad one."""
        if not isinstance(changes, Mapping):
            raise AdaptationPolicyError([{"field": "body", "message": "must be an object"}])
        problems: list[dict[str, str]] = []
        unknown = sorted(str(k)[:100] for k in changes if k not in cls.FIELDS)
        for key in unknown[:10]:
            problems.append({"field": key, "message": f"unknown field; allowed: {', '.join(cls.FIELDS)}"})
        problems += _problems({k: v for k, v in changes.items() if k in cls.FIELDS})
        if problems:
            raise AdaptationPolicyError(problems)
        # Whole numbers given as 3600 stay ints; floats are stored as given.
        return {k: changes[k] for k in cls.FIELDS if k in changes}

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _problems(values: Mapping[str, Any]) -> list[dict[str, str]]:
    problems = []
    for key, value in values.items():
        check, message = _RULES[key]
        if not check(value):
            problems.append({"field": key, "message": f"{message} (got {value!r:.60})"})
    return problems


assert {f.name for f in fields(AdaptationPolicy)} == set(AdaptationPolicy.FIELDS) == set(_RULES)


# --- the GPU budget ---------------------------------------------------------------------------


def gpu_seconds_used(runs: Iterable[tuple[datetime | None, datetime | None]], *, now: datetime) -> float:
    """Seconds of job run time inside the 24 hours before ``now``: each (started, finished) run,
    a running one (finished None) counted up to now, clipped to the window. A run never started
    costs nothing."""
    window_start = now - DAY
    total = 0.0
    for started, finished in runs:
        if started is None:
            continue
        end = min(finished or now, now)
        begin = max(started, window_start)
        if end > begin:
            total += (end - begin).total_seconds()
    return total


# --- the triggers -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DeploymentFacts:
    """What the trigger rules need to know about a deployment, read by the service."""

    auto_realign: bool
    # A drafter model serves the live arm (an active version, or a registered drafter).
    has_drafter: bool
    # A trained version served it once (promoted at some point): speculation was switched off
    # since, by a person or a rollback, so it is not day 0 any more.
    had_drafter: bool
    # A guardrail switched it to its fallback: that loop schedules its own realignments.
    in_guardrail_fallback: bool
    # Why no new job may start now (a realignment queued or running, a canary open), else None.
    busy: str | None
    # Traces since the last realignment job was created (all of them when there was none).
    new_traces: int
    # Minutes since the last realignment job was created (since the deployment was, when none).
    minutes_since_last: float
    gpu_seconds_used: float
    min_traces: int  # the realignment's minimum traces to train on (Settings.realign_min_traces)


@dataclass(frozen=True, slots=True)
class TriggerDecision:
    """The rules' answer: ``trigger`` to request now (None: nothing), ``reason`` in words, and
    ``skipped`` True when a trigger was due but the GPU budget is spent (the service records it)."""

    trigger: str | None
    reason: str
    skipped: bool = False


def choose_trigger(policy: AdaptationPolicy, facts: DeploymentFacts) -> TriggerDecision:
    """Which automatic realignment, if any, the deployment should get now.

    A deployment with no drafter, that never had a trained one serve, gets a first drafter once
    ``min_traces`` traces arrived since the last attempt; one with a drafter, under ``continuous``,
    a realignment every ``continuous_every_traces`` new traces or ``continuous_every_minutes`` (with
    at least ``min_traces`` new ones, so that there is something to learn from). Never while a job
    or canary is in flight, nor beyond the daily GPU budget.
    """
    if not facts.auto_realign:
        return TriggerDecision(None, "auto_realign is off")
    if facts.in_guardrail_fallback:
        return TriggerDecision(None, "a guardrail fallback schedules its own realignments")
    if facts.busy is not None:
        return TriggerDecision(None, facts.busy)
    trigger: str | None = None
    if not facts.has_drafter:
        if not policy.first_drafter:
            return TriggerDecision(None, "no drafter, and first_drafter is off")
        if facts.had_drafter:
            return TriggerDecision(
                None, "a trained drafter served before and speculation was switched off since: not day 0"
            )
        if facts.new_traces < facts.min_traces:
            return TriggerDecision(
                None, f"waiting for traces to train a first drafter on: {facts.new_traces}/{facts.min_traces}"
            )
        trigger, why = FIRST_DRAFTER, f"no drafter serves and {facts.new_traces} traces arrived"
    else:
        if not policy.continuous:
            return TriggerDecision(None, "continuous is off")
        if facts.new_traces >= policy.continuous_every_traces:
            trigger, why = CONTINUOUS, f"{facts.new_traces} new traces since the last realignment"
        elif (
            policy.continuous_every_minutes > 0
            and facts.minutes_since_last >= policy.continuous_every_minutes
            and facts.new_traces >= facts.min_traces
        ):
            trigger, why = (
                CONTINUOUS,
                f"{facts.minutes_since_last:.0f} min and {facts.new_traces} new traces "
                "since the last realignment",
            )
        else:
            return TriggerDecision(
                None,
                f"next continuous realignment at {policy.continuous_every_traces} new traces "
                f"(now {facts.new_traces})"
                + (
                    f" or {policy.continuous_every_minutes:g} min (now {facts.minutes_since_last:.0f})"
                    if policy.continuous_every_minutes > 0
                    else ""
                ),
            )
    if facts.gpu_seconds_used >= policy.gpu_seconds_per_day:
        return TriggerDecision(
            trigger,
            f"{trigger} realignment due ({why}) but skipped: the deployment's jobs ran "
            f"{facts.gpu_seconds_used:.0f} s in the last 24 h, at or over gpu_seconds_per_day "
            f"({policy.gpu_seconds_per_day:g} s)",
            skipped=True,
        )
    return TriggerDecision(trigger, why)
