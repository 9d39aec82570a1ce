"""Routes for the caller's identity, the account's API keys (admin only) and the account's own
settings (admins change them, viewers read them)."""

from __future__ import annotations

from fastapi import APIRouter, status
from pydantic import BaseModel, ConfigDict, Field

from controlplane.accounts.account_settings import describe_account_settings, update_account_settings
from controlplane.accounts.service import issue_key, key_summary, list_keys, revoke_key
from controlplane.api import schemas
from controlplane.api.deps import (
    Admin,
    CurrentPrincipal,
    PrincipalCacheDep,
    Reader,
    RowId,
    SessionDep,
    SettingsDep,
)
from controlplane.audit.service import record_change
from controlplane.db.models import Account, Role
from controlplane.ingest.partitions import MAX_RETENTION_DAYS, MIN_RETENTION_DAYS

router = APIRouter(tags=["keys"])


class KeyCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=100)
    role: Role


class AccountSettings(BaseModel):
    account: str
    acceptance_retention_days: int = Field(
        description="days raw acceptance records and edge aggregates are kept (rollups are kept)"
    )


class AccountSettingsChange(BaseModel):
    model_config = ConfigDict(extra="forbid")

    acceptance_retention_days: int | None = Field(default=None, ge=MIN_RETENTION_DAYS, le=MAX_RETENTION_DAYS)


@router.get("/v1/whoami")
def whoami(principal: CurrentPrincipal) -> schemas.Whoami:
    return schemas.Whoami(account=principal.account_name, key=principal.key_name, role=principal.role)


@router.get("/v1/accounts/{account}/api-keys")
def list_(account: str, principal: Admin, session: SessionDep) -> schemas.ApiKeyList:
    keys = list_keys(session=session, account_id=principal.account_id)
    return schemas.ApiKeyList(api_keys=[schemas.ApiKey.model_validate(key_summary(k)) for k in keys])


@router.post("/v1/accounts/{account}/api-keys", status_code=status.HTTP_201_CREATED)
def create(
    account: str, body: KeyCreate, principal: Admin, session: SessionDep, settings: SettingsDep
) -> schemas.IssuedApiKey:
    owner = session.get_one(Account, principal.account_id)
    issued = issue_key(
        session=session, account=owner, name=body.name, role=body.role, secret=settings.secret_key
    )
    record_change(
        session=session,
        account_id=principal.account_id,
        actor=principal.actor,
        action="api_key.create",
        resource=f"accounts/{account}/api-keys/{issued.key.id}",
        before=None,
        after=key_summary(issued.key),
    )
    session.commit()
    return schemas.IssuedApiKey.model_validate({**key_summary(issued.key), "key": issued.secret})


@router.delete(
    "/v1/accounts/{account}/api-keys/{key_id}", status_code=status.HTTP_204_NO_CONTENT, response_model=None
)
def revoke(
    account: str, key_id: RowId, principal: Admin, session: SessionDep, cache: PrincipalCacheDep
) -> None:
    key = revoke_key(session=session, account_id=principal.account_id, key_id=key_id)
    record_change(
        session=session,
        account_id=principal.account_id,
        actor=principal.actor,
        action="api_key.revoke",
        resource=f"accounts/{account}/api-keys/{key_id}",
        before=None,
        after=key_summary(key),
    )
    session.commit()
    cache.clear()


@router.get("/v1/accounts/{account}/settings")
def settings_get(account: str, principal: Reader, session: SessionDep) -> AccountSettings:
    owner = session.get_one(Account, principal.account_id)
    return AccountSettings.model_validate(describe_account_settings(owner))


@router.patch("/v1/accounts/{account}/settings")
def settings_patch(
    account: str, body: AccountSettingsChange, principal: Admin, session: SessionDep
) -> AccountSettings:
    owner = update_account_settings(
        session=session, principal=principal, acceptance_retention_days=body.acceptance_retention_days
    )
    session.commit()
    return AccountSettings.model_validate(describe_account_settings(owner))
