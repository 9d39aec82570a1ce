"""Thin Celery tasks: open a unit of work, call a control-plane service, map errors to retries.

No statistics or training logic lives here (see controlplane.drift and workers.training).
"""

from __future__ import annotations

import logging
from typing import Any

from sqlalchemy.exc import OperationalError

from controlplane.config import get_settings
from controlplane.db.models import utcnow
from controlplane.db.session import unit_of_work
from controlplane.drift.service import advance_monitor, deployments_with_new_records
from controlplane.errors import ConflictError
from controlplane.traces.service import apply_retention
from workers.celery_app import InstrumentedTask, TransientError, celery_app

log = logging.getLogger(__name__)

SETTLE_INTERVAL_S = 2.0


@celery_app.task(name="drift.monitor_all", base=InstrumentedTask, ignore_result=True)
def monitor_all() -> list[int]:
    """Beat entry point: fan out one monitor task per deployment that has new records."""
    settings = get_settings()
    try:
        with unit_of_work(settings.database_url) as session:
            deployment_ids = deployments_with_new_records(session=session)
    except OperationalError as exc:
        raise TransientError(str(exc)) from exc
    for deployment_id in deployment_ids:
        monitor_deployment.delay(deployment_id)
    return deployment_ids


@celery_app.task(name="drift.monitor_deployment", base=InstrumentedTask)
def monitor_deployment(deployment_id: int) -> dict[str, Any]:
    """Advance one deployment's detector over its new records (exactly once, see the service)."""
    settings = get_settings()
    try:
        with unit_of_work(settings.database_url) as session:
            outcome = advance_monitor(session=session, deployment_id=deployment_id, settings=settings)
    except ConflictError:
        # Another monitor run advanced this deployment at the same time; its work stands.
        return {"deployment_id": deployment_id, "skipped": "concurrent run"}
    except OperationalError as exc:
        raise TransientError(str(exc)) from exc
    if outcome.pending:
        # Newer records settle within one interval; come back for them rather than wait for beat.
        monitor_deployment.apply_async((deployment_id,), countdown=SETTLE_INTERVAL_S)
    if outcome.events_raised:
        log.warning("drift detected on deployment %s: events %s", deployment_id, outcome.events_raised)
    return {
        "deployment_id": deployment_id,
        "records_consumed": outcome.records_consumed,
        "events_raised": outcome.events_raised,
        "skipped": outcome.skipped,
    }


@celery_app.task(name="traces.apply_retention", base=InstrumentedTask)
def apply_trace_retention() -> dict[str, int]:
    """Beat entry point: delete traces older than each deployment's retention limit."""
    settings = get_settings()
    try:
        with unit_of_work(settings.database_url) as session:
            deleted = apply_retention(session=session, now=utcnow())
    except OperationalError as exc:
        raise TransientError(str(exc)) from exc
    return {str(deployment_id): count for deployment_id, count in deleted.items()}
