"""Routes for a deployment's scrape targets: register, list, get, delete, and scrape one now.

Viewers read; admins register, delete and scrape now, each change audited. The scraping itself is
``controlplane.ingest.scrape``'s; beat scrapes every enabled target on its own clock.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request, status
from pydantic import BaseModel, ConfigDict, Field

from controlplane.api.deps import Admin, AdminDeployment, ReadableDeployment, SessionDep, SettingsDep
from controlplane.audit.service import record_change
from controlplane.errors import DomainError
from controlplane.ingest.scrape import (
    MAX_URLS,
    Fetch,
    create_target,
    delete_target,
    describe_target,
    get_target,
    http_fetch,
    list_targets,
    scrape_target,
    validate_target,
)

router = APIRouter(prefix="/v1/accounts/{account}/deployments/{deployment}", tags=["scrape targets"])


class ScrapeTargetRegistration(BaseModel):
    """A backend's ``/metrics`` to pull; the service checks the values (422 naming the field)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="unique in the deployment: 1-100 characters of a-z, 0-9 and '-'")
    urls: list[str] = Field(
        description=f"1 to {MAX_URLS} http(s) URLs of the same engine, tried in order until one answers"
    )
    arm: str = Field(
        default="live", description='the arm its records are filed under: "live", "baseline" or "canary:<n>"'
    )
    drafter_version: int | None = Field(default=None, description="the drafter version the engine serves")
    enabled: bool = Field(default=True, description="whether beat scrapes it")


class ScrapeTarget(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    urls: list[str]
    arm: str
    drafter_version: int | None
    enabled: bool
    scrapes: int = Field(description="scrape attempts so far, failed ones included")
    records_stored: int = Field(description="acceptance records its scrapes stored")
    label_sets: int = Field(description="engines (label sets) in the last counters seen")
    last_scraped_at: str | None = Field(description="when the last attempt ran")
    last_error: str | None = Field(description="why the last attempt failed; null when it succeeded")
    created_at: str


class ScrapeTargetList(BaseModel):
    model_config = ConfigDict(extra="forbid")

    scrape_targets: list[ScrapeTarget]


class ScrapeOutcome(BaseModel):
    """What one scrape did: a failed scrape stores nothing and keeps the last counters."""

    model_config = ConfigDict(extra="forbid")

    name: str
    ok: bool
    url: str | None = Field(description="the URL that answered")
    format: str | None = Field(description="openmetrics or prometheus")
    label_sets: int
    baseline_label_sets: int = Field(
        description="label sets seen for the first time: their counters are the baseline, not counted"
    )
    inserted: int = Field(description="records stored (one per label set whose counters moved)")
    duplicates: int = Field(description="records already stored by an earlier identical scrape")
    error: str | None
    url_errors: list[str] = Field(description="why each URL tried before the one that answered failed")
    scraped_at: str | None
    target: ScrapeTarget


async def get_fetcher(request: Request) -> Fetch:
    """How the API reads a backend's metrics (a seam: an app may set ``state.scrape_fetch``)."""
    fetch: Fetch = getattr(request.app.state, "scrape_fetch", None) or http_fetch
    return fetch


FetchDep = Annotated[Fetch, Depends(get_fetcher)]


def _resource(account: str, deployment: str, name: str) -> str:
    return f"accounts/{account}/deployments/{deployment}/scrape-targets/{name}"


@router.get("/scrape-targets")
def list_(account: str, deployment: ReadableDeployment, session: SessionDep) -> ScrapeTargetList:
    rows = list_targets(session=session, deployment_id=deployment.id)
    return ScrapeTargetList(scrape_targets=[ScrapeTarget.model_validate(describe_target(t)) for t in rows])


@router.post("/scrape-targets", status_code=status.HTTP_201_CREATED)
def register(
    account: str,
    body: ScrapeTargetRegistration,
    deployment: AdminDeployment,
    principal: Admin,
    session: SessionDep,
) -> ScrapeTarget:
    spec = validate_target(
        name=body.name,
        urls=body.urls,
        arm=body.arm,
        drafter_version=body.drafter_version,
        enabled=body.enabled,
    )
    target = create_target(session=session, deployment_id=deployment.id, spec=spec)
    reply = describe_target(target)
    record_change(
        session=session,
        account_id=principal.account_id,
        actor=principal.actor,
        action="scrape_target.register",
        resource=_resource(account, deployment.name, spec.name),
        before=None,
        after={k: reply[k] for k in ("name", "urls", "arm", "drafter_version", "enabled")},
    )
    session.commit()
    return ScrapeTarget.model_validate(reply)


@router.get("/scrape-targets/{name}")
def get(account: str, name: str, deployment: ReadableDeployment, session: SessionDep) -> ScrapeTarget:
    target = get_target(session=session, deployment_id=deployment.id, name=name)
    return ScrapeTarget.model_validate(describe_target(target))


@router.delete("/scrape-targets/{name}", status_code=status.HTTP_204_NO_CONTENT, response_model=None)
def delete(
    account: str, name: str, deployment: AdminDeployment, principal: Admin, session: SessionDep
) -> None:
    before = delete_target(session=session, deployment_id=deployment.id, name=name)
    record_change(
        session=session,
        account_id=principal.account_id,
        actor=principal.actor,
        action="scrape_target.delete",
        resource=_resource(account, deployment.name, name),
        before={k: before[k] for k in ("name", "urls", "arm", "drafter_version", "enabled")},
        after=None,
    )
    session.commit()


@router.post("/scrape-targets/{name}/scrape")
def scrape_now(
    account: str,
    name: str,
    deployment: AdminDeployment,
    principal: Admin,
    session: SessionDep,
    fetch: FetchDep,
    settings: SettingsDep,
) -> ScrapeOutcome:
    """Scrape the target now and answer the outcome; a backend that is down is a 200 with
    ``ok: false`` and the reason (the scrape ran; what it found is the answer)."""
    target = get_target(session=session, deployment_id=deployment.id, name=name)
    try:
        outcome = scrape_target(session, target, fetch, max_label_sets=settings.prometheus_max_label_sets)
    except DomainError:
        session.rollback()
        raise
    result: dict[str, Any] = outcome.as_dict()
    record_change(
        session=session,
        account_id=principal.account_id,
        actor=principal.actor,
        action="scrape_target.scrape",
        resource=_resource(account, deployment.name, name),
        before=None,
        after={k: result[k] for k in ("ok", "url", "inserted", "error")},
    )
    session.commit()
    return ScrapeOutcome.model_validate({**result, "target": describe_target(target)})
