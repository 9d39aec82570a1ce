"""FastAPI dependencies as Annotated aliases: settings, database session, caller, access."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Header, HTTPException, Request, status
from sqlalchemy.orm import Session

from controlplane.accounts.service import Principal, authenticate
from controlplane.config import Settings
from controlplane.db.models import Role
from controlplane.db.session import get_sessionmaker


def get_app_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


SettingsDep = Annotated[Settings, Depends(get_app_settings)]


def get_session(settings: SettingsDep) -> Iterator[Session]:
    """A session per request; routes commit explicitly, anything uncommitted rolls back."""
    session = get_sessionmaker(settings.database_url)()
    try:
        yield session
    finally:
        session.rollback()
        session.close()


SessionDep = Annotated[Session, Depends(get_session)]


def _presented_key(authorization: str | None, x_api_key: str | None) -> str | None:
    if x_api_key:
        return x_api_key.strip()
    if authorization:
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
    return None


def get_principal(
    session: SessionDep,
    settings: SettingsDep,
    authorization: Annotated[str | None, Header()] = None,
    x_api_key: Annotated[str | None, Header()] = None,
) -> Principal:
    presented = _presented_key(authorization, x_api_key)
    if presented is None:
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED,
            "missing API key: send 'Authorization: Bearer <key>'",
            headers={"WWW-Authenticate": "Bearer"},
        )
    principal = authenticate(session=session, presented=presented, secret=settings.secret_key)
    if principal is None:
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED, "invalid or revoked API key", headers={"WWW-Authenticate": "Bearer"}
        )
    return principal


CurrentPrincipal = Annotated[Principal, Depends(get_principal)]

READ_ROLES = frozenset({Role.admin, Role.viewer})
WRITE_DATA_ROLES = frozenset({Role.admin, Role.ingest})
ADMIN_ROLES = frozenset({Role.admin})


def check_access(principal: Principal, account: str, allowed: frozenset[Role]) -> None:
    """Another account's resources do not exist for this caller (404); a weak role is 403."""
    if principal.account_name != account:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"account {account!r} not found")
    if principal.role not in allowed:
        needed = " or ".join(sorted(r.value for r in allowed))
        raise HTTPException(
            status.HTTP_403_FORBIDDEN, f"role {principal.role.value!r} may not do this (needs {needed})"
        )


def _access(allowed: frozenset[Role]) -> object:
    def dependency(account: str, principal: CurrentPrincipal) -> Principal:
        check_access(principal, account, allowed)
        return principal

    return Depends(dependency)


Reader = Annotated[Principal, _access(READ_ROLES)]
DataWriter = Annotated[Principal, _access(WRITE_DATA_ROLES)]
Admin = Annotated[Principal, _access(ADMIN_ROLES)]
