"""Celery task that keeps acceptance storage in shape (beat, hourly): the daily partitions of edge
aggregates ready ahead, and each account's retention applied.

A thin adapter: partitions, retention and their transactions are ``controlplane.ingest.partitions``'s.
"""

from __future__ import annotations

import logging
from typing import Any

from controlplane import messaging
from controlplane.config import get_settings
from controlplane.db.session import TRANSIENT_DATABASE_ERRORS, unit_of_work
from controlplane.ingest.partitions import apply_acceptance_retention, ensure_partitions
from controlplane.timestamps import utcnow
from workers.celery_app import TransientError, project_task

log = logging.getLogger(__name__)

# Changing partitions locks the whole table: rather than queue every insert behind a long query
# for the lock, give up after this long and retry (the partitions are made days ahead).
LOCK_TIMEOUT_S = 10.0


@project_task(messaging.ACCEPTANCE_STORAGE_MAINTAIN)
def maintain_acceptance_storage() -> dict[str, Any]:
    """Beat entry point: create missing partitions (committed at once, so the table's lock is
    short), then drop and delete what is past retention."""
    settings = get_settings()
    now = utcnow()
    try:
        with unit_of_work(settings.database_url) as session:
            created = ensure_partitions(bind=session, now=now, lock_timeout_s=LOCK_TIMEOUT_S)
        with unit_of_work(settings.database_url) as session:
            removed = apply_acceptance_retention(session=session, now=now, lock_timeout_s=LOCK_TIMEOUT_S)
    except TRANSIENT_DATABASE_ERRORS as exc:  # the database was away, or a lock wait timed out
        raise TransientError(str(exc)) from exc
    summary = {"partitions_created": created, **removed.as_dict()}
    log.info("acceptance storage maintained: %s", summary)
    return summary
