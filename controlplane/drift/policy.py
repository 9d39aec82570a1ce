"""A deployment's drift policy: validated values with defaults from Settings."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from controlplane.config import Settings
from controlplane.errors import ValidationProblem

MIN_ARL0 = 100
MAX_ARL0 = 10**9
# Fewer reference requests than this estimate per-position rates too poorly to be worth arming.
MIN_REFERENCE_REQUESTS = 50
MAX_REFERENCE_REQUESTS = 100_000
MAX_COOLDOWN_S = 7 * 86400
# A body with thousands of unknown fields gets a short answer, not one line per field.
MAX_REPORTED_UNKNOWN = 10


@dataclass(frozen=True, slots=True)
class DriftPolicy:
    """ARL0: mean requests between false alarms; min_drop: smallest hit-rate drop worth an alarm
    (absolute, 0.05 = 5 points); cooldown_s: no new alarm this long after one; reference_requests:
    how many requests estimate the baseline after a start or a promotion (fewer: armed sooner,
    with a noisier baseline, which the detector's tempering pays for in delay, not false alarms)."""

    arl0_requests: int
    min_drop: float
    cooldown_s: int
    reference_requests: int = 1000

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def defaults(settings: Settings) -> DriftPolicy:
    return DriftPolicy(
        settings.drift_arl0_requests,
        settings.drift_min_drop,
        settings.drift_cooldown_s,
        settings.drift_reference_requests,
    )


def resolve(stored: dict[str, Any], settings: Settings) -> DriftPolicy:
    """The effective policy: stored overrides on top of the defaults."""
    base = defaults(settings).as_dict()
    base.update({k: v for k, v in stored.items() if k in base})
    return DriftPolicy(
        int(base["arl0_requests"]),
        float(base["min_drop"]),
        int(base["cooldown_s"]),
        int(base["reference_requests"]),
    )


def validate_changes(changes: dict[str, Any]) -> dict[str, Any]:
    """Check policy changes; every problem is reported at once."""
    problems = []
    allowed = {"arl0_requests", "min_drop", "cooldown_s", "reference_requests"}
    unknown = [key for key in changes if key not in allowed]
    for key in unknown[:MAX_REPORTED_UNKNOWN]:
        problems.append(
            {"field": str(key)[:100], "message": f"unknown policy field (allowed: {sorted(allowed)})"}
        )
    if len(unknown) > MAX_REPORTED_UNKNOWN:
        problems.append(
            {"field": "(more)", "message": f"{len(unknown) - MAX_REPORTED_UNKNOWN} more unknown fields"}
        )
    arl0 = changes.get("arl0_requests")
    if arl0 is not None and (
        isinstance(arl0, bool) or not isinstance(arl0, int) or not MIN_ARL0 <= arl0 <= MAX_ARL0
    ):
        problems.append(
            {"field": "arl0_requests", "message": f"must be an integer in [{MIN_ARL0}, {MAX_ARL0}]"}
        )
    drop = changes.get("min_drop")
    if drop is not None and (isinstance(drop, bool) or not isinstance(drop, int | float) or not 0 < drop < 1):
        problems.append({"field": "min_drop", "message": "must be a number strictly between 0 and 1"})
    cooldown = changes.get("cooldown_s")
    if cooldown is not None and (
        isinstance(cooldown, bool) or not isinstance(cooldown, int) or not 0 <= cooldown <= MAX_COOLDOWN_S
    ):
        problems.append(
            {
                "field": "cooldown_s",
                "message": f"must be an integer number of seconds in [0, {MAX_COOLDOWN_S}]",
            }
        )
    reference = changes.get("reference_requests")
    if reference is not None and (
        isinstance(reference, bool)
        or not isinstance(reference, int)
        or not MIN_REFERENCE_REQUESTS <= reference <= MAX_REFERENCE_REQUESTS
    ):
        problems.append(
            {
                "field": "reference_requests",
                "message": f"must be an integer in [{MIN_REFERENCE_REQUESTS}, {MAX_REFERENCE_REQUESTS}]",
            }
        )
    if problems:
        raise ValidationProblem("invalid drift policy", details=problems)
    return {k: v for k, v in changes.items() if v is not None}
