"""Celery task that rolls edge aggregates up into the acceptance rollups (beat, every few seconds).

A thin adapter: which windows are claimed, how their sums become rollup rows and what one
transaction holds are ``controlplane.ingest.aggregate_rollups``'s. One run folds batches of
windows, each in a transaction of its own, until none is pending or its time is up: a backlog
drains without holding rollup rows locked against ingest for long. Runs that overlap take
different windows (the claim skips what another holds), so a slow run never double-counts.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from controlplane import messaging
from controlplane.config import get_settings
from controlplane.db.session import TRANSIENT_DATABASE_ERRORS, unit_of_work
from controlplane.ingest.aggregate_rollups import AggregateRollupFold, fold_aggregate_rollups
from workers.celery_app import TransientError, project_task

log = logging.getLogger(__name__)

# A run stops starting new transactions after this long; the next beat carries on.
ROLLUP_RUN_BUDGET_S = 20.0


@project_task(messaging.ACCEPTANCE_ROLLUP_AGGREGATES, ignore_result=True)
def rollup_edge_aggregates() -> dict[str, Any]:
    """Beat entry point: fold pending edge windows into the rollups, a batch per transaction."""
    settings = get_settings()
    started = time.monotonic()
    total = AggregateRollupFold()
    while True:
        try:
            with unit_of_work(settings.database_url) as session:
                fold = fold_aggregate_rollups(session=session)
        except TRANSIENT_DATABASE_ERRORS as exc:  # away, or a lock wait lost: the batch is undone
            raise TransientError(str(exc)) from exc
        total.add(fold)
        if not fold.windows or time.monotonic() - started >= ROLLUP_RUN_BUDGET_S:
            break
    if total.windows:
        log.info("edge aggregates rolled up: %s", total.as_dict())
    return total.as_dict()
