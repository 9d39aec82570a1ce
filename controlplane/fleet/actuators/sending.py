"""Sending a delivery: claim one attempt (a transaction), send it (no transaction held, by the
kind's own ``Attempt.send``), record its outcome (a transaction). A failed attempt is retried on
``payloads.backoff``'s schedule until ``payloads.MAX_ATTEMPTS``, then the delivery is ``failed``
(an admin may retry it). The kind that claims an attempt is looked up in the registry.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy.orm import Session

from controlplane.config import Settings
from controlplane.db.models import ActuatorDelivery, Deployment
from controlplane.fleet import payloads
from controlplane.fleet.actuators.base import Attempt, Outcome
from controlplane.fleet.actuators.deliveries import STATE_DELIVERED, STATE_FAILED, STATE_PENDING
from controlplane.fleet.actuators.registry import ACTUATOR_KINDS
from controlplane.timestamps import as_utc, utcnow

# A claimed delivery is not sent again for this long beyond its own timeout: an attempt whose
# worker died is picked up by the beat once the lease runs out.
CLAIM_LEASE_MARGIN_S = 30.0


def claim_delivery(
    *, session: Session, delivery_id: int, settings: Settings, now: datetime | None = None
) -> Attempt | None:
    """Take the delivery for one attempt if it is pending and due (None otherwise): its next
    attempt moves past this one's timeout, so a concurrent relay does not send it twice."""
    now = now or utcnow()
    delivery = session.get(ActuatorDelivery, delivery_id, with_for_update=True)
    if delivery is None or delivery.state != STATE_PENDING:
        return None
    if delivery.next_attempt_at is not None and as_utc(delivery.next_attempt_at) > now:
        return None
    deployment = session.get_one(Deployment, delivery.deployment_id)
    body = payloads.encode(delivery.payload)
    attempt: Attempt | None = None
    if deployment.actuator != delivery.actuator:
        problem = f"the deployment's actuator is now {deployment.actuator}, not {delivery.actuator}"
    else:
        kind = ACTUATOR_KINDS.get(delivery.actuator)
        if kind is not None:
            attempt = kind.claim(delivery=delivery, deployment=deployment, body=body, settings=settings)
        problem = f"the {delivery.actuator} actuator is not configured (command not in actuator_commands?)"
    if attempt is None:
        delivery.state = STATE_FAILED
        delivery.last_error = problem
        delivery.next_attempt_at = None
        return None
    # The lease outlasts the longest attempt any registered kind may take.
    longest = max(each.attempt_timeout_s(settings) for each in ACTUATOR_KINDS.values())
    delivery.next_attempt_at = now + timedelta(seconds=longest + CLAIM_LEASE_MARGIN_S)
    return attempt


def perform(attempt: Attempt) -> Outcome:
    """Run one attempt (no database): the kind's own send, e.g. POST the signed body, or run the
    command with it on stdin."""
    return attempt.send()


def record_outcome(
    *, session: Session, delivery_id: int, outcome: Outcome, now: datetime | None = None
) -> str:
    """Count the attempt; delivered, retried later (backoff), or failed for good. Returns the state."""
    now = now or utcnow()
    delivery = session.get_one(ActuatorDelivery, delivery_id, with_for_update=True)
    delivery.attempts += 1
    delivery.last_status = outcome.status
    delivery.last_error = outcome.error
    if outcome.delivered:
        delivery.state = STATE_DELIVERED
        delivery.delivered_at = now
        delivery.next_attempt_at = None
        return delivery.state
    delay = payloads.backoff(delivery.attempts)
    if delay is None:
        delivery.state = STATE_FAILED
        delivery.next_attempt_at = None
    else:
        delivery.next_attempt_at = now + delay
    return delivery.state


def deliver(
    *,
    new_session: Callable[[], Session],
    delivery_id: int,
    settings: Settings,
    now: datetime | None = None,
) -> dict[str, Any]:
    """One attempt at a delivery, if it is due: claim (a transaction), send (none held), record
    (a transaction). What the ``ACTUATOR_DELIVER`` task runs."""
    with new_session() as session:
        attempt = claim_delivery(session=session, delivery_id=delivery_id, settings=settings, now=now)
        session.commit()
    if attempt is None:
        return {"delivery_id": delivery_id, "skipped": "not pending or not due"}
    outcome = perform(attempt)
    with new_session() as session:
        state = record_outcome(session=session, delivery_id=delivery_id, outcome=outcome, now=now)
        session.commit()
    return {"delivery_id": delivery_id, "state": state, "status": outcome.status}
