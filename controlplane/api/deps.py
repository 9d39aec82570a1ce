"""FastAPI dependencies as Annotated aliases: settings, database session, caller, access, and the
deployment a route's path names."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Annotated, Generic, TypeVar

from fastapi import Depends, HTTPException, Path, Request, status
from fastapi.concurrency import run_in_threadpool
from sqlalchemy.orm import Session

from controlplane.accounts.keys import hash_key
from controlplane.accounts.service import Principal, authenticate
from controlplane.config import Settings
from controlplane.db.models import Deployment, Role
from controlplane.deployments.lookup import get_deployment
from controlplane.errors import PayloadTooLargeError
from controlplane.messaging import CeleryWorkQueue, WorkQueue

log = logging.getLogger(__name__)

K = TypeVar("K")
V = TypeVar("V")


async def get_app_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


SettingsDep = Annotated[Settings, Depends(get_app_settings)]


SessionFactory = Callable[[], Session]


async def get_session_factory(request: Request) -> SessionFactory:
    """How this app opens sessions (one seam, so tests can scope every session to a transaction)."""
    factory: SessionFactory = request.app.state.session_factory
    return factory


SessionFactoryDep = Annotated[SessionFactory, Depends(get_session_factory)]


def get_session(factory: SessionFactoryDep) -> Iterator[Session]:
    """A session per request; routes commit explicitly, anything uncommitted rolls back."""
    session = factory()
    try:
        yield session
    finally:
        session.rollback()
        session.close()


SessionDep = Annotated[Session, Depends(get_session)]


async def get_work_queue(request: Request, settings: SettingsDep) -> WorkQueue:
    """The app's queue to the gpu workers, made on first use (a seam: tests record sends instead)."""
    queue: WorkQueue | None = getattr(request.app.state, "work_queue", None)
    if queue is None:
        queue = CeleryWorkQueue(settings.broker_url)
        request.app.state.work_queue = queue
    return queue


WorkQueueDep = Annotated[WorkQueue, Depends(get_work_queue)]


def _presented_key(authorization: str | None, x_api_key: str | None) -> str | None:
    if x_api_key:
        return x_api_key.strip()
    if authorization:
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
    return None


class TtlCache(Generic[K, V]):
    """A small in-process cache whose entries expire after ``ttl_s`` seconds.

    Hot ingest paths use it to skip a database lookup per request (verified keys, deployment
    ids). Changes made through this process clear it at once; other API processes see them
    within ``ttl_s``.

    ``get_or_load`` loads a key at most once at a time and refreshes a hot entry before it
    expires. Without that, a hot entry expiring under load sent every request of the next few
    milliseconds to the database at once: at 500 requests/s that stampede stalled ingestion for
    100-300 ms every ``ttl_s`` (measured with bench/ingest.py's single-record client).
    """

    # An entry older than this share of its lifetime is reloaded by its next caller while
    # concurrent callers keep getting it; no entry is served past its ttl.
    REFRESH_AFTER_SHARE = 0.6

    def __init__(self, ttl_s: float, max_entries: int = 10_000) -> None:
        self.ttl_s = ttl_s
        self._max_entries = max_entries
        self._entries: dict[K, tuple[float, V]] = {}
        self._loading: dict[K, asyncio.Future[V | None]] = {}
        # Bumped by clear(): a load that started before a clear must not store what it read.
        self._generation = 0

    def get(self, key: K) -> V | None:
        entry = self._entries.get(key)
        if entry is None or entry[0] < time.monotonic():
            return None
        return entry[1]

    def put(self, key: K, value: V) -> None:
        if self.ttl_s <= 0:
            return
        if len(self._entries) >= self._max_entries:
            self._entries.clear()
        self._entries[key] = (time.monotonic() + self.ttl_s, value)

    def clear(self) -> None:
        self._entries.clear()
        self._loading.clear()
        self._generation += 1

    async def get_or_load(self, key: K, load: Callable[[], Awaitable[V | None]]) -> V | None:
        """The cached value, else ``load()``'s (stored unless None); concurrent misses share one
        load, whose exception reaches every caller waiting on it.

        The first caller past an entry's refresh point reloads it while concurrent callers keep
        the cached value; should that reload fail, its caller gets the cached value too (it is
        still within its ttl), and a reload that finds nothing (a revoked key) evicts the entry.
        """
        now = time.monotonic()
        entry = self._entries.get(key)
        if entry is not None and entry[0] >= now:
            refresh_at = entry[0] - self.ttl_s * (1 - self.REFRESH_AFTER_SHARE)
            if now < refresh_at or self._pending(key) is not None:
                return entry[1]
            try:
                return await asyncio.shield(self._start_load(key, load))
            except Exception:
                log.warning("refreshing a cached entry failed; serving it until it expires", exc_info=True)
                return entry[1]
        pending = self._pending(key) or self._start_load(key, load)
        # shield: a caller that goes away (client disconnect) does not cancel the others' load.
        return await asyncio.shield(pending)

    def _pending(self, key: K) -> asyncio.Future[V | None] | None:
        """The load of ``key`` in flight on this event loop, if any (a test client may run each
        request on a loop of its own)."""
        pending = self._loading.get(key)
        if pending is None or pending.done() or pending.get_loop() is not asyncio.get_running_loop():
            return None
        return pending

    def _start_load(self, key: K, load: Callable[[], Awaitable[V | None]]) -> asyncio.Future[V | None]:
        generation = self._generation

        async def run() -> V | None:
            try:
                value = await load()
                if generation == self._generation:
                    if value is None:
                        self._entries.pop(key, None)
                    else:
                        self.put(key, value)
                return value
            finally:
                if self._loading.get(key) is task:
                    del self._loading[key]

        task: asyncio.Future[V | None] = asyncio.ensure_future(run())
        self._loading[key] = task
        return task


# Keyed by the key's HMAC, never by the key itself.
PrincipalCache = TtlCache[str, Principal]
DeploymentIdCache = TtlCache[tuple[int, str], int]


async def get_principal_cache(request: Request) -> PrincipalCache:
    cache: PrincipalCache = request.app.state.principal_cache
    return cache


async def get_deployment_id_cache(request: Request) -> DeploymentIdCache:
    cache: DeploymentIdCache = request.app.state.deployment_id_cache
    return cache


def _authenticate(factory: SessionFactory, settings: Settings, presented: str) -> Principal | None:
    with factory() as session:
        return authenticate(session=session, presented=presented, secret=settings.secret_key)


# Where the request gate (controlplane.api.gate) leaves the principal it verified from the headers
# before any body was read; the route's own check then costs nothing.
PRINCIPAL_SCOPE_KEY = "controlplane.principal"


async def get_principal(request: Request) -> Principal:
    """The caller: the key's principal, from a cache, so that a hot path costs no query.

    It reads headers and app state from the request itself rather than through sub-dependencies:
    FastAPI resolves each dependency on every request, at tens of microseconds apiece on this
    kind of machine, and this runs on every route (with the ingest route's own, that took a
    sequential single-record POST from 5.1 to 4.0 ms).
    """
    verified: Principal | None = request.scope.get(PRINCIPAL_SCOPE_KEY)
    if verified is not None:
        return verified
    headers = request.headers
    presented = _presented_key(headers.get("authorization"), headers.get("x-api-key"))
    if presented is None:
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED,
            "missing API key: send 'Authorization: Bearer <key>'",
            headers={"WWW-Authenticate": "Bearer"},
        )
    state = request.app.state
    settings: Settings = state.settings
    cache: PrincipalCache = state.principal_cache
    digest = hash_key(presented, secret=settings.secret_key)
    factory: SessionFactory = state.session_factory

    async def load() -> Principal | None:
        return await run_in_threadpool(_authenticate, factory, settings, presented)

    principal = await cache.get_or_load(digest, load)
    if principal is None:
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED, "invalid or revoked API key", headers={"WWW-Authenticate": "Bearer"}
        )
    return principal


CurrentPrincipal = Annotated[Principal, Depends(get_principal)]

# Ids and version numbers in a path. A number no row can carry names nothing: without the bound,
# 2**63 reaches the database and fails there (500) instead of answering 404 (the app maps a
# path parameter that fails validation to 404).
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
RowId = Annotated[int, Path(ge=0, le=INT32_MAX)]
BigRowId = Annotated[int, Path(ge=0, le=INT64_MAX)]
PrincipalCacheDep = Annotated[PrincipalCache, Depends(get_principal_cache)]
DeploymentIdCacheDep = Annotated[DeploymentIdCache, Depends(get_deployment_id_cache)]


READ_ROLES = frozenset({Role.admin, Role.viewer})
# The serving fleet writes data too; only its records (from_serving_key) steer a canary.
WRITE_DATA_ROLES = frozenset({Role.admin, Role.ingest, Role.serving})
ADMIN_ROLES = frozenset({Role.admin})
# What to serve names the live arms: only the fleet's own serving key (and admin) reads it.
SERVING_ROLES = frozenset({Role.admin, Role.serving})


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
    async def dependency(request: Request) -> Principal:
        principal = await get_principal(request)
        # Role-checked routes all live under /v1/accounts/{account}/...: the path names the account.
        check_access(principal, request.path_params["account"], allowed)
        return principal

    return Depends(dependency)


Reader = Annotated[Principal, _access(READ_ROLES)]
DataWriter = Annotated[Principal, _access(WRITE_DATA_ROLES)]
Admin = Annotated[Principal, _access(ADMIN_ROLES)]
ServingReader = Annotated[Principal, _access(SERVING_ROLES)]


# The deployment in a route's path, for this key: the role check runs first (another account's key
# gets 404 and a weak role 403 before any query), then the lookup (404 for an unknown or deleted
# deployment). They depend on the same Reader/Admin/... and SessionDep a route may also take, and
# FastAPI resolves each dependency once per request: a route that takes the principal too (say, to
# name the actor in the audit log) pays for one check, and gets the row attached to its own session.


def get_readable_deployment(deployment: str, principal: Reader, session: SessionDep) -> Deployment:
    """The path's deployment, for a key that may read it."""
    return get_deployment(session=session, account_id=principal.account_id, name=deployment)


def get_writable_deployment(deployment: str, principal: DataWriter, session: SessionDep) -> Deployment:
    """The path's deployment, for a key that may send it data (records, traces, datasets)."""
    return get_deployment(session=session, account_id=principal.account_id, name=deployment)


def get_admin_deployment(deployment: str, principal: Admin, session: SessionDep) -> Deployment:
    """The path's deployment, for a key that may change it."""
    return get_deployment(session=session, account_id=principal.account_id, name=deployment)


def get_serving_deployment(deployment: str, principal: ServingReader, session: SessionDep) -> Deployment:
    """The path's deployment, for a key that may read what to serve (the fleet's serving key)."""
    return get_deployment(session=session, account_id=principal.account_id, name=deployment)


ReadableDeployment = Annotated[Deployment, Depends(get_readable_deployment)]
WritableDeployment = Annotated[Deployment, Depends(get_writable_deployment)]
AdminDeployment = Annotated[Deployment, Depends(get_admin_deployment)]
ServingDeployment = Annotated[Deployment, Depends(get_serving_deployment)]


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
