"""Routes for drafter versions, canaries, promotion and rollback, the canary policy, the draft-length
tuning table, and the serving config the serving fleet reads.

Promote, reject and rollback are admin-only and audited; every decision the automation takes is
visible here with the figures behind it (``GET .../canaries/{id}``).
"""

from __future__ import annotations

from fastapi import APIRouter, Query, Request, Response, status
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy.orm import Session

from controlplane.api import schemas
from controlplane.api.deps import (
    Admin,
    AdminDeployment,
    ReadableDeployment,
    RowId,
    ServingDeployment,
    SessionDep,
    SettingsDep,
    WorkQueueDep,
)
from controlplane.api.fleet import ReadyCallerDep, ready_deployment, send_deliveries
from controlplane.canary.service import (
    canary_policy,
    canary_summary,
    get_canary,
    list_canaries,
    pool_ready,
    promote,
    reject,
    rollback,
    start_canary,
    update_canary_policy,
)
from controlplane.canary.tuning_view import draft_length_table
from controlplane.config import Settings
from controlplane.db.models import Canary, Deployment, DrafterVersion
from controlplane.drafters.service import get_version, list_versions, version_summary
from controlplane.drafters.serving import serving_config

router = APIRouter(prefix="/v1/accounts/{account}/deployments/{deployment}", tags=["canary"])


class Reason(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reason: str = Field(default="by hand", max_length=500)


class PolicyChange(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown fields get a clear 422 from the service


def _canary(session: Session, canary: Canary) -> schemas.Canary:
    return schemas.Canary.model_validate(canary_summary(session, canary))


def _policy(deployment: Deployment, settings: Settings) -> schemas.CanaryPolicy:
    return schemas.CanaryPolicy.model_validate(canary_policy(deployment, settings).settable())


@router.get(
    "/serving-config",
    response_model=schemas.ServingConfig,
    responses={304: {"description": "unchanged since the `If-None-Match` ETag"}},
)
def serving(account: str, deployment: ServingDeployment, session: SessionDep, request: Request) -> Response:
    """What the fleet should run now. Followers poll it conditionally: the ETag is the
    ``config_version``, and ``If-None-Match`` with it answers 304 with no body."""
    config = serving_config(session=session, deployment=deployment)
    etag = f'"{config["config_version"]}"'
    headers = {"ETag": etag, "Cache-Control": "no-cache"}
    if etag in _etags(request.headers.get("if-none-match")):
        return Response(status_code=status.HTTP_304_NOT_MODIFIED, headers=headers)
    body = schemas.ServingConfig.model_validate(config).model_dump(mode="json")
    return JSONResponse(body, headers=headers)


@router.get(
    "/serving-config/export",
    response_class=Response,
    # YAML by default; `as=json` sends the same document as JSON (a gateway's file, no schema of ours).
    responses={
        200: {
            "content": {
                "application/yaml": {"schema": {"type": "object"}},
                "application/json": {"schema": {"type": "object"}},
            }
        }
    },
)
def serving_export(
    account: str,
    deployment: ServingDeployment,
    session: SessionDep,
    format: str = "litellm",
    as_: str | None = Query(default=None, alias="as"),
    gateway: str = "gateway",
    namespace: str | None = None,
) -> Response:
    """The serving config as a gateway's own config: ``format=litellm`` (a LiteLLM router config,
    the default) or ``format=httproute`` (a Gateway API HTTPRoute; ``gateway`` names its parent
    Gateway, ``namespace`` its namespace). YAML, or JSON with ``as=json``. 409 when an arm with
    weight has no backend in its pool. See controlplane.drafters.exports."""
    import yaml

    from controlplane.drafters.exports import FORMATS, ExportError, export
    from controlplane.errors import ConflictError, ValidationProblem

    if format not in FORMATS:
        raise ValidationProblem(f"format: must be one of {', '.join(FORMATS)}, got {format!r}")
    if as_ not in (None, "yaml", "json"):
        raise ValidationProblem(f"as: must be yaml or json, got {as_!r}")
    options = {"gateway": gateway, "namespace": namespace} if format == "httproute" else {}
    try:
        doc = export(serving_config(session=session, deployment=deployment), format, **options)
    except ExportError as exc:  # the fleet as it stands cannot carry the split: say why
        raise ConflictError(f"cannot export the serving config: {exc}") from exc
    if as_ == "json":
        return JSONResponse(doc)
    return Response(yaml.safe_dump(doc, sort_keys=False), media_type="application/yaml")


def _etags(header: str | None) -> set[str]:
    """The entity tags an ``If-None-Match`` header lists (weak ones compare by their tag)."""
    if not header:
        return set()
    return {tag.strip().removeprefix("W/") for tag in header.split(",") if tag.strip()}


@router.get("/drafter-versions")
def versions(account: str, deployment: ReadableDeployment, session: SessionDep) -> schemas.DrafterVersionList:
    rows = list_versions(session=session, deployment_id=deployment.id)
    return schemas.DrafterVersionList(
        drafter_versions=[schemas.DrafterVersion.model_validate(version_summary(v)) for v in rows]
    )


@router.get("/drafter-versions/{version}")
def version_get(
    account: str, deployment: ReadableDeployment, version: RowId, session: SessionDep
) -> schemas.DrafterVersion:
    row = get_version(session=session, deployment_id=deployment.id, version=version)
    return schemas.DrafterVersion.model_validate(version_summary(row))


@router.post("/drafter-versions/{version}:promote")
def version_promote(
    account: str,
    deployment: AdminDeployment,
    version: RowId,
    principal: Admin,
    session: SessionDep,
    request: Request,
    body: Reason | None = None,
) -> schemas.DrafterVersion:
    row = promote(
        session=session,
        deployment_id=deployment.id,
        version_number=version,
        actor=principal.actor,
        reason=f"promoted by hand: {(body or Reason()).reason}",
    )
    session.commit()
    send_deliveries(request, session)
    return schemas.DrafterVersion.model_validate(version_summary(row))


@router.post("/drafter-versions/{version}:canary", status_code=status.HTTP_202_ACCEPTED)
def version_canary(
    account: str,
    deployment: AdminDeployment,
    version: RowId,
    principal: Admin,
    session: SessionDep,
    queue: WorkQueueDep,
    body: Reason | None = None,
) -> schemas.Canary:
    """Start a canary for a candidate by hand (the automation does this after each realignment)."""
    row = get_version(session=session, deployment_id=deployment.id, version=version)
    canary, job = start_canary(
        session=session, version=row, actor=principal.actor, reason=(body or Reason()).reason
    )
    session.commit()
    queue.enqueue_shadow_replay(job.id)
    return _canary(session, canary)


@router.post(":rollback")
def rollback_(
    account: str,
    deployment: AdminDeployment,
    principal: Admin,
    session: SessionDep,
    request: Request,
    body: Reason | None = None,
) -> schemas.RollbackResult:
    restored = rollback(
        session=session, deployment_id=deployment.id, actor=principal.actor, reason=(body or Reason()).reason
    )
    session.commit()
    send_deliveries(request, session)
    return schemas.RollbackResult(
        active_version=restored.version if restored else None,
        draft_token_count=deployment.draft_token_count,
        speculation_mode=deployment.speculation_mode,
    )


@router.get("/canaries")
def canaries(
    account: str, deployment: ReadableDeployment, session: SessionDep, limit: int = 50
) -> schemas.CanaryList:
    rows = list_canaries(session=session, deployment_id=deployment.id, limit=max(1, min(limit, 500)))
    return schemas.CanaryList(canaries=[_canary(session, c) for c in rows])


@router.get("/canaries/{canary_id}")
def canary_get(
    account: str, deployment: ReadableDeployment, canary_id: RowId, session: SessionDep
) -> schemas.Canary:
    return _canary(session, get_canary(session=session, deployment_id=deployment.id, canary_id=canary_id))


@router.post("/canaries/{canary_id}:promote")
def canary_promote(
    account: str,
    deployment: AdminDeployment,
    canary_id: RowId,
    principal: Admin,
    session: SessionDep,
    request: Request,
    body: Reason | None = None,
) -> schemas.Canary:
    canary = get_canary(session=session, deployment_id=deployment.id, canary_id=canary_id)
    candidate = session.get_one(DrafterVersion, canary.candidate_version_id)
    promote(
        session=session,
        deployment_id=deployment.id,
        version_number=candidate.version,
        actor=principal.actor,
        reason=f"promoted by hand: {(body or Reason()).reason}",
        canary=canary,
    )
    session.commit()
    send_deliveries(request, session)
    return _canary(session, canary)


@router.post("/canaries/{canary_id}:reject")
def canary_reject(
    account: str,
    deployment: AdminDeployment,
    canary_id: RowId,
    principal: Admin,
    session: SessionDep,
    body: Reason | None = None,
) -> schemas.Canary:
    canary = get_canary(session=session, deployment_id=deployment.id, canary_id=canary_id)
    reject(
        session=session,
        canary=canary,
        actor=principal.actor,
        reason=f"rejected by hand: {(body or Reason()).reason}",
    )
    session.commit()
    return _canary(session, canary)


@router.post("/canaries/{canary_id}/ready")
def canary_ready(
    account: str,
    deployment: str,
    canary_id: RowId,
    caller: ReadyCallerDep,
    session: SessionDep,
    settings: SettingsDep,
) -> schemas.Canary:
    """The actuator says the candidate pool has loaded the candidate: a canary waiting for its
    pool goes live now. Authorised by an admin key or by the webhook signature (see
    ``controlplane.api.fleet.ReadyCaller``); calling it again, or for a canary that is not
    waiting, changes nothing."""
    row = ready_deployment(
        session=session, settings=settings, account=account, deployment=deployment, caller=caller
    )
    canary = get_canary(session=session, deployment_id=row.id, canary_id=canary_id)
    pool_ready(
        session=session,
        canary=canary,
        policy=canary_policy(row, settings),
        by=caller.actor,
        evidence={"callback": True},
    )
    session.commit()
    return _canary(session, canary)


@router.get("/canary-policy")
def policy_get(account: str, deployment: ReadableDeployment, settings: SettingsDep) -> schemas.CanaryPolicy:
    return _policy(deployment, settings)


@router.patch("/canary-policy")
def policy_patch(
    account: str,
    deployment: AdminDeployment,
    body: PolicyChange,
    principal: Admin,
    session: SessionDep,
    settings: SettingsDep,
) -> schemas.CanaryPolicy:
    update_canary_policy(
        session=session, principal=principal, deployment=deployment, changes=body.model_dump()
    )
    session.commit()
    return _policy(deployment, settings)


# Present only with a plan: fields of the other shape are left out rather than sent as null.
@router.get("/draft-length", response_model_exclude_unset=True)
def draft_length(
    account: str, deployment: ReadableDeployment, session: SessionDep
) -> schemas.DraftLengthTable:
    """Expected speed-up for each k from the live per-position acceptance, and the best k."""
    return schemas.DraftLengthTable.model_validate(draft_length_table(session=session, deployment=deployment))
