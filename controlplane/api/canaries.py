"""Routes for drafter versions, canaries, promotion and rollback, the canary policy, the draft-length
tuning table, and the serving config the serving fleet reads.

Promote, reject and rollback are admin-only and audited; every decision the automation takes is
visible here with the figures behind it (``GET .../canaries/{id}``).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request, status
from pydantic import BaseModel, ConfigDict, Field

from controlplane.api.deps import Admin, Reader, ServingReader, SessionDep, SettingsDep
from controlplane.audit.service import record_change
from controlplane.canary.queue import CanaryQueue, CeleryCanaryQueue
from controlplane.canary.service import (
    ReferenceModels,
    canary_policy,
    canary_summary,
    get_canary,
    get_version,
    list_canaries,
    list_versions,
    promote,
    reject,
    rollback,
    serving_config,
    start_canary,
    validate_canary_policy,
    version_summary,
)
from controlplane.canary.tuning_view import draft_length_table
from controlplane.db.models import DrafterVersion
from controlplane.deployments.service import get_deployment, resource_name

router = APIRouter(prefix="/v1/accounts/{account}/deployments/{deployment}", tags=["canary"])


async def get_canary_queue(request: Request, settings: SettingsDep) -> CanaryQueue:
    """The app's canary queue, made on first use (a seam, so tests can record sends instead)."""
    queue: CanaryQueue | None = getattr(request.app.state, "canary_queue", None)
    if queue is None:
        queue = CeleryCanaryQueue(settings.broker_url)
        request.app.state.canary_queue = queue
    return queue


CanaryQueueDep = Annotated[CanaryQueue, Depends(get_canary_queue)]


class Reason(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reason: str = Field(default="by hand", max_length=500)


class PolicyChange(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown fields get a clear 422 from the service


@router.get("/serving-config")
def serving(
    account: str, deployment: str, principal: ServingReader, session: SessionDep, settings: SettingsDep
) -> dict[str, Any]:
    target = get_deployment(session=session, account_id=principal.account_id, name=deployment)
    return serving_config(
        session=session, deployment=target, models=ReferenceModels(settings.reference_models_dir)
    )


@router.get("/drafter-versions")
def versions(account: str, deployment: str, principal: Reader, session: SessionDep) -> dict[str, Any]:
    target = get_deployment(session=session, account_id=principal.account_id, name=deployment)
    return {
        "drafter_versions": [
            version_summary(v) for v in list_versions(session=session, deployment_id=target.id)
        ]
    }


@router.get("/drafter-versions/{version}")
def version_get(
    account: str, deployment: str, version: int, principal: Reader, session: SessionDep
) -> dict[str, Any]:
    target = get_deployment(session=session, account_id=principal.account_id, name=deployment)
    return version_summary(get_version(session=session, deployment_id=target.id, version=version))


@router.post("/drafter-versions/{version}:promote")
def version_promote(
    account: str,
    deployment: str,
    version: int,
    principal: Admin,
    session: SessionDep,
    body: Reason | None = None,
) -> dict[str, Any]:
    target = get_deployment(session=session, account_id=principal.account_id, name=deployment)
    row = promote(
        session=session,
        deployment_id=target.id,
        version_number=version,
        actor=principal.actor,
        reason=f"promoted by hand: {(body or Reason()).reason}",
    )
    session.commit()
    return version_summary(row)


@router.post("/drafter-versions/{version}:canary", status_code=status.HTTP_202_ACCEPTED)
def version_canary(
    account: str,
    deployment: str,
    version: int,
    principal: Admin,
    session: SessionDep,
    queue: CanaryQueueDep,
    body: Reason | None = None,
) -> dict[str, Any]:
    """Start a canary for a candidate by hand (the automation does this after each realignment)."""
    target = get_deployment(session=session, account_id=principal.account_id, name=deployment)
    row = get_version(session=session, deployment_id=target.id, version=version)
    canary, job = start_canary(
        session=session, version=row, actor=principal.actor, reason=(body or Reason()).reason
    )
    session.commit()
    queue.enqueue_shadow_replay(job.id)
    return canary_summary(session, canary)


@router.post(":rollback")
def rollback_(
    account: str, deployment: str, principal: Admin, session: SessionDep, body: Reason | None = None
) -> dict[str, Any]:
    target = get_deployment(session=session, account_id=principal.account_id, name=deployment)
    restored = rollback(
        session=session, deployment_id=target.id, actor=principal.actor, reason=(body or Reason()).reason
    )
    session.commit()
    return {
        "active_version": restored.version if restored else None,
        "draft_token_count": target.draft_token_count,
        "speculation_mode": target.speculation_mode.value,
    }


@router.get("/canaries")
def canaries(
    account: str, deployment: str, principal: Reader, session: SessionDep, limit: int = 50
) -> dict[str, Any]:
    target = get_deployment(session=session, account_id=principal.account_id, name=deployment)
    rows = list_canaries(session=session, deployment_id=target.id, limit=max(1, min(limit, 500)))
    return {"canaries": [canary_summary(session, c) for c in rows]}


@router.get("/canaries/{canary_id}")
def canary_get(
    account: str, deployment: str, canary_id: int, principal: Reader, session: SessionDep
) -> dict[str, Any]:
    target = get_deployment(session=session, account_id=principal.account_id, name=deployment)
    return canary_summary(session, get_canary(session=session, deployment_id=target.id, canary_id=canary_id))


@router.post("/canaries/{canary_id}:promote")
def canary_promote(
    account: str,
    deployment: str,
    canary_id: int,
    principal: Admin,
    session: SessionDep,
    body: Reason | None = None,
) -> dict[str, Any]:
    target = get_deployment(session=session, account_id=principal.account_id, name=deployment)
    canary = get_canary(session=session, deployment_id=target.id, canary_id=canary_id)
    candidate = session.get_one(DrafterVersion, canary.candidate_version_id)
    promote(
        session=session,
        deployment_id=target.id,
        version_number=candidate.version,
        actor=principal.actor,
        reason=f"promoted by hand: {(body or Reason()).reason}",
        canary=canary,
    )
    session.commit()
    return canary_summary(session, canary)


@router.post("/canaries/{canary_id}:reject")
def canary_reject(
    account: str,
    deployment: str,
    canary_id: int,
    principal: Admin,
    session: SessionDep,
    body: Reason | None = None,
) -> dict[str, Any]:
    target = get_deployment(session=session, account_id=principal.account_id, name=deployment)
    canary = get_canary(session=session, deployment_id=target.id, canary_id=canary_id)
    reject(
        session=session,
        canary=canary,
        actor=principal.actor,
        reason=f"rejected by hand: {(body or Reason()).reason}",
    )
    session.commit()
    return canary_summary(session, canary)


@router.get("/canary-policy")
def policy_get(
    account: str, deployment: str, principal: Reader, session: SessionDep, settings: SettingsDep
) -> dict[str, Any]:
    target = get_deployment(session=session, account_id=principal.account_id, name=deployment)
    return canary_policy(target, alpha=settings.canary_alpha, min_samples=settings.canary_min_samples_per_arm)


@router.patch("/canary-policy")
def policy_patch(
    account: str,
    deployment: str,
    body: PolicyChange,
    principal: Admin,
    session: SessionDep,
    settings: SettingsDep,
) -> dict[str, Any]:
    target = get_deployment(session=session, account_id=principal.account_id, name=deployment)
    changes = validate_canary_policy(body.model_dump())
    before = dict(target.canary_policy or {})
    target.canary_policy = {**before, **changes}
    target.row_version += 1
    record_change(
        session=session,
        account_id=principal.account_id,
        actor=principal.actor,
        action="canary_policy.update",
        resource=resource_name(account, target.name),
        before=before,
        after=dict(target.canary_policy),
    )
    session.commit()
    return canary_policy(target, alpha=settings.canary_alpha, min_samples=settings.canary_min_samples_per_arm)


@router.get("/draft-length")
def draft_length(account: str, deployment: str, principal: Reader, session: SessionDep) -> dict[str, Any]:
    """Expected speed-up for each k from the live per-position acceptance, and the best k."""
    target = get_deployment(session=session, account_id=principal.account_id, name=deployment)
    return draft_length_table(session=session, deployment=target)
