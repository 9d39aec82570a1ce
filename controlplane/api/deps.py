"""FastAPI dependencies as Annotated aliases: settings, database session, caller, access."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Header, HTTPException, Request, status
from sqlalchemy.orm import Session

from controlplane.accounts.keys import hash_key
from controlplane.accounts.service import Principal, authenticate
from controlplane.config import Settings
from controlplane.db.models import Role
from controlplane.db.session import get_sessionmaker
from controlplane.errors import PayloadTooLargeError
from controlplane.ingest.batcher import IngestBatcher


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


class PrincipalCache:
    """Verified keys for a few seconds, so hot ingest paths skip a lookup per request.

    Keyed by the key's HMAC (never the key itself). Revoking a key through this process clears
    the cache at once; other API processes stop accepting it within ``ttl_s``.
    """

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._entries: dict[str, tuple[float, Principal]] = {}

    def get(self, digest: str) -> Principal | None:
        entry = self._entries.get(digest)
        if entry is None or entry[0] < time.monotonic():
            return None
        return entry[1]

    def put(self, digest: str, principal: Principal) -> None:
        if len(self._entries) > 10_000:
            self._entries.clear()
        self._entries[digest] = (time.monotonic() + self.ttl_s, principal)

    def clear(self) -> None:
        self._entries.clear()


def get_principal_cache(request: Request) -> PrincipalCache:
    cache: PrincipalCache = request.app.state.principal_cache
    return cache


def get_principal(
    session: SessionDep,
    settings: SettingsDep,
    cache: Annotated[PrincipalCache, Depends(get_principal_cache)],
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
    digest = hash_key(presented, secret=settings.secret_key)
    principal = cache.get(digest)
    if principal is None:
        principal = authenticate(session=session, presented=presented, secret=settings.secret_key)
        if principal is not None:
            cache.put(digest, principal)
    if principal is None:
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED, "invalid or revoked API key", headers={"WWW-Authenticate": "Bearer"}
        )
    return principal


CurrentPrincipal = Annotated[Principal, Depends(get_principal)]
PrincipalCacheDep = Annotated[PrincipalCache, Depends(get_principal_cache)]


def get_ingest_batcher(request: Request) -> IngestBatcher:
    batcher: IngestBatcher = request.app.state.ingest_batcher
    return batcher


IngestBatcherDep = Annotated[IngestBatcher, Depends(get_ingest_batcher)]

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


async def read_body_limited(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it exceeds ``limit`` bytes (declared or sent)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLargeError(f"body of {declared} bytes exceeds the {limit}-byte limit")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLargeError(f"body exceeds the {limit}-byte limit")
        chunks.append(chunk)
    return b"".join(chunks)
