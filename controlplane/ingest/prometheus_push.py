"""Prometheus pushes: turn vLLM spec-decode counters into records, against the last snapshot.

The previous snapshot per deployment lives in ``counter_snapshots`` and is replaced in the same
transaction as the records it produced, so a push is applied exactly once: re-pushing the same
exposition yields a zero delta and stores nothing. A deployment's first push (and a label set's
first sight) is a baseline: remembered, not counted (see controlplane.ingest.prometheus).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from controlplane.db.models import CounterSnapshotRow
from controlplane.errors import PayloadTooLargeError, ValidationProblem
from controlplane.ingest.formats import BatchTooLargeError, BatchValidationError
from controlplane.ingest.prometheus import MAX_LABEL_SETS, CounterSnapshot, counter_deltas, parse_exposition
from controlplane.ingest.service import store_records
from controlplane.timestamps import utcnow


def _locked_snapshot_row(session: Session, deployment_id: int) -> CounterSnapshotRow:
    """The deployment's snapshot row, locked; created empty (in a savepoint, so a concurrent
    first push that creates it too makes this one wait and read it instead of failing)."""
    query = (
        select(CounterSnapshotRow).where(CounterSnapshotRow.deployment_id == deployment_id).with_for_update()
    )
    row = session.scalar(query)
    if row is not None:
        return row
    try:
        with session.begin_nested():
            session.add(
                CounterSnapshotRow(
                    deployment_id=deployment_id, snapshot=CounterSnapshot().to_dict(), updated_at=utcnow()
                )
            )
    except IntegrityError:
        pass
    return session.scalars(query.execution_options(populate_existing=True)).one()


def store_prometheus_push(
    *,
    session: Session,
    deployment_id: int,
    text: str,
    scrape_id: str,
    from_serving_key: bool = False,
    max_label_sets: int = MAX_LABEL_SETS,
) -> dict[str, Any]:
    """Parse, diff against the stored snapshot, store the delta records and the new snapshot.

    ``from_serving_key``: pushed under the fleet's serving key (its records may steer a canary).
    """

    try:
        current = parse_exposition(text, max_label_sets=max_label_sets)
    except BatchTooLargeError as exc:
        raise PayloadTooLargeError(f"{exc}; nothing was stored", details=exc.as_dicts()) from exc
    except BatchValidationError as exc:
        raise ValidationProblem(
            f"not a usable vLLM spec-decode exposition: {exc}; nothing was stored", details=exc.as_dicts()
        ) from exc
    row = _locked_snapshot_row(session, deployment_id)
    try:
        previous = CounterSnapshot.from_dict(row.snapshot)
    except ValueError:
        previous = None  # a snapshot this release cannot read: every label set starts a baseline
    try:
        deltas = counter_deltas(
            previous, current, scrape_id=scrape_id, scraped_at=utcnow(), max_label_sets=max_label_sets
        )
    except BatchValidationError as exc:
        raise ValidationProblem(
            f"not a usable vLLM spec-decode exposition: {exc}; nothing was stored", details=exc.as_dicts()
        ) from exc
    for record in deltas.records:
        record.from_serving_key = from_serving_key
    result = store_records(session=session, deployment_id=deployment_id, records=deltas.records)
    row.snapshot = deltas.snapshot.to_dict()
    row.updated_at = utcnow()
    session.flush()
    return {
        **result.as_dict(),
        "label_sets": len(deltas.records),
        "baseline_label_sets": len(deltas.baselines),
    }
