"""A drift event's answer: the drift monitors detect and record an event, and the loop responds in
the same transaction with a realignment (``jobs.service.realign_on_drift``: queued when the
deployment realigns on drift, the event then ``realigning``). The monitors' entry points with that
response wired in, for the Celery tasks and the benchmarks, and the drift status the API shows,
with what the jobs service says of a guardrail fallback.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Final

from sqlalchemy.orm import Session

from controlplane.config import Settings
from controlplane.db.models import Deployment, DriftEvent
from controlplane.drift import aggregate_monitor
from controlplane.drift import service as drift_service
from controlplane.jobs.service import guardrail_recovery_status, realign_on_drift


def respond_to_drift(session: Session, deployment: Deployment, event: DriftEvent) -> int | None:
    """Queue a realignment for a new drift event when the deployment wants one; returns the id of
    the job created for it (None when none was created: no automatic realignment, or the event
    joined one already queued or running)."""
    realign = realign_on_drift(session=session, deployment=deployment, event=event)
    return realign.job.id if realign is not None and realign.created else None


# The monitors' entry points with the loop's answer wired in; every other argument passes through.
advance_monitor: Final = partial(drift_service.advance_monitor, respond=respond_to_drift)
monitor_aggregates: Final = partial(aggregate_monitor.monitor_aggregates, respond=respond_to_drift)
raise_drift_event: Final = partial(drift_service.raise_drift_event, respond=respond_to_drift)


def monitor_status(*, session: Session, deployment: Deployment, settings: Settings) -> dict[str, Any]:
    """The drift monitor's status, with the realignment a guardrail fallback has queued."""
    return drift_service.monitor_status(
        session=session,
        deployment=deployment,
        settings=settings,
        guardrail_recovery=guardrail_recovery_status(session=session, deployment=deployment),
    )
