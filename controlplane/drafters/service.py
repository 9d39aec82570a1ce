"""Drafter versions: register a candidate, move it through canary, promote, reject, roll back and
retire, and the lineage and staleness reads. Nothing outside this module creates a version row
or changes its state; every state change goes through ``drafters.states``.

Each write runs in the caller's transaction with the deployment row locked
(``deployments.lookup.lock_deployment``), and the partial unique index on ``drafter_versions``
keeps exactly one active version per deployment whatever happens.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from controlplane.audit.service import record_change
from controlplane.db.models import Deployment, DrafterState, DrafterVersion, SpeculationMode
from controlplane.deployments.lookup import resource_of
from controlplane.deployments.spec import DEFAULT_DRAFT_TOKEN_COUNT, speculation_of
from controlplane.drafters import states
from controlplane.errors import ConflictError, NotFoundError
from controlplane.models.location import drafter_kind_of
from controlplane.timestamps import utcnow

# --- reads ----------------------------------------------------------------------------------


def active_drafter(*, session: Session, deployment_id: int) -> DrafterVersion | None:
    return session.scalar(
        select(DrafterVersion).where(
            DrafterVersion.deployment_id == deployment_id, DrafterVersion.state == DrafterState.active
        )
    )


def get_version(*, session: Session, deployment_id: int, version: int) -> DrafterVersion:
    row = session.scalar(
        select(DrafterVersion).where(
            DrafterVersion.deployment_id == deployment_id, DrafterVersion.version == version
        )
    )
    if row is None:
        raise NotFoundError(f"drafter version {version} not found")
    return row


def list_versions(*, session: Session, deployment_id: int) -> list[DrafterVersion]:
    return list(
        session.scalars(
            select(DrafterVersion)
            .where(DrafterVersion.deployment_id == deployment_id)
            .order_by(DrafterVersion.version.desc())
        )
    )


def version_of_job(*, session: Session, job_id: int) -> DrafterVersion | None:
    """The version a realign job registered, if it got that far (at most one per job)."""
    return session.scalar(select(DrafterVersion).where(DrafterVersion.training_job_id == job_id))


def version_resource(session: Session, version: DrafterVersion) -> str:
    deployment = session.get_one(Deployment, version.deployment_id)
    return f"{resource_of(session, deployment)}/drafter-versions/{version.version}"


def version_summary(version: DrafterVersion) -> dict[str, Any]:
    return {
        "version": version.version,
        "drafter_kind": drafter_kind_of(version),
        "state": version.state.value,
        "parent_version_id": version.parent_version_id,
        "training_job_id": version.training_job_id,
        "artifact_uri": version.artifact_path,
        "artifact_sha256": version.artifact_sha256,
        "manifest_sha256": version.manifest_sha256,
        "traffic_window_start": version.traffic_window_start.isoformat()
        if version.traffic_window_start
        else None,
        "traffic_window_end": version.traffic_window_end.isoformat() if version.traffic_window_end else None,
        "training_metrics": version.training_metrics,
        "eval_metrics": version.eval_metrics,
        "created_at": version.created_at.isoformat(),
        "activated_at": version.activated_at.isoformat() if version.activated_at else None,
    }


def drafter_staleness(deployment: Deployment, version: DrafterVersion) -> str | None:
    """Why ``version`` is stale for the deployment's current target, or None when it is not.

    A version records the target it was distilled from (``target_model``); once the deployment
    serves another target, the drafter's acceptance no longer says anything about the new one.
    A version without a recorded target is not judged.
    """
    if version.target_model is None or version.target_model == deployment.target_model:
        return None
    return (
        f"drafter version {version.version} was trained for target {version.target_model!r}; "
        f"the deployment now serves {deployment.target_model!r}"
    )


def stale_versions(*, session: Session, deployment: Deployment) -> list[DrafterVersion]:
    """The deployment's live versions (candidate, canary, active) trained for another target."""
    rows = session.scalars(
        select(DrafterVersion)
        .where(DrafterVersion.deployment_id == deployment.id, DrafterVersion.state.in_(states.LIVE))
        .order_by(DrafterVersion.version)
    )
    return [v for v in rows if drafter_staleness(deployment, v) is not None]


def record_target_of_untagged(*, session: Session, deployment_id: int, target_model: str) -> None:
    """Give versions with no recorded target the one they were trained for (the deployment's target
    before it changed), so that staleness can be judged from now on."""
    untagged = session.scalars(
        select(DrafterVersion).where(
            DrafterVersion.deployment_id == deployment_id, DrafterVersion.target_model.is_(None)
        )
    )
    for version in untagged:
        version.target_model = target_model
    session.flush()


# --- writes ---------------------------------------------------------------------------------


def _move(version: DrafterVersion, new: DrafterState) -> None:
    version.state = states.transition(version.state, new)


@dataclass(frozen=True, slots=True)
class TrainedDrafter:
    """What a realign job produced, to register as a candidate."""

    deployment_id: int
    training_job_id: int
    parent_version_id: int | None
    target_model: str
    artifact_path: str
    artifact_sha256: str
    manifest_sha256: str | None
    traffic_window_start: datetime | None
    traffic_window_end: datetime | None
    training_metrics: dict[str, Any]
    drift_event_id: int | None = None  # the alarm that started the job, for the audit trail


def register_candidate(*, session: Session, trained: TrainedDrafter, actor: str) -> DrafterVersion:
    """Register a trained drafter as the deployment's next version, a ``candidate`` (audited).

    The caller holds a lock on the training job's row and has checked that the job registered no
    version yet (``version_of_job``): never two versions for one job.
    """
    last = session.scalar(
        select(func.max(DrafterVersion.version)).where(DrafterVersion.deployment_id == trained.deployment_id)
    )
    version = DrafterVersion(
        deployment_id=trained.deployment_id,
        version=int(last or 0) + 1,
        parent_version_id=trained.parent_version_id,
        training_job_id=trained.training_job_id,
        traffic_window_start=trained.traffic_window_start,
        traffic_window_end=trained.traffic_window_end,
        artifact_path=trained.artifact_path,
        artifact_sha256=trained.artifact_sha256,
        manifest_sha256=trained.manifest_sha256,
        target_model=trained.target_model,
        state=DrafterState.candidate,
        training_metrics=trained.training_metrics,
        eval_metrics={},
    )
    session.add(version)
    session.flush()
    deployment = session.get_one(Deployment, trained.deployment_id)
    record_change(
        session=session,
        account_id=deployment.account_id,
        actor=actor,
        action="drafter_version.candidate",
        resource=version_resource(session, version),
        before=None,
        after={
            "state": version.state.value,
            "job_id": trained.training_job_id,
            "drift_event_id": trained.drift_event_id,
            "parent_version_id": version.parent_version_id,
            "target_model": version.target_model,
            "artifact_sha256": version.artifact_sha256,
        },
    )
    return version


def enter_canary(*, session: Session, version: DrafterVersion) -> None:
    """A candidate goes into its canary; ConflictError when it is no longer a candidate."""
    session.refresh(version)
    if version.state not in states.PROMOTABLE:
        raise ConflictError(f"drafter version {version.version} is {version.state.value}, not a candidate")
    if version.state != DrafterState.canary:
        _move(version, DrafterState.canary)


def leave_canary(*, version: DrafterVersion) -> None:
    """The canary ended without a verdict on the version: it is a candidate again (a person may
    still promote it)."""
    if version.state == DrafterState.canary:
        _move(version, DrafterState.candidate)


def promote_version(
    *,
    session: Session,
    deployment: Deployment,
    version: DrafterVersion,
    actor: str,
    reason: str,
    draft_token_count: int | None = None,
    canary_id: int | None = None,
) -> dict[str, Any]:
    """Make a candidate the deployment's active drafter; returns what served before (the state a
    rollback restores). ``deployment`` is locked by the caller.

    The old active version becomes ``retired`` (kept for rollback) before the new one becomes
    ``active``: the partial unique index would refuse two actives, so a concurrent promotion that
    slipped past the row lock fails instead of leaving two.
    """
    session.refresh(version)
    if version.state not in states.PROMOTABLE:
        raise ConflictError(
            f"drafter version {version.version} is {version.state.value}; only candidates promote"
        )
    old = active_drafter(session=session, deployment_id=deployment.id)
    config = speculation_of(deployment)
    before = {
        "active_version": old.version if old else None,
        "speculation_mode": config.mode.value,
        "draft_model": deployment.draft_model,
        "draft_token_count": deployment.draft_token_count,
        "ngram_speculation_length": deployment.ngram_speculation_length,
        # Tuned for the drafter serving before: it returns with it.
        "draft_confidence_threshold": deployment.draft_confidence_threshold,
    }
    if old is not None:
        _move(old, DrafterState.retired)
        session.flush()
    _move(version, DrafterState.active)
    version.activated_at = utcnow()
    # What served before, so that a rollback (by hand or automatic) can bring it back exactly.
    version.eval_metrics = {
        **(version.eval_metrics or {}),
        "promotion": {"previous_version_id": old.id if old else None, "restore": before},
    }
    if deployment.speculation_mode in (
        SpeculationMode.ngram,
        SpeculationMode.disabled,
        SpeculationMode.default,
    ):
        # A promoted drafter is what the deployment speculates with (a guardrail may have
        # switched it to n-gram or off while no drafter paid).
        deployment.speculation_mode = SpeculationMode.draft_model
        deployment.ngram_speculation_length = None
        if deployment.draft_token_count is None:
            deployment.draft_token_count = config.effective_draft_token_count or DEFAULT_DRAFT_TOKEN_COUNT
    if draft_token_count is not None:
        deployment.draft_token_count = draft_token_count
    deployment.row_version += 1
    session.flush()
    record_change(
        session=session,
        account_id=deployment.account_id,
        actor=actor,
        action="drafter.promote",
        resource=version_resource(session, version),
        before=before,
        after={
            "active_version": version.version,
            "speculation_mode": deployment.speculation_mode.value,
            "draft_token_count": deployment.draft_token_count,
            "reason": reason,
            "canary_id": canary_id,
        },
    )
    return before


def reject_version(
    *, session: Session, version: DrafterVersion, actor: str, reason: str, canary_id: int | None = None
) -> None:
    """The version lost its canary (or a person rejected it): it never serves (audited)."""
    before = version.state
    _move(version, DrafterState.rejected)
    deployment = session.get_one(Deployment, version.deployment_id)
    record_change(
        session=session,
        account_id=deployment.account_id,
        actor=actor,
        action="drafter.reject",
        resource=version_resource(session, version),
        before={"state": before.value},
        after={"state": DrafterState.rejected.value, "reason": reason, "canary_id": canary_id},
    )


@dataclass(frozen=True, slots=True)
class RolledBack:
    """A rollback: the version taken out of service and the one serving again (None: the
    deployment's configured drafter, which has no version row)."""

    removed: DrafterVersion
    restored: DrafterVersion | None


def roll_back(*, session: Session, deployment: Deployment, actor: str, reason: str) -> RolledBack:
    """Undo the last promotion: the active version is rejected and what served before returns, with
    its k and speculation mode. ``deployment`` is locked by the caller."""
    current = active_drafter(session=session, deployment_id=deployment.id)
    if current is None:
        raise ConflictError("nothing to roll back: the deployment has no promoted drafter version")
    record = dict((current.eval_metrics or {}).get("promotion") or {})
    restore: dict[str, Any] = dict(record.get("restore") or {})
    previous: DrafterVersion | None = None
    if record.get("previous_version_id") is not None:
        previous = session.get(DrafterVersion, int(record["previous_version_id"]))
        if previous is not None and previous.state != DrafterState.retired:
            previous = None  # rejected or deleted since: the configured drafter serves instead
    _move(current, DrafterState.rejected)
    session.flush()
    if previous is not None:
        _move(previous, DrafterState.active)
        previous.activated_at = utcnow()
    if restore:
        deployment.speculation_mode = SpeculationMode(
            restore.get("speculation_mode", deployment.speculation_mode)
        )
        deployment.draft_token_count = restore.get("draft_token_count")
        deployment.draft_model = restore.get("draft_model", deployment.draft_model)
        deployment.ngram_speculation_length = restore.get("ngram_speculation_length")
        if "draft_confidence_threshold" in restore:  # promotions recorded before it was tuned lack it
            deployment.draft_confidence_threshold = restore["draft_confidence_threshold"]
    deployment.row_version += 1
    record_change(
        session=session,
        account_id=deployment.account_id,
        actor=actor,
        action="drafter.rollback",
        resource=version_resource(session, current),
        before={"active_version": current.version},
        after={
            "active_version": previous.version if previous else None,
            "draft_token_count": deployment.draft_token_count,
            "speculation_mode": deployment.speculation_mode.value,
            "reason": reason,
        },
    )
    return RolledBack(removed=current, restored=previous)
