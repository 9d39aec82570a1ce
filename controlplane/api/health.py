"""Liveness and readiness probes."""

from __future__ import annotations

from fastapi import APIRouter, status
from fastapi.responses import JSONResponse
from sqlalchemy import text

from controlplane.api import schemas
from controlplane.api.deps import SettingsDep
from controlplane.db.migrate import current_revision, head_revision
from controlplane.db.session import get_engine

router = APIRouter(tags=["health"])


@router.get("/healthz")
def healthz() -> schemas.Health:
    return schemas.Health(status="ok")


def _unready(reply: schemas.Unready) -> JSONResponse:
    return JSONResponse(reply.model_dump(exclude_unset=True), status.HTTP_503_SERVICE_UNAVAILABLE)


# Not ready is a 503 sent as a JSONResponse (a returned model would be sent with the route's 200),
# holding only the fields that apply.
@router.get(
    "/readyz",
    response_model=schemas.Readiness,
    responses={
        status.HTTP_503_SERVICE_UNAVAILABLE: {
            "model": schemas.Unready,
            "description": "Not ready: the database is unreachable or behind",
        }
    },
)
def readyz(settings: SettingsDep) -> schemas.Readiness | JSONResponse:
    """Ready when the database answers and its schema is at the newest migration."""
    try:
        with get_engine(settings.database_url).connect() as connection:
            connection.execute(text("SELECT 1"))
        current = current_revision(settings.database_url)
    except Exception as exc:  # any failure to reach the database means "not ready"
        return _unready(schemas.Unready(status="unavailable", database=f"unreachable: {type(exc).__name__}"))
    head = head_revision(settings.database_url)
    if current != head:
        return _unready(schemas.Unready(status="unavailable", migration=current, head=head))
    return schemas.Readiness(status="ready", migration=current)
