"""Deployment services: create, list and delete, each audited, and the pieces an update is made of.
Updating a deployment also ends a guardrail fallback and marks drafters stale, so the update itself
is the loop's (``controlplane.loop.deployments``), as is the deployment's view with its drafter."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from controlplane.accounts.service import Principal, validate_name
from controlplane.audit.service import record_change
from controlplane.db.models import Deployment
from controlplane.deployments.lookup import resource_name
from controlplane.deployments.spec import (
    SpeculationConfig,
    SpeculationConfigError,
    SpeculationRequest,
    resolve_create,
)
from controlplane.errors import ConflictError, ValidationProblem
from controlplane.models.service import validate_deployment_models
from controlplane.timestamps import utcnow

DRIFT_POLICY_KEYS = {"arl0_requests", "min_drop", "cooldown_s", "reference_requests"}


@dataclass(frozen=True, slots=True)
class DeploymentChanges:
    """Fields an update may change; None means unchanged."""

    speculation: SpeculationRequest
    display_name: str | None = None
    # A new target makes every drafter trained for the old one stale (see drafter_staleness).
    target_model: str | None = None
    auto_realign: bool | None = None
    trace_sample_rate: float | None = None
    trace_retention_days: int | None = None
    raw_record_sample_rate: float | None = None
    expected_row_version: int | None = None


def apply_speculation(deployment: Deployment, config: SpeculationConfig) -> None:
    """Set the deployment's speculation fields from a resolved config."""
    deployment.speculation_mode = config.mode
    deployment.draft_model = config.draft_model
    deployment.draft_token_count = config.draft_token_count
    deployment.ngram_speculation_length = config.ngram_speculation_length


def audit_view(deployment: Deployment) -> dict[str, Any]:
    """The fields a deployment's audit entries record, before and after a change."""
    return {
        "target_model": deployment.target_model,
        "speculation_mode": deployment.speculation_mode.value,
        "draft_model": deployment.draft_model,
        "draft_token_count": deployment.draft_token_count,
        "ngram_speculation_length": deployment.ngram_speculation_length,
        "auto_realign": deployment.auto_realign,
        "display_name": deployment.display_name,
        "trace_sample_rate": deployment.trace_sample_rate,
        "trace_retention_days": deployment.trace_retention_days,
        "raw_record_sample_rate": deployment.raw_record_sample_rate,
    }


def list_deployments(*, session: Session, account_id: int) -> list[Deployment]:
    return list(
        session.scalars(
            select(Deployment)
            .where(Deployment.account_id == account_id, Deployment.deleted_at.is_(None))
            .order_by(Deployment.name)
        )
    )


def create_deployment(
    *,
    session: Session,
    principal: Principal,
    target_model: str,
    speculation: SpeculationRequest,
    name: str | None = None,
    display_name: str | None = None,
    auto_realign: bool = True,
) -> Deployment:
    """Create a deployment after validating its speculation flags."""
    if not target_model.strip():
        raise ValidationProblem("target_model must not be empty")
    name = validate_name(name, what="deployment") if name else f"dep-{secrets.token_hex(4)}"
    try:
        config = resolve_create(speculation)
    except SpeculationConfigError as exc:
        raise ValidationProblem(str(exc)) from exc
    validate_deployment_models(
        session=session,
        account_id=principal.account_id,
        target_model=target_model,
        draft_model=config.draft_model,
    )
    exists = session.scalar(
        select(Deployment.id).where(
            Deployment.account_id == principal.account_id,
            Deployment.name == name,
            Deployment.deleted_at.is_(None),
        )
    )
    if exists is not None:
        raise ConflictError(f"deployment {name!r} already exists")
    deployment = Deployment(
        account_id=principal.account_id,
        name=name,
        display_name=display_name,
        target_model=target_model,
        auto_realign=auto_realign,
        drift_policy={},
        canary_policy={},
    )
    apply_speculation(deployment, config)
    session.add(deployment)
    session.flush()
    record_change(
        session=session,
        account_id=principal.account_id,
        actor=principal.actor,
        action="deployment.create",
        resource=resource_name(principal.account_name, name),
        before=None,
        after=audit_view(deployment),
    )
    return deployment


def delete_deployment(*, session: Session, principal: Principal, deployment: Deployment) -> None:
    """Soft delete: the name becomes free, the history (records, audit) is kept."""
    name = deployment.name
    before = audit_view(deployment)
    deployment.deleted_at = utcnow()
    session.flush()
    record_change(
        session=session,
        account_id=principal.account_id,
        actor=principal.actor,
        action="deployment.delete",
        resource=resource_name(principal.account_name, name),
        before=before,
        after=None,
    )
