"""Writing and reading audit rows. Every state-changing service call records one."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from controlplane.db.models import AuditEntry


def record_change(
    *,
    session: Session,
    account_id: int,
    actor: str,
    action: str,
    resource: str,
    before: dict[str, Any] | None,
    after: dict[str, Any] | None,
) -> AuditEntry:
    """Append one audit row in the caller's transaction (so it commits or rolls back with it)."""
    entry = AuditEntry(
        account_id=account_id, actor=actor, action=action, resource=resource, before=before, after=after
    )
    session.add(entry)
    return entry


def list_entries(
    *, session: Session, account_id: int, resource_prefix: str | None = None, limit: int = 100
) -> list[AuditEntry]:
    query = select(AuditEntry).where(AuditEntry.account_id == account_id)
    if resource_prefix:
        query = query.where(AuditEntry.resource.startswith(resource_prefix, autoescape=True))
    return list(session.scalars(query.order_by(AuditEntry.id.desc()).limit(limit)))


def entry_summary(entry: AuditEntry) -> dict[str, Any]:
    return {
        "id": entry.id,
        "actor": entry.actor,
        "action": entry.action,
        "resource": entry.resource,
        "before": entry.before,
        "after": entry.after,
        "created_at": entry.created_at.isoformat(),
    }
