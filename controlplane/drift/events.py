"""Drift events after the alarm: read them, mark one as being answered by a realignment, and end
them with a named resolution. ``end_event`` is the only function that ends an event; the
monitor (``drift.service``) re-arms the detector once no event is left unanswered.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from controlplane.audit.service import record_change
from controlplane.db.models import Deployment, DriftEvent, DriftResolution, DriftState
from controlplane.deployments.lookup import resource_of
from controlplane.drift import states
from controlplane.errors import ConflictError, NotFoundError
from controlplane.timestamps import utcnow


def list_events(*, session: Session, deployment_id: int, state: str | None, limit: int) -> list[DriftEvent]:
    query = select(DriftEvent).where(DriftEvent.deployment_id == deployment_id)
    if state is not None:
        query = query.where(DriftEvent.state == DriftState(state))
    return list(session.scalars(query.order_by(DriftEvent.id.desc()).limit(limit)))


def get_event(*, session: Session, deployment_id: int, event_id: int) -> DriftEvent:
    event = session.scalar(
        select(DriftEvent).where(DriftEvent.id == event_id, DriftEvent.deployment_id == deployment_id)
    )
    if event is None:
        raise NotFoundError(f"drift event {event_id} not found")
    return event


def unanswered_events(*, session: Session, deployment_id: int) -> list[DriftEvent]:
    """The deployment's events still open or being answered by a realignment (at most one, unless
    a person asked for more by hand)."""
    return list(
        session.scalars(
            select(DriftEvent)
            .where(DriftEvent.deployment_id == deployment_id, DriftEvent.state.in_(states.UNANSWERED))
            .order_by(DriftEvent.id)
        )
    )


def mark_realigning(*, event: DriftEvent, job_id: int) -> None:
    """A realignment job now answers the event (its evidence names the job)."""
    if event.state != DriftState.realigning:
        event.state = states.transition(event.state, DriftState.realigning)
    event.evidence = {**(event.evidence or {}), "realign_job_id": job_id}


def end_event(
    *,
    session: Session,
    event: DriftEvent,
    resolution: DriftResolution,
    actor: str = "system",
    note: str | None = None,
) -> None:
    """End an unanswered event with a named resolution (audited)."""
    before = event.state
    event.state = states.transition(event.state, states.end_state(resolution))
    event.resolution = resolution
    event.resolved_at = utcnow()
    if note:
        event.evidence = {**(event.evidence or {}), "resolution_note": note}
    deployment = session.get_one(Deployment, event.deployment_id)
    record_change(
        session=session,
        account_id=deployment.account_id,
        actor=actor,
        action="drift_event.dismiss" if resolution == DriftResolution.dismissed else "drift_event.resolve",
        resource=f"{resource_of(session, deployment)}/drift-events/{event.id}",
        before={"state": before.value},
        after={
            "state": event.state.value,
            "resolution": resolution.value,
            **({"note": note} if note else {}),
        },
    )


def end_unanswered_events(
    *, session: Session, deployment_id: int, resolution: DriftResolution, note: str | None = None
) -> list[int]:
    """End every unanswered event of the deployment (a canary decision or a failed realignment
    answered them); returns their ids."""
    events = unanswered_events(session=session, deployment_id=deployment_id)
    for event in events:
        end_event(session=session, event=event, resolution=resolution, note=note)
    return [event.id for event in events]


def end_events_of_job(
    *, session: Session, drift_event_id: int | None, resolution: DriftResolution, note: str | None = None
) -> None:
    """A realignment that answered an event ended without a candidate: end that event, so the
    detector re-arms and a drift that is still there starts a new realignment."""
    if drift_event_id is None:
        return
    event = session.get(DriftEvent, drift_event_id)
    if event is not None and event.state in states.UNANSWERED:
        end_event(session=session, event=event, resolution=resolution, note=note)


def dismiss_event(*, session: Session, deployment_id: int, event_id: int, actor: str) -> DriftEvent:
    """A person marks an event as a false alarm; the monitor may alarm again after the cooldown."""
    event = get_event(session=session, deployment_id=deployment_id, event_id=event_id)
    if event.state not in states.UNANSWERED:
        raise ConflictError(
            f"drift event {event_id} is {event.state.value}; "
            "only an open or realigning event can be dismissed"
        )
    end_event(session=session, event=event, resolution=DriftResolution.dismissed, actor=actor)
    return event


def event_summary(event: DriftEvent) -> dict[str, Any]:
    return {
        "id": event.id,
        "state": event.state.value,
        "resolution": event.resolution.value if event.resolution else None,
        "detected_at": event.detected_at.isoformat(),
        "detector": event.detector,
        "baseline_rate": event.baseline_rate,
        "current_rate": event.current_rate,
        "drop": event.drop,
        "position_most_affected": event.position_most_affected,
        "statistic": event.statistic,
        "threshold": event.threshold,
        "records_examined": event.records_examined,
        "detection_delay_estimate": event.detection_delay_estimate,
        "last_record_id": event.last_record_id,
        "evidence": event.evidence,
        "resolved_at": event.resolved_at.isoformat() if event.resolved_at else None,
    }
