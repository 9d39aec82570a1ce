"""The FastAPI application factory: routers, error mapping and start-up."""

from __future__ import annotations

import gc
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse

from controlplane.api import (
    acceptance,
    adaptation,
    aggregates,
    canaries,
    deployments,
    drift,
    fleet,
    health,
    jobs,
    keys,
    models,
    scrape,
    speculation,
    traces,
)
from controlplane.api.deps import DeploymentIdCache, PrincipalCache
from controlplane.api.gate import (
    BodyTooLargeError,
    RequestGate,
    database_unavailable_response,
    error_response,
)
from controlplane.bootstrap import prepare_embedded_database
from controlplane.config import Settings, get_settings
from controlplane.dashboard import routes as dashboard
from controlplane.db.session import UNREACHABLE_DATABASE_ERRORS, get_engine, get_sessionmaker
from controlplane.errors import DomainError
from controlplane.ingest.batcher import IngestBatcher
from controlplane.messaging import BackgroundSender
from controlplane.observability import routes as observability

log = logging.getLogger(__name__)


def _document_api_keys(app: FastAPI) -> None:
    """Declare the API-key schemes in the OpenAPI document.

    Authentication reads the headers itself (see controlplane.api.deps.get_principal) rather than
    through FastAPI's security dependencies, which cost CPU on every request; the document still
    tells clients, and /docs' Authorize button, how to present a key.
    """

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schema.setdefault("components", {})["securitySchemes"] = {
                "bearer": {"type": "http", "scheme": "bearer", "description": "Authorization: Bearer <key>"},
                "apiKeyHeader": {"type": "apiKey", "in": "header", "name": "X-API-Key"},
            }
            for path, operations in schema.get("paths", {}).items():
                if path.startswith("/v1/") or path == "/metrics":
                    for operation in operations.values():
                        operation["security"] = [{"bearer": []}, {"apiKeyHeader": []}]
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if settings.is_sqlite and settings.environment == "development":
            # The embedded default needs no operator: migrate and create the first account.
            prepare_embedded_database(settings)
        if settings.api_gc_freeze:
            # Everything alive now (modules, app, settings) lives as long as the process: freeze
            # it out of the collector's view. Otherwise every full collection walks it all again,
            # a 100-160 ms pause on this kind of machine that stalls every request in flight
            # (single-record ingest p99 at 500 requests/s: 170 -> 90 ms).
            gc.collect()
            gc.freeze()
        yield
        await app.state.ingest_batcher.close()
        if app.state.task_sender is not None:
            app.state.task_sender.close()

    app = FastAPI(
        title="Speculative-decoding drafter control plane",
        version="0.1.0",
        lifespan=lifespan,
        docs_url="/docs",
        # FastAPI's built-in OpenTelemetry hooks look the providers up on every request; this
        # service exports Prometheus metrics (/metrics) and has no OpenTelemetry to feed.
        telemetry={"tracing": False, "metrics": False, "logs": False},
    )
    app.state.settings = settings
    app.state.principal_cache = PrincipalCache(settings.auth_cache_ttl_s)
    app.state.deployment_id_cache = DeploymentIdCache(settings.auth_cache_ttl_s)
    app.state.session_factory = get_sessionmaker(settings.database_url)
    app.state.ingest_batcher = IngestBatcher(
        app.state.session_factory,
        engine=get_engine(settings.database_url),
        synchronous_commit=settings.ingest_synchronous_commit,
    )
    # Ingestion asks for a prompt drift check instead of waiting for beat (at most every 2 s).
    app.state.task_sender = (
        BackgroundSender(settings.broker_url) if settings.drift_enqueue_on_ingest else None
    )

    @app.exception_handler(DomainError)
    async def domain_error(_: Request, exc: DomainError) -> JSONResponse:
        return error_response(exc.status_code, type(exc).__name__, exc.message, exc.details)

    async def database_unreachable(_: Request, exc: Exception) -> JSONResponse:
        log.warning("database unreachable: %s", str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return database_unavailable_response()

    for error_class in UNREACHABLE_DATABASE_ERRORS:
        app.add_exception_handler(error_class, database_unreachable)

    @app.exception_handler(BodyTooLargeError)
    async def body_too_large(_: Request, exc: BodyTooLargeError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        response = error_response(exc.status_code, "HTTPError", str(exc.detail))
        if exc.headers:
            response.headers.update(exc.headers)
        return response

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        details = [{"field": ".".join(str(p) for p in e["loc"]), "message": e["msg"]} for e in exc.errors()]
        if any(e["loc"][:1] == ("path",) for e in exc.errors()):
            # An id or version no row can have (2**63, -1, "abc") names nothing: 404, as an
            # unknown one would.
            return error_response(404, "NotFoundError", "no such resource: the path names nothing", details)
        return error_response(422, "ValidationProblem", "request is invalid", details)

    # Key, rate and body size are checked before a route reads its body (see the module).
    app.add_middleware(RequestGate)
    _document_api_keys(app)
    # Routes match in the order included: the ingest routes, by far the most requested, go first.
    routers = (
        acceptance,
        aggregates,
        health,
        keys,
        deployments,
        drift,
        traces,
        jobs,
        canaries,
        models,
        scrape,
        fleet,
    )
    for module in routers:
        app.include_router(module.router)
    app.include_router(adaptation.router)
    app.include_router(speculation.router)
    app.include_router(dashboard.api)
    app.include_router(dashboard.pages)
    app.include_router(observability.router)
    return app
