"""Routes that take acceptance metrics in (batches, Prometheus pushes) and serve statistics."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime, timedelta

import orjson
from fastapi import APIRouter, Query, Request, Response
from fastapi.concurrency import run_in_threadpool

from controlplane import messaging
from controlplane.api import schemas
from controlplane.api.deps import (
    INT32_MAX,
    DataWriter,
    DeploymentIdCache,
    ReadableDeployment,
    SessionDep,
    SessionFactory,
    SettingsDep,
    WritableDeployment,
    read_body_limited,
)
from controlplane.config import Settings
from controlplane.db.models import Role
from controlplane.deployments.lookup import resolve_deployment_id
from controlplane.errors import DomainError, PayloadTooLargeError, ValidationProblem
from controlplane.ingest.batcher import IngestBatcher
from controlplane.ingest.formats import (
    EARLIEST,
    LATEST,
    MAX_CATEGORY_CHARS,
    BatchTooLargeError,
    BatchValidationError,
    parse_batch,
)
from controlplane.ingest.prometheus import is_openmetrics_media_type, require_openmetrics_eof
from controlplane.ingest.prometheus_push import store_prometheus_push
from controlplane.ingest.service import IngestResult
from controlplane.stats.service import acceptance_series
from controlplane.timestamps import parse_utc, utcnow

INLINE_PARSE_BYTES = 16 * 1024
# The widest bucket /stats draws: a year.
MAX_BUCKET_SECONDS = 366 * 24 * 3600

router = APIRouter(prefix="/v1/accounts/{account}/deployments/{deployment}", tags=["acceptance"])


def _resolve_deployment(factory: SessionFactory, account_id: int, name: str) -> int:
    with factory() as session:
        return resolve_deployment_id(session=session, account_id=account_id, name=name)


@router.post("/acceptance", response_model=IngestResult)  # the reply's schema, for OpenAPI
async def ingest_batch(
    account: str,
    deployment: str,
    request: Request,
    principal: DataWriter,
) -> Response:
    """Store a batch of acceptance records (native, Fireworks, vLLM, SGLang or TensorRT-LLM shape).

    All or nothing: any invalid record rejects the whole batch (422, the first problems listed
    and the rest counted). A record whose request id is already stored with the same values is
    skipped and reported (idempotent retries); with other values it is a conflict (409 naming
    the ids) and nothing of the batch is stored. Another request that fails, even one flushed in
    the same transaction, never fails this one.
    """
    # The hot path of the API: app state is read directly, not through one FastAPI dependency
    # each (resolving a dependency costs more CPU than the cache lookups it would wrap).
    state = request.app.state
    settings: Settings = state.settings
    batcher: IngestBatcher = state.ingest_batcher
    deployment_ids: DeploymentIdCache = state.deployment_id_cache
    session_factory: SessionFactory = state.session_factory
    body = await read_body_limited(request, settings.max_body_bytes)
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ValidationProblem(f"body is not valid JSON: {exc}") from exc
    if isinstance(payload, dict) and isinstance(payload.get("records"), list):
        count, limit = len(payload["records"]), settings.max_batch_records
        if count > limit:
            raise PayloadTooLargeError(f"batch of {count} records exceeds the limit of {limit}")
    try:
        # Parsing a large batch takes tens of milliseconds: keep it off the event loop. A small
        # one takes microseconds, less than the hop to a worker thread would.
        if len(body) > INLINE_PARSE_BYTES:
            records = await run_in_threadpool(parse_batch, payload)
        else:
            records = parse_batch(payload)
    except BatchTooLargeError as exc:
        raise PayloadTooLargeError(str(exc), details=exc.as_dicts()) from exc
    except BatchValidationError as exc:
        raise ValidationProblem(
            f"{exc.total} problem(s) in the batch; nothing was stored", details=exc.as_dicts()
        ) from exc
    account_id = principal.account_id

    async def load() -> int:
        return await run_in_threadpool(_resolve_deployment, session_factory, account_id, deployment)

    deployment_id = await deployment_ids.get_or_load((account_id, deployment), load)
    assert deployment_id is not None  # an unknown deployment raises instead
    # Only the fleet's own records steer a canary: an ingest key cannot forge arm labels into it.
    result = await batcher.submit(deployment_id, records, from_serving_key=principal.role is Role.serving)
    sender = request.app.state.task_sender
    if result.inserted and sender is not None:
        monitor = messaging.TaskMessage(messaging.DRIFT_MONITOR_DEPLOYMENT, (deployment_id,))
        sender.send_throttled(f"drift:{deployment_id}", monitor)
    # Encoded here: a returned dict would be validated against the response model and encoded
    # by FastAPI, which on this route, run hundreds of times a second, costs more than orjson.
    return Response(orjson.dumps(result.as_dict()), media_type="application/json")


@router.post("/acceptance/prometheus")
async def ingest_prometheus(
    account: str,
    deployment: WritableDeployment,
    principal: DataWriter,
    request: Request,
    session: SessionDep,
    settings: SettingsDep,
) -> schemas.PrometheusPushResult:
    """Take a vLLM exposition (Prometheus text or OpenMetrics, told by ``Content-Type`` or by the
    body's ``# EOF``); counter deltas since the last push become records. The first push (and a
    label set's first appearance) is a baseline: remembered, not counted."""
    body = await read_body_limited(request, settings.max_body_bytes)
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValidationProblem("body must be UTF-8 Prometheus text or OpenMetrics exposition") from exc
    if is_openmetrics_media_type(request.headers.get("content-type")):
        # Without its terminator the body would pass for Prometheus text: a truncated push.
        try:
            require_openmetrics_eof(text)
        except BatchValidationError as exc:
            raise ValidationProblem(
                f"not a complete OpenMetrics exposition: {exc}; nothing was stored", details=exc.as_dicts()
            ) from exc
    scrape_id = request.query_params.get("scrape_id") or hashlib.sha256(body).hexdigest()[:16]

    def work() -> schemas.PrometheusPushResult:
        outcome = store_prometheus_push(
            session=session,
            deployment_id=deployment.id,
            text=text,
            scrape_id=scrape_id,
            from_serving_key=principal.role is Role.serving,
            max_label_sets=settings.prometheus_max_label_sets,
        )
        session.commit()
        return schemas.PrometheusPushResult.model_validate(outcome)

    try:
        return await run_in_threadpool(work)
    except DomainError:
        session.rollback()
        raise


def _parse_time(value: str | None, default: datetime, name: str) -> datetime:
    if value is None:
        return default
    try:
        parsed = parse_utc(value)
    except ValueError as exc:
        raise ValidationProblem(f"{name} must be an ISO-8601 time, got {value[:80]!r}") from exc
    # No record can lie outside the range ingest stores, and a window edge near year 1 or 9999
    # would overflow the date arithmetic below.
    if not EARLIEST <= parsed <= LATEST:
        raise ValidationProblem(f"{name} must lie between {EARLIEST.isoformat()} and {LATEST.isoformat()}")
    return parsed


@router.get("/stats")
def stats(
    account: str,
    deployment: ReadableDeployment,
    session: SessionDep,
    start: str | None = None,
    end: str | None = None,
    bucket_seconds: int = Query(default=300, ge=60, le=MAX_BUCKET_SECONDS),
    arm: str | None = None,
    drafter_version: int | None = Query(default=None, ge=0, le=INT32_MAX),
    category: str | None = Query(
        default=None,
        max_length=MAX_CATEGORY_CHARS,
        description='records of this category only (exact match; "" or absent: every category)',
    ),
) -> schemas.AcceptanceSeries:
    """Hit rate, accepted length, per-position acceptance, latency percentiles and throughput,
    over time and per request category."""
    # Default window: the last 24 h, ending on the bucket grid just after now, so that buckets line
    # up with the coarser rollup tiers (the fast path) and the current minute is included.
    now = utcnow().timestamp()
    grid = max(60, bucket_seconds)
    default_end = datetime.fromtimestamp((now // grid + 1) * grid, tz=UTC)
    end_at = _parse_time(end, default_end, "end")
    start_at = _parse_time(start, end_at - timedelta(hours=24), "start")
    series = acceptance_series(
        session=session,
        deployment_id=deployment.id,
        start=start_at,
        end=end_at,
        bucket_seconds=bucket_seconds,
        arm=arm,
        drafter_version=drafter_version,
        category=category,
        per_category=True,
    )
    return schemas.AcceptanceSeries.model_validate(series)
