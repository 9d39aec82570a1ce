"""Routes for deployments (firectl semantics) and their audit history."""

from __future__ import annotations

from fastapi import APIRouter, status
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy.orm import Session

from controlplane.api import schemas
from controlplane.api.deps import (
    Admin,
    AdminDeployment,
    DeploymentIdCacheDep,
    ReadableDeployment,
    Reader,
    SessionDep,
)
from controlplane.audit.service import entry_summary, list_entries
from controlplane.db.models import Deployment
from controlplane.deployments.lookup import resource_name
from controlplane.deployments.service import (
    DeploymentChanges,
    create_deployment,
    delete_deployment,
    list_deployments,
)
from controlplane.deployments.spec import SpeculationRequest
from controlplane.loop.deployments import describe, update_deployment

router = APIRouter(prefix="/v1/accounts/{account}", tags=["deployments"])


class SpeculationFields(BaseModel):
    model_config = ConfigDict(extra="forbid")

    draft_model: str | None = Field(default=None, max_length=500)
    draft_token_count: int | None = None
    ngram_speculation_length: int | None = None
    disable_speculative_decoding: bool | None = None

    def speculation(self) -> SpeculationRequest:
        return SpeculationRequest(
            draft_model=self.draft_model,
            draft_token_count=self.draft_token_count,
            ngram_speculation_length=self.ngram_speculation_length,
            disable_speculative_decoding=self.disable_speculative_decoding,
        )


class DeploymentCreate(SpeculationFields):
    deployment_id: str | None = Field(default=None, description="name; generated when omitted")
    target_model: str = Field(min_length=1, max_length=500)
    display_name: str | None = Field(default=None, max_length=200)
    auto_realign: bool = True


class DeploymentUpdate(SpeculationFields):
    # Serving another target makes drafters trained for the old one stale (drafter_stale).
    target_model: str | None = Field(default=None, min_length=1, max_length=500)
    display_name: str | None = Field(default=None, max_length=200)
    auto_realign: bool | None = None
    trace_sample_rate: float | None = None
    trace_retention_days: int | None = None
    raw_record_sample_rate: float | None = None
    row_version: int | None = Field(default=None, description="optimistic lock: fail with 409 if it moved")


def _described(session: Session, deployment: Deployment, account: str) -> schemas.Deployment:
    return schemas.Deployment.model_validate(
        describe(session=session, deployment=deployment, account_name=account)
    )


@router.get("/deployments")
def list_(account: str, principal: Reader, session: SessionDep) -> schemas.DeploymentList:
    rows = list_deployments(session=session, account_id=principal.account_id)
    return schemas.DeploymentList(deployments=[_described(session, d, account) for d in rows])


@router.post("/deployments", status_code=status.HTTP_201_CREATED)
def create(account: str, body: DeploymentCreate, principal: Admin, session: SessionDep) -> schemas.Deployment:
    deployment = create_deployment(
        session=session,
        principal=principal,
        target_model=body.target_model,
        speculation=body.speculation(),
        name=body.deployment_id,
        display_name=body.display_name,
        auto_realign=body.auto_realign,
    )
    session.commit()
    return _described(session, deployment, account)


@router.get("/deployments/{deployment}")
def get(account: str, deployment: ReadableDeployment, session: SessionDep) -> schemas.Deployment:
    return _described(session, deployment, account)


@router.patch("/deployments/{deployment}")
def update(
    account: str, deployment: AdminDeployment, body: DeploymentUpdate, principal: Admin, session: SessionDep
) -> schemas.Deployment:
    row = update_deployment(
        session=session,
        principal=principal,
        deployment=deployment,
        changes=DeploymentChanges(
            speculation=body.speculation(),
            target_model=body.target_model,
            display_name=body.display_name,
            auto_realign=body.auto_realign,
            trace_sample_rate=body.trace_sample_rate,
            trace_retention_days=body.trace_retention_days,
            raw_record_sample_rate=body.raw_record_sample_rate,
            expected_row_version=body.row_version,
        ),
    )
    session.commit()
    return _described(session, row, account)


@router.delete("/deployments/{deployment}", status_code=status.HTTP_204_NO_CONTENT, response_model=None)
def delete(
    account: str,
    deployment: AdminDeployment,
    principal: Admin,
    session: SessionDep,
    deployment_ids: DeploymentIdCacheDep,
) -> None:
    delete_deployment(session=session, principal=principal, deployment=deployment)
    session.commit()
    deployment_ids.clear()


@router.get("/audit")
def audit(
    account: str, principal: Reader, session: SessionDep, deployment: str | None = None, limit: int = 100
) -> schemas.AuditLog:
    prefix = resource_name(account, deployment) if deployment else None
    entries = list_entries(
        session=session,
        account_id=principal.account_id,
        resource_prefix=prefix,
        limit=max(1, min(limit, 1000)),
    )
    return schemas.AuditLog(entries=[schemas.AuditEntry.model_validate(entry_summary(e)) for e in entries])
