"""Liveness and readiness probes."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from sqlalchemy import text

from controlplane.api.deps import SettingsDep
from controlplane.db.migrate import current_revision, head_revision
from controlplane.db.session import get_engine

router = APIRouter(tags=["health"])


@router.get("/healthz")
def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz", response_model=None)
def readyz(settings: SettingsDep) -> dict[str, Any] | JSONResponse:
    """Ready when the database answers and its schema is at the newest migration."""
    try:
        with get_engine(settings.database_url).connect() as connection:
            connection.execute(text("SELECT 1"))
        current = current_revision(settings.database_url)
    except Exception as exc:  # any failure to reach the database means "not ready"
        return JSONResponse({"status": "unavailable", "database": f"unreachable: {type(exc).__name__}"}, 503)
    head = head_revision(settings.database_url)
    if current != head:
        return JSONResponse({"status": "unavailable", "migration": current, "head": head}, 503)
    return {"status": "ready", "migration": current}
