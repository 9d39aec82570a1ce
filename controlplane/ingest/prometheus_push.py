"""Prometheus pushes: turn vLLM spec-decode counters into records, against the last snapshot.

The previous snapshot per deployment lives in ``counter_snapshots`` and is replaced in the same
transaction as the records it produced, so a push is applied exactly once: re-pushing the same
exposition yields a zero delta and stores nothing.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from controlplane.db.models import CounterSnapshotRow
from controlplane.errors import ValidationProblem
from controlplane.ingest.formats import BatchValidationError
from controlplane.ingest.prometheus import CounterSnapshot, parse_exposition, records_from_scrapes
from controlplane.ingest.service import store_records
from controlplane.timestamps import utcnow


def store_prometheus_push(
    *, session: Session, deployment_id: int, text: str, scrape_id: str
) -> dict[str, Any]:
    """Parse, diff against the stored snapshot, store the delta records and the new snapshot."""

    try:
        current = parse_exposition(text)
        row = session.scalar(
            select(CounterSnapshotRow)
            .where(CounterSnapshotRow.deployment_id == deployment_id)
            .with_for_update()
        )
        previous = CounterSnapshot.from_dict(row.snapshot) if row is not None else None
        records = records_from_scrapes(previous, current, scrape_id=scrape_id, scraped_at=utcnow())
    except BatchValidationError as exc:
        raise ValidationProblem(
            f"not a usable vLLM spec-decode exposition: {exc}; nothing was stored", details=exc.as_dicts()
        ) from exc
    result = store_records(session=session, deployment_id=deployment_id, records=records)
    if row is None:
        session.add(
            CounterSnapshotRow(deployment_id=deployment_id, snapshot=current.to_dict(), updated_at=utcnow())
        )
    else:
        row.snapshot = current.to_dict()
        row.updated_at = utcnow()
    session.flush()
    return {**result.as_dict(), "label_sets": len(records)}
