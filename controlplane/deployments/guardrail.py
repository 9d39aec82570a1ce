"""The guardrail fallback a deployment may stand in: the marker a guardrail leaves on the
deployment when it switches it to its fallback (n-gram or no speculation), read by every lifecycle
that must know (the drift monitor skips the records served before the switch, the realign job
trains the drafter that served before it, the adaptation and speculation checks hold off).

The marker lives in ``deployment.drift_policy[GUARDRAIL_FALLBACK]`` (the drift policy's resolver
ignores the key): when, to what, the drafter that served before, and how many candidates have lost
to the fallback since. It stands only while the deployment serves a fallback mode. Setting and
ending it, and the realignments it schedules, are the jobs service's (``controlplane.jobs.service``).
"""

from __future__ import annotations

from typing import Any

from controlplane.db.models import Deployment, SpeculationMode

FALLBACK_MODES = frozenset({SpeculationMode.ngram, SpeculationMode.disabled})
GUARDRAIL_FALLBACK = "guardrail_fallback"


def guardrail_fallback(deployment: Deployment) -> dict[str, Any] | None:
    """Why the deployment serves its fallback, when a guardrail (not a person) switched it there."""
    marker = (deployment.drift_policy or {}).get(GUARDRAIL_FALLBACK)
    if not isinstance(marker, dict) or deployment.speculation_mode not in FALLBACK_MODES:
        return None
    return marker
