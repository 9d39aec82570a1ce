"""An account's own settings (today: how long its acceptance data is kept), read and changed by the
account's keys only, every change audited."""

from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session

from controlplane.accounts.service import Principal
from controlplane.audit.service import record_change
from controlplane.db.models import Account
from controlplane.errors import ValidationProblem
from controlplane.ingest.partitions import MAX_RETENTION_DAYS, MIN_RETENTION_DAYS


def describe_account_settings(account: Account) -> dict[str, Any]:
    """The account's settings as the API shows them."""
    return {"account": account.name, "acceptance_retention_days": account.acceptance_retention_days}


def update_account_settings(
    *, session: Session, principal: Principal, acceptance_retention_days: int | None = None
) -> Account:
    """Change the caller's own account's settings (None keeps one); audited when anything changed."""
    days = acceptance_retention_days
    if days is not None and not MIN_RETENTION_DAYS <= days <= MAX_RETENTION_DAYS:
        raise ValidationProblem(
            f"acceptance_retention_days must be from {MIN_RETENTION_DAYS} to {MAX_RETENTION_DAYS} days",
            details=[{"field": "acceptance_retention_days", "value": days}],
        )
    account = session.get_one(Account, principal.account_id)
    before = describe_account_settings(account)
    if days is not None:
        account.acceptance_retention_days = days
    after = describe_account_settings(account)
    if after != before:
        record_change(
            session=session,
            account_id=account.id,
            actor=principal.actor,
            action="account_settings.update",
            resource=f"accounts/{account.name}",
            before=before,
            after=after,
        )
    return account
