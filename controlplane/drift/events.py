"""Drift events after the alarm: read them, mark one as being answered by a realignment, and end
them with a named resolution and the reason. ``resolve_event`` is the only function that ends an
event, whichever lifecycle ends it (a realignment, a canary, a guardrail, a person); once no event
of the deployment is left unanswered it re-arms the deployment's detector, which may then alarm
again after the policy's cooldown (counted from the end of the event, see ``drift.service``).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from controlplane.audit.service import record_change
from controlplane.db.models import (
    Deployment,
    DriftEvent,
    DriftMonitorState,
    DriftResolution,
    DriftState,
    Job,
)
from controlplane.deployments.lookup import resource_of
from controlplane.drift import states
from controlplane.drift.mix_monitor import MixMonitor
from controlplane.drift.mixture_sr import MixtureSR
from controlplane.errors import ConflictError, NotFoundError, ValidationProblem
from controlplane.timestamps import utcnow


def list_events(*, session: Session, deployment_id: int, state: str | None, limit: int) -> list[DriftEvent]:
    query = select(DriftEvent).where(DriftEvent.deployment_id == deployment_id)
    if state is not None:
        try:
            query = query.where(DriftEvent.state == DriftState(state))
        except ValueError:
            raise ValidationProblem(
                f"unknown drift event state {state[:50]!r}; one of {[s.value for s in DriftState]}"
            ) from None
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


MAX_REASON_CHARS = 2000


def resolve_event(
    *,
    session: Session,
    event: DriftEvent,
    resolution: DriftResolution,
    reason: str | None = None,
    actor: str = "system",
) -> None:
    """End an unanswered event with a named resolution and why (audited), and re-arm the
    deployment's detector once none of its events is left unanswered."""
    before = event.state
    event.state = states.transition(event.state, states.end_state(resolution))
    event.resolution = resolution
    event.resolved_at = utcnow()
    event.resolution_reason = reason[:MAX_REASON_CHARS] if reason else None
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
            **({"reason": event.resolution_reason} if event.resolution_reason else {}),
        },
    )
    session.flush()
    if not unanswered_events(session=session, deployment_id=event.deployment_id):
        rearm_detector(session=session, deployment_id=event.deployment_id)


def rearm_detector(*, session: Session, deployment_id: int) -> bool:
    """Clear a latched alarm from the deployment's stored detectors (baseline kept); True when
    it did. A compare-and-set on the monitor's version: when a monitor run advanced the state
    meanwhile, that run's next pass clears the latch itself (it re-arms whenever it finds an alarm
    with no unanswered event), so nothing is lost by giving way."""
    state = session.get(DriftMonitorState, deployment_id)
    stored = state.detector_state if state is not None else None
    if state is None or not stored or "main" not in stored:
        return False
    main = MixtureSR.from_state(stored["main"])
    mix = MixMonitor.from_state(stored["mix"]) if "mix" in stored else None
    if not main.drift_detected and (mix is None or not mix.drift_detected):
        return False
    if main.drift_detected:
        main.reset()
    if mix is not None and mix.drift_detected:
        mix.reset()
    result = session.execute(
        update(DriftMonitorState)
        .where(DriftMonitorState.deployment_id == deployment_id, DriftMonitorState.version == state.version)
        .values(
            detector_state={**stored, "main": main.to_state(), **({"mix": mix.to_state()} if mix else {})},
            updated_at=utcnow(),
            version=state.version + 1,
        )
        .execution_options(synchronize_session=False)
    )
    session.expire(state)
    return bool(getattr(result, "rowcount", 0))


def end_unanswered_events(
    *,
    session: Session,
    deployment_id: int,
    resolution: DriftResolution,
    reason: str | None = None,
    actor: str = "system",
) -> list[int]:
    """End every unanswered event of the deployment (a canary decision or a failed realignment
    answered them); returns their ids."""
    events = unanswered_events(session=session, deployment_id=deployment_id)
    for event in events:
        resolve_event(session=session, event=event, resolution=resolution, reason=reason, actor=actor)
    return [event.id for event in events]


def end_events_of_job(
    *, session: Session, job: Job, resolution: DriftResolution, reason: str | None = None
) -> list[int]:
    """A realignment ended without a candidate: end every event it answered (the one that started
    it, and any that found it already queued or running and named it), so the detector re-arms
    and a drift that is still there starts a new realignment. Returns their ids."""
    answered = [
        event
        for event in unanswered_events(session=session, deployment_id=job.deployment_id)
        if event.id == job.drift_event_id or (event.evidence or {}).get("realign_job_id") == job.id
    ]
    for event in answered:
        resolve_event(session=session, event=event, resolution=resolution, reason=reason)
    return [event.id for event in answered]


def dismiss_event(*, session: Session, deployment_id: int, event_id: int, actor: str) -> DriftEvent:
    """A person marks an event as a false alarm; the monitor may alarm again after the cooldown."""
    event = get_event(session=session, deployment_id=deployment_id, event_id=event_id)
    if event.state not in states.UNANSWERED:
        raise ConflictError(
            f"drift event {event_id} is {event.state.value}; "
            "only an open or realigning event can be dismissed"
        )
    resolve_event(
        session=session,
        event=event,
        resolution=DriftResolution.dismissed,
        reason=f"dismissed by {actor} as a false alarm",
        actor=actor,
    )
    return event


def event_summary(event: DriftEvent) -> dict[str, Any]:
    return {
        "id": event.id,
        "state": event.state.value,
        "resolution": event.resolution.value if event.resolution else None,
        "resolution_reason": event.resolution_reason,
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
