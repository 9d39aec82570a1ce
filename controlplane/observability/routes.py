"""``GET /metrics``: the caller's account in Prometheus text format.

A scrape presents an API key like any other caller (Prometheus' ``authorization`` with a
``credentials_file``), and sees only that key's account: deployment names and figures are the
account's business, so they are not published to whoever can reach the port.
"""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, Response, status
from fastapi.responses import PlainTextResponse
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from controlplane.api.deps import READ_ROLES, CurrentPrincipal, SessionDep, SettingsDep
from controlplane.observability.metrics import account_metrics, exposition
from controlplane.timestamps import utcnow

router = APIRouter(tags=["observability"])


@router.get("/metrics", response_class=PlainTextResponse, responses={200: {"content": {"text/plain": {}}}})
def metrics(principal: CurrentPrincipal, session: SessionDep, settings: SettingsDep) -> Response:
    """Ingest counters, hit rate and accepted length per arm, drift, jobs, canaries, promotions."""
    if principal.role not in READ_ROLES:
        raise HTTPException(
            status.HTTP_403_FORBIDDEN,
            f"role {principal.role.value!r} may not read metrics (needs admin or viewer)",
        )
    families = account_metrics(
        session=session,
        account_id=principal.account_id,
        account_name=principal.account_name,
        settings=settings,
        now=utcnow(),
    )
    return Response(exposition(families), media_type=CONTENT_TYPE_LATEST)
