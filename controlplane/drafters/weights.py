"""The routing weights of the serving config that a deployment's standing no-speculation share
implies, outside and during a live canary. Pure: no database. The share itself is a field of the
deployment's adaptation policy (:class:`controlplane.adaptation_policy.AdaptationPolicy`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from controlplane.adaptation_policy import AdaptationPolicy

# A live canary's split always leaves the incumbent at least this share (as its policy does).
MIN_INCUMBENT_WEIGHT = 0.1


def standing_share(adaptation_policy: Mapping[str, Any] | None, *, speculating: bool = True) -> float:
    """The deployment's standing no-speculation share: 0 when it does not speculate at all (its
    live arm already serves without speculation). A stored value out of range reads as the
    default: serving never breaks on a policy written before a rule tightened."""
    if not speculating:
        return 0.0
    return AdaptationPolicy.for_deployment(adaptation_policy).standing_baseline_share


def standing_weights(share: float) -> dict[str, float]:
    """Outside a canary: the live arm's and the baseline arm's weights (no baseline at share 0).

    >>> standing_weights(0.05)
    {'live': 0.95, 'baseline': 0.05}
    >>> standing_weights(0.0)
    {'live': 1.0}
    """
    if share <= 0:
        return {"live": 1.0}
    return {"live": round(1.0 - share, 6), "baseline": round(share, 6)}


def canary_weights(candidate: float, baseline: float, share: float) -> dict[str, float]:
    """During a live canary: the baseline arm serves the larger of the canary's share and the
    standing share, taken from the live arm, which keeps at least ``MIN_INCUMBENT_WEIGHT``.

    >>> canary_weights(0.1, 0.1, 0.05)
    {'live': 0.8, 'candidate': 0.1, 'baseline': 0.1}
    >>> canary_weights(0.1, 0.1, 0.3)
    {'live': 0.6, 'candidate': 0.1, 'baseline': 0.3}
    """
    widened = max(baseline, min(share, 1.0 - MIN_INCUMBENT_WEIGHT - candidate))
    return {
        "live": round(1.0 - candidate - widened, 6),
        "candidate": candidate,
        "baseline": round(widened, 6),
    }
