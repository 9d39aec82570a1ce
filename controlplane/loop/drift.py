"""A drift event's answer: the drift monitors detect and record an event, and the loop responds in
the same transaction with a realignment (``jobs.service.realign_on_drift``: queued when the
deployment realigns on drift, the event then ``realigning``). The monitors' entry points with that
response wired in, for the Celery tasks and the benchmarks, and the drift status the API shows,
with what the jobs service says of a guardrail fallback.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy.orm import Session

from controlplane.config import Settings
from controlplane.db.models import Deployment, DriftEvent
from controlplane.drift import aggregate_monitor
from controlplane.drift import policy as drift_policy
from controlplane.drift import service as drift_service
from controlplane.jobs.service import guardrail_recovery_status, realign_on_drift


def respond_to_drift(session: Session, deployment: Deployment, event: DriftEvent) -> int | None:
    """Queue a realignment for a new drift event when the deployment wants one; returns the id of
    the job created for it (None when none was created: no automatic realignment, or the event
    joined one already queued or running)."""
    realign = realign_on_drift(session=session, deployment=deployment, event=event)
    return realign.job.id if realign is not None and realign.created else None


def advance_monitor(
    *,
    session: Session,
    deployment_id: int,
    settings: Settings,
    batch_limit: int = drift_service.DEFAULT_BATCH_LIMIT,
) -> drift_service.MonitorOutcome:
    """The per-request drift monitor over the deployment's new records, answering its events."""
    return drift_service.advance_monitor(
        session=session,
        deployment_id=deployment_id,
        settings=settings,
        respond=respond_to_drift,
        batch_limit=batch_limit,
    )


def monitor_aggregates(
    *,
    session: Session,
    settings: Settings,
    shard: int = 0,
    shards: int = 1,
    cache: aggregate_monitor.DetectorCache | None = None,
    now: datetime | None = None,
    settle_s: float = aggregate_monitor.DEFAULT_SETTLE_S,
    calibration_budget_s: float = aggregate_monitor.DEFAULT_CALIBRATION_BUDGET_S,
) -> aggregate_monitor.AggregatePass:
    """One pass of the drift monitor over a shard's edge aggregates, answering its events."""
    return aggregate_monitor.monitor_aggregates(
        session=session,
        settings=settings,
        respond=respond_to_drift,
        shard=shard,
        shards=shards,
        cache=cache,
        now=now,
        settle_s=settle_s,
        calibration_budget_s=calibration_budget_s,
    )


def raise_drift_event(
    *,
    session: Session,
    deployment: Deployment,
    detectors: drift_service.DetectorPair,
    policy: drift_policy.DriftPolicy,
    active_version: int | None,
    examined: int,
    last_record_id: int | None,
    now: datetime,
) -> tuple[int, int | None]:
    """Record an alarm as a drift event and answer it; returns (event id, new job id or None)."""
    return drift_service.raise_drift_event(
        session=session,
        deployment=deployment,
        detectors=detectors,
        policy=policy,
        active_version=active_version,
        examined=examined,
        last_record_id=last_record_id,
        now=now,
        respond=respond_to_drift,
    )


def monitor_status(*, session: Session, deployment: Deployment, settings: Settings) -> dict[str, Any]:
    """The drift monitor's status, with the realignment a guardrail fallback has queued."""
    return drift_service.monitor_status(
        session=session,
        deployment=deployment,
        settings=settings,
        guardrail_recovery=guardrail_recovery_status(session=session, deployment=deployment),
    )
