"""Thin Celery tasks that hand actuator events to the fleet: deliver one event (a signed webhook
POST or an operator-configured command), and the beat task that sends every delivery whose
(re)try time has come. The deliveries, their retries and their payloads are
``controlplane.fleet.actuators``'s; these tasks hold no SQL.
"""

from __future__ import annotations

from typing import Any

from controlplane import messaging
from controlplane.config import get_settings
from controlplane.db.session import TRANSIENT_DATABASE_ERRORS, get_sessionmaker, unit_of_work
from controlplane.fleet.actuators import deliver as deliver_event
from controlplane.fleet.actuators import due_deliveries
from workers.celery_app import TransientError, celery_app, project_task


@project_task(messaging.ACTUATOR_DELIVER)
def deliver(delivery_id: int) -> dict[str, Any]:
    """One attempt at one delivery, if it is still pending and due (a duplicate message is a no-op)."""
    settings = get_settings()
    try:
        return deliver_event(
            new_session=get_sessionmaker(settings.database_url), delivery_id=delivery_id, settings=settings
        )
    except TRANSIENT_DATABASE_ERRORS as exc:
        raise TransientError(str(exc)) from exc


@project_task(messaging.ACTUATOR_RESEND_DUE, ignore_result=True)
def resend_due() -> int:
    """Beat entry point: send every pending delivery that is due (new ones whose first message was
    lost or not sent, and failed attempts whose backoff has passed). Returns how many were sent."""
    settings = get_settings()
    try:
        with unit_of_work(settings.database_url) as session:
            ids = due_deliveries(session=session)
    except TRANSIENT_DATABASE_ERRORS as exc:
        raise TransientError(str(exc)) from exc
    return messaging.send_all(
        celery_app, [messaging.TaskMessage(messaging.ACTUATOR_DELIVER, (i,)) for i in ids]
    )
