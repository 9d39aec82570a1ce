"""A deployment as the API shows it, with its drafter's standing, and a person's change to a
deployment with what follows in the other lifecycles: a chosen speculation mode ends a guardrail
fallback (its pending realignments are cancelled), and a new target marks the drafter versions
trained for the old one stale.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session
from sqlalchemy.orm.exc import StaleDataError

from controlplane.accounts.service import Principal
from controlplane.audit.service import record_change
from controlplane.db.models import Deployment
from controlplane.deployments.lookup import resource_name
from controlplane.deployments.service import DeploymentChanges, apply_speculation, audit_view
from controlplane.deployments.spec import (
    SpeculationConfigError,
    SpeculationRequest,
    resolve_update,
    speculation_of,
)
from controlplane.drafters.service import (
    active_drafter,
    drafter_staleness,
    record_target_of_untagged,
    stale_versions,
)
from controlplane.errors import ConflictError, ValidationProblem
from controlplane.jobs.service import end_guardrail_fallback
from controlplane.models.service import drafter_choice, validate_deployment_models
from controlplane.traces.formats import MAX_TRACE_RETENTION_DAYS


def describe(*, session: Session, deployment: Deployment, account_name: str) -> dict[str, Any]:
    """The deployment as the API shows it."""
    config = speculation_of(deployment)
    active = active_drafter(session=session, deployment_id=deployment.id)
    stale_reason = drafter_staleness(deployment, active) if active is not None else None
    choice = drafter_choice(session=session, deployment=deployment)
    return {
        "name": resource_name(account_name, deployment.name),
        "deployment_id": deployment.name,
        "display_name": deployment.display_name,
        "target_model": deployment.target_model,
        "speculation_mode": config.mode.value,
        "draft_model": config.draft_model,
        "draft_token_count": config.draft_token_count,
        "effective_draft_token_count": config.effective_draft_token_count,
        "ngram_speculation_length": config.ngram_speculation_length,
        # Set by the draft-stop tuner at a promotion (controlplane.tuning.draft_stop); None: off.
        "draft_confidence_threshold": deployment.draft_confidence_threshold,
        "active_drafter_version": active.version if active else None,
        # The registered drafter used when no trained version is active, and where it comes from.
        "registered_drafter": choice.model.name if choice.model is not None else None,
        "registered_drafter_source": choice.source,
        "speculation_note": choice.note,
        # The active drafter was trained for another target than the one now served.
        "drafter_stale": stale_reason is not None,
        "drafter_stale_reason": stale_reason,
        "auto_realign": deployment.auto_realign,
        "drift_policy": deployment.drift_policy,
        "trace_sample_rate": deployment.trace_sample_rate,
        "trace_retention_days": deployment.trace_retention_days,
        "raw_record_sample_rate": deployment.raw_record_sample_rate,
        "row_version": deployment.row_version,
        "created_at": deployment.created_at.isoformat(),
        "updated_at": deployment.updated_at.isoformat(),
    }


def update_deployment(
    *, session: Session, principal: Principal, deployment: Deployment, changes: DeploymentChanges
) -> Deployment:
    """Change speculation settings or options; optimistic locking via ``expected_row_version``."""
    name = deployment.name
    if changes.expected_row_version is not None and changes.expected_row_version != deployment.row_version:
        raise ConflictError(
            f"deployment {name!r} changed since row_version {changes.expected_row_version} "
            f"(now {deployment.row_version}); re-read it and retry"
        )
    before = audit_view(deployment)
    try:
        config = resolve_update(speculation_of(deployment), changes.speculation)
    except SpeculationConfigError as exc:
        raise ValidationProblem(str(exc)) from exc
    apply_speculation(deployment, config)
    old_target = deployment.target_model
    if changes.target_model is not None:
        if not changes.target_model.strip():
            raise ValidationProblem("target_model must not be empty")
        deployment.target_model = changes.target_model
    if (deployment.target_model, deployment.draft_model) != (old_target, before["draft_model"]):
        validate_deployment_models(
            session=session,
            account_id=deployment.account_id,
            target_model=deployment.target_model,
            draft_model=deployment.draft_model,
        )
    if changes.display_name is not None:
        deployment.display_name = changes.display_name
    if changes.auto_realign is not None:
        deployment.auto_realign = changes.auto_realign
    if changes.trace_sample_rate is not None:
        if not 0.0 <= changes.trace_sample_rate <= 1.0:
            raise ValidationProblem("trace_sample_rate must be between 0 and 1")
        deployment.trace_sample_rate = changes.trace_sample_rate
    if changes.raw_record_sample_rate is not None:
        if not 0.0 <= changes.raw_record_sample_rate <= 1.0:
            raise ValidationProblem("raw_record_sample_rate must be between 0 and 1")
        deployment.raw_record_sample_rate = changes.raw_record_sample_rate
    if changes.trace_retention_days is not None:
        if not 1 <= changes.trace_retention_days <= MAX_TRACE_RETENTION_DAYS:
            raise ValidationProblem(
                f"trace_retention_days must be between 1 and {MAX_TRACE_RETENTION_DAYS} (ten years)"
            )
        deployment.trace_retention_days = changes.trace_retention_days
    if _chooses_speculation(changes.speculation) or changes.auto_realign is False:
        # A person's choice replaces the guardrail's: its pending realignment is cancelled.
        end_guardrail_fallback(
            session=session,
            deployment=deployment,
            actor=principal.actor,
            reason=f"speculation settings chosen by {principal.actor}",
        )
    after = audit_view(deployment)
    if after == before:
        return deployment
    try:
        session.flush()
    except StaleDataError as exc:
        raise ConflictError(f"deployment {name!r} was changed concurrently; re-read it and retry") from exc
    record_change(
        session=session,
        account_id=principal.account_id,
        actor=principal.actor,
        action="deployment.update",
        resource=resource_name(principal.account_name, name),
        before=before,
        after=after,
    )
    if deployment.target_model != old_target:
        _flag_stale_drafters(
            session=session, principal=principal, deployment=deployment, old_target=old_target
        )
    return deployment


def _chooses_speculation(request: SpeculationRequest) -> bool:
    """The caller named a speculation mode (a drafter, n-gram, or none), not only k."""
    return (
        request.draft_model is not None
        or request.ngram_speculation_length is not None
        or request.disable_speculative_decoding is not None
    )


def _flag_stale_drafters(
    *, session: Session, principal: Principal, deployment: Deployment, old_target: str
) -> None:
    """The target changed: versions trained for the old one are stale from now on (audited).

    Staleness is derived from each version's recorded target, so a change back to the old target
    makes them current again; a version with no recorded target is given the old one here.
    """
    record_target_of_untagged(session=session, deployment_id=deployment.id, target_model=old_target)
    stale = stale_versions(session=session, deployment=deployment)
    if not stale:
        return
    record_change(
        session=session,
        account_id=principal.account_id,
        actor=principal.actor,
        action="drafter.stale",
        resource=resource_name(principal.account_name, deployment.name),
        before={"target_model": old_target},
        after={
            "target_model": deployment.target_model,
            "stale_versions": [{"version": v.version, "state": v.state.value} for v in stale],
        },
    )
