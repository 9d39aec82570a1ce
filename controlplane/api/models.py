"""Routes for the model registry: register, list, get, set a target's default drafter, delete.

Reading lists the account's own models and the platform's; registering, changing and deleting
touch only the account's own.
"""

from __future__ import annotations

from fastapi import APIRouter, status
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy.orm import Session

from controlplane.api import schemas
from controlplane.api.deps import Admin, Reader, SessionDep, SettingsDep
from controlplane.audit.service import record_change
from controlplane.db.models import RegisteredModel
from controlplane.models.service import (
    ModelSource,
    delete_model,
    describe_model,
    get_model,
    register_model,
    set_default_drafter,
    visible_models,
)

router = APIRouter(prefix="/v1/accounts/{account}", tags=["models"])


class ModelRegistration(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=100)
    path: str | None = Field(
        default=None, max_length=1000, description="a folder under one of the operator's model roots"
    )
    hf_id: str | None = Field(default=None, max_length=300, description="ORG/NAME or ORG/NAME@REVISION")
    drafter_for: list[str] = Field(default_factory=list, description="targets this model may draft for")
    default_for: list[str] = Field(
        default_factory=list, description="targets (among drafter_for) that get it as default drafter"
    )


class ModelChange(BaseModel):
    model_config = ConfigDict(extra="forbid")

    default_drafter: str | None = Field(description="a drafter registered for this target, or null to clear")


def _described(session: Session, model: RegisteredModel) -> schemas.RegisteredModel:
    return schemas.RegisteredModel.model_validate(describe_model(session=session, model=model))


def _resource(account: str, name: str) -> str:
    return f"accounts/{account}/models/{name}"


@router.get("/models")
def list_(account: str, principal: Reader, session: SessionDep) -> schemas.RegisteredModelList:
    rows = visible_models(session=session, account_id=principal.account_id)
    return schemas.RegisteredModelList(models=[_described(session, m) for m in rows])


@router.post("/models", status_code=status.HTTP_201_CREATED)
def register(
    account: str, body: ModelRegistration, principal: Admin, session: SessionDep, settings: SettingsDep
) -> schemas.RegisteredModel:
    model = register_model(
        session=session,
        account_id=principal.account_id,
        name=body.name,
        source=ModelSource(path=body.path, hf_id=body.hf_id),
        settings=settings,
        drafter_for=body.drafter_for,
        default_for=body.default_for,
    )
    reply = _described(session, model)
    record_change(
        session=session,
        account_id=principal.account_id,
        actor=principal.actor,
        action="model.register",
        resource=_resource(account, model.name),
        before=None,
        after=reply.model_dump(exclude={"files", "created_at"}),
    )
    session.commit()
    return reply


@router.get("/models/{name}")
def get(account: str, name: str, principal: Reader, session: SessionDep) -> schemas.RegisteredModel:
    return _described(session, get_model(session=session, account_id=principal.account_id, name=name))


@router.patch("/models/{name}")
def change(
    account: str, name: str, body: ModelChange, principal: Admin, session: SessionDep
) -> schemas.RegisteredModel:
    before = _described(session, get_model(session=session, account_id=principal.account_id, name=name))
    model = set_default_drafter(
        session=session, account_id=principal.account_id, target_name=name, drafter_name=body.default_drafter
    )
    record_change(
        session=session,
        account_id=principal.account_id,
        actor=principal.actor,
        action="model.default_drafter",
        resource=_resource(account, name),
        before={"default_drafter": before.default_drafter},
        after={"default_drafter": body.default_drafter},
    )
    session.commit()
    return _described(session, model)


@router.delete("/models/{name}", status_code=status.HTTP_204_NO_CONTENT, response_model=None)
def delete(account: str, name: str, principal: Admin, session: SessionDep) -> None:
    delete_model(session=session, account_id=principal.account_id, name=name)
    record_change(
        session=session,
        account_id=principal.account_id,
        actor=principal.actor,
        action="model.delete",
        resource=_resource(account, name),
        before={"name": name},
        after=None,
    )
    session.commit()
