"""Routes of the web dashboard: the page shells, their static assets, and the JSON they read.

Pages and assets carry no data and need no key: each page's script reads the API key the login
page kept in ``sessionStorage`` and sends it as ``Authorization: Bearer`` to the JSON routes below,
which are ordinary account-scoped API routes (viewer or admin, another account's is a 404). The key
never appears in a URL, and no cookie carries it, so there is no cross-site request to forge.
Charts use plotly.js from the installed ``plotly`` package; the Content-Security-Policy allows
this origin only, so no page can fetch anything from elsewhere.
"""

from __future__ import annotations

from datetime import datetime
from functools import lru_cache
from importlib import resources
from pathlib import Path
from string import Template
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, HTTPException, Query, status
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, RedirectResponse
from pydantic import Field

from controlplane.api import schemas
from controlplane.api.deps import ReadableDeployment, Reader, SessionDep
from controlplane.dashboard.service import (
    DEFAULT_RANGE,
    account_jobs,
    canaries_view,
    deployment_view,
    overview,
    promotion_history,
)
from controlplane.errors import ValidationProblem
from controlplane.timestamps import parse_utc, utcnow

PACKAGE_DIR = Path(__file__).resolve().parent
STATIC_DIR = PACKAGE_DIR / "static"
# Served by name only (no path from the URL touches the file system).
STATIC_FILES = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; connect-src 'self'; img-src 'self' data: blob:; "
    # plotly.js sets inline styles on the elements it draws and injects one <style> sheet.
    "style-src 'self' 'unsafe-inline'; font-src 'self'; object-src 'none'; base-uri 'none'; "
    "form-action 'self'; frame-ancestors 'none'"
)
PAGE_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "Cache-Control": "no-store",
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
}
PAGE_TITLES = {
    "login": "Sign in",
    "overview": "Deployments",
    "deployment": "Deployment",
    "canary": "Canary",
    "jobs": "Jobs",
    "audit": "Audit and promotion history",
}


class DashboardJSON(JSONResponse):
    """The JSON routes' answer, rendered by orjson straight from the service's dicts.

    A deployment's series is ~100 kB of plain numbers; validating and encoding it as a
    ``dict[str, Any]`` return value cost FastAPI ~20 ms, more than the queries behind it. So each
    route declares its reply model for the OpenAPI document and returns this response, which
    FastAPI sends as it is. orjson writes datetimes as ISO 8601 and NaN as null (valid JSON, unlike
    the stdlib's NaN).
    """

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content, option=orjson.OPT_NON_STR_KEYS)


class OverviewRow(schemas.Reply):
    deployment_id: str
    display_name: str | None
    target_model: str
    speculation_mode: str
    active_drafter_version: int | None
    k: int
    requests_last_hour: int
    hit_rate: float | None
    mean_accepted_length: float | None
    speedup_estimate: float | None = Field(
        description="Leviathan et al.'s, from the hit rate, k and the drafter cost ratio below"
    )
    draft_cost_ratio: float = Field(description="drafter step time / target step time the estimate used")
    draft_cost_source: str = Field(description="the shadow replay that measured it, or the assumption")
    open_drift_events: int
    running_jobs: int


class DashboardOverview(schemas.Reply):
    account: str
    generated_at: str
    current_window_s: int
    assumed_draft_cost_ratio: float = Field(
        description="the drafter cost ratio assumed where no shadow replay measured one"
    )
    deployments: list[OverviewRow]


class SeriesPoint(schemas.Reply):
    """One bucket of a chart; the range's total has no start."""

    start: str | None
    requests: int
    hit_rate: float | None
    mean_accepted_length: float | None
    inter_token_latency_ms_p50: float | None
    inter_token_latency_ms_p95: float | None
    total_latency_ms_p50: float | None
    total_latency_ms_p95: float | None
    throughput_tokens_per_s: float
    decode_tokens_per_s: float | None


class SeriesWindow(schemas.Reply):
    start: str
    end: str
    bucket_seconds: int


class SeriesRange(SeriesWindow):
    name: str


class PositionAcceptance(schemas.Reply):
    """Conditional acceptance per draft position, on the drift detector's scale."""

    current: list[float | None]
    current_window_s: int
    range: list[float | None]
    last_drift_event_baseline: list[float | None] | None


class Marker(schemas.Reply):
    kind: str = Field(description="drift, job, canary, promotion or rollback")
    at: str | None
    end: str | None
    label: str


class CategoryRow(schemas.Reply):
    """One request category over the page's range ("" holds requests without one)."""

    category: str
    requests: int
    hit_rate: float | None
    mean_accepted_length: float | None
    no_speculation_requests: int
    speedup_vs_no_speculation: float | None = Field(
        description="measured against the no-speculation arm's records of the same category"
    )
    speedup_estimate: float | None = Field(
        description="from the hit rate, k and the measured cost ratio (else the assumed one)"
    )


class DashboardDeployment(schemas.Reply):
    deployment: schemas.Deployment
    range: SeriesRange
    series: list[SeriesPoint]
    total: SeriesPoint
    positions: PositionAcceptance
    markers: list[Marker]
    categories: list[CategoryRow] = Field(description="per request category, most requests first")


class DashboardCanaries(schemas.Reply):
    canaries: list[schemas.Canary]
    arm_series: dict[str, list[SeriesPoint]] = Field(description="per serving arm, over the newest canary")
    arm_window: SeriesWindow | None


class VersionRow(schemas.Reply):
    version: int
    state: str
    created_at: str | None
    activated_at: str | None
    training_job_id: int | None


class PromotionHistory(schemas.Reply):
    versions: list[VersionRow]
    moves: list[schemas.AuditEntry]


class AccountJob(schemas.Job):
    deployment: str
    log: list[str]


class AccountJobs(schemas.Reply):
    jobs: list[AccountJob]


pages = APIRouter(prefix="/dashboard", include_in_schema=False)
api = APIRouter(
    prefix="/v1/accounts/{account}/dashboard", tags=["dashboard"], default_response_class=DashboardJSON
)


@lru_cache(maxsize=1)
def _page_template() -> Template:
    return Template((PACKAGE_DIR / "templates" / "page.html").read_text(encoding="utf-8"))


@lru_cache(maxsize=1)
def plotly_bundle() -> Path:
    """plotly.min.js as shipped inside the installed plotly package (the build installs it)."""
    bundle = Path(str(resources.files("plotly") / "package_data" / "plotly.min.js"))
    if not bundle.is_file():
        raise RuntimeError(f"plotly.js is missing from the plotly package (looked at {bundle})")
    return bundle


def _page(page: str) -> HTMLResponse:
    html = _page_template().substitute(page=page, title=PAGE_TITLES[page])
    return HTMLResponse(html, headers=PAGE_HEADERS)


@pages.get("", response_class=HTMLResponse)
def overview_page() -> HTMLResponse:
    return _page("overview")


@pages.get("/", response_class=RedirectResponse)
def overview_page_slash() -> RedirectResponse:
    return RedirectResponse("/dashboard", status_code=status.HTTP_308_PERMANENT_REDIRECT)


@pages.get("/login", response_class=HTMLResponse)
def login_page() -> HTMLResponse:
    return _page("login")


@pages.get("/deployments/{deployment}", response_class=HTMLResponse)
def deployment_page(deployment: str) -> HTMLResponse:
    return _page("deployment")


@pages.get("/deployments/{deployment}/canary", response_class=HTMLResponse)
def canary_page(deployment: str) -> HTMLResponse:
    return _page("canary")


@pages.get("/jobs", response_class=HTMLResponse)
def jobs_page() -> HTMLResponse:
    return _page("jobs")


@pages.get("/audit", response_class=HTMLResponse)
def audit_page() -> HTMLResponse:
    return _page("audit")


@pages.get("/static/vendor/plotly.min.js", response_class=FileResponse)
def plotly_js() -> FileResponse:
    # Versioned by the installed package; a day of caching keeps later page loads light.
    return FileResponse(
        plotly_bundle(), media_type="text/javascript", headers={"Cache-Control": "public, max-age=86400"}
    )


@pages.get("/static/{name}", response_class=FileResponse)
def static_file(name: str) -> FileResponse:
    media_type = STATIC_FILES.get(name)
    if media_type is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no static file {name!r}")
    return FileResponse(STATIC_DIR / name, media_type=media_type, headers={"Cache-Control": "no-cache"})


def _parse_end(value: str | None) -> datetime | None:
    if value is None or value == "":
        return None
    try:
        return parse_utc(value)
    except ValueError as exc:
        raise ValidationProblem(f"end must be an ISO-8601 time, got {value!r}") from exc


@api.get("/overview", response_model=DashboardOverview)
def overview_data(account: str, principal: Reader, session: SessionDep) -> DashboardJSON:
    """Every deployment with mode, active drafter, k, current hit rate, speed-up, drift and jobs."""
    return DashboardJSON(
        overview(session=session, account_id=principal.account_id, account_name=account, now=utcnow())
    )


@api.get("/deployments/{deployment}", response_model=DashboardDeployment)
def deployment_data(
    account: str,
    deployment: ReadableDeployment,
    session: SessionDep,
    range_name: Annotated[str, Query(alias="range")] = DEFAULT_RANGE,
    end: str | None = None,
) -> DashboardJSON:
    """Hit rate, latency and throughput over time with markers, and per-position acceptance."""
    return DashboardJSON(
        deployment_view(
            session=session,
            deployment=deployment,
            account_name=account,
            range_name=range_name,
            end=_parse_end(end),
            now=utcnow(),
        )
    )


@api.get("/deployments/{deployment}/canaries", response_model=DashboardCanaries)
def canaries_data(account: str, deployment: ReadableDeployment, session: SessionDep) -> DashboardJSON:
    """The deployment's canaries as stored, and per-arm series over the newest one's window."""
    return DashboardJSON(canaries_view(session=session, deployment=deployment, now=utcnow()))


@api.get("/deployments/{deployment}/promotions", response_model=PromotionHistory)
def promotions_data(account: str, deployment: ReadableDeployment, session: SessionDep) -> DashboardJSON:
    """The deployment's drafter versions and its promotion and rollback history."""
    return DashboardJSON(promotion_history(session=session, deployment=deployment, account_name=account))


@api.get("/jobs", response_model=AccountJobs)
def jobs_data(account: str, principal: Reader, session: SessionDep, limit: int = 200) -> DashboardJSON:
    """The account's jobs across deployments, queued and running first."""
    return DashboardJSON(account_jobs(session=session, account_id=principal.account_id, limit=limit))
