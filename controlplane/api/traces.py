"""Routes for trace capture: sampled prompt/completion batches, JSONL sample datasets, reading back.

Thin adapters: read the body under a size limit, parse (controlplane.traces.formats), store
(controlplane.traces.service), commit. Parsing, scrubbing and inserting a large body take
seconds, so they run off the event loop.
"""

from __future__ import annotations

import re
from pathlib import Path

from fastapi import APIRouter, Query, Request
from fastapi.concurrency import run_in_threadpool
from sqlalchemy.orm import Session

from controlplane.api import schemas
from controlplane.api.deps import (
    INT64_MAX,
    ReadableDeployment,
    SessionDep,
    SettingsDep,
    WritableDeployment,
    read_body_limited,
)
from controlplane.db.models import Deployment
from controlplane.errors import DomainError, PayloadTooLargeError, ValidationProblem
from controlplane.models.service import find_model
from controlplane.timestamps import utcnow
from controlplane.traces.formats import (
    MAX_DATASET_BYTES,
    TraceInput,
    TraceValidationError,
    parse_dataset,
    parse_trace_batch,
)
from controlplane.traces.service import MAX_PAGE_SIZE, StoreResult, list_traces, store_dataset, store_traces

router = APIRouter(prefix="/v1/accounts/{account}/deployments/{deployment}", tags=["traces"])

DATASET_MEDIA_TYPES = frozenset({"application/x-ndjson", "application/jsonl", "text/plain"})
_DATASET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")


class UnsupportedMediaTypeError(DomainError):
    status_code = 415


def _refusal(exc: TraceValidationError) -> DomainError:
    message = f"{exc.total} problem(s); nothing was stored: {exc}"
    if exc.too_large:
        return PayloadTooLargeError(message, details=exc.as_dicts())
    return ValidationProblem(message, details=exc.as_dicts())


_BATCH_BODY = {
    "required": True,
    "content": {
        "application/json": {
            "schema": {
                "type": "object",
                "required": ["traces"],
                "properties": {
                    "traces": {
                        "type": "array",
                        "maxItems": 1000,
                        "items": {
                            "type": "object",
                            "required": ["prompt", "completion"],
                            "properties": {
                                "prompt": {"type": "string", "description": "at most 64 KiB UTF-8"},
                                "completion": {"type": "string", "description": "at most 64 KiB UTF-8"},
                                "category": {"type": "string", "maxLength": 100, "nullable": True},
                                "document": {
                                    "type": "string",
                                    "maxLength": 200,
                                    "nullable": True,
                                    "description": "the source document the prompt was cut from: "
                                    "held-out evaluation keeps all of one document's prompts apart "
                                    "from training",
                                },
                            },
                        },
                    }
                },
            }
        }
    },
}
_DATASET_BODY = {
    "required": True,
    "content": {
        media_type: {"schema": {"type": "string", "description": "JSONL, one record per line"}}
        for media_type in sorted(DATASET_MEDIA_TYPES)
    },
}


def _chat_folder(session: Session, deployment: Deployment) -> str | None:
    """The deployment's registered target folder, whose chat template renders traced chats (None
    where the target is not registered or its folder is not on this machine)."""
    model = find_model(session=session, account_id=deployment.account_id, name=deployment.target_model)
    return model.location if model is not None and Path(model.location).is_dir() else None


@router.post("/traces", openapi_extra={"requestBody": _BATCH_BODY})
async def post_traces(
    account: str,
    deployment: WritableDeployment,
    request: Request,
    session: SessionDep,
    settings: SettingsDep,
) -> schemas.TraceBatchResult:
    """Store a batch of sampled prompt/completion traces, scrubbed of personal data.

    All or nothing: any bad trace refuses the batch (422; 413 for a size limit) with the index and
    field of every problem. The reply carries the deployment's sample rate for the serving side.
    """
    body = await read_body_limited(request, settings.max_body_bytes)

    def work() -> schemas.TraceBatchResult:
        try:
            items = parse_trace_batch(body)
        except TraceValidationError as exc:
            raise _refusal(exc) from exc
        folder = _chat_folder(session, deployment)
        result = store_traces(session=session, deployment_id=deployment.id, items=items, chat_folder=folder)
        session.commit()
        return schemas.TraceBatchResult.model_validate(
            {**result.as_dict(), "sample_rate": deployment.trace_sample_rate}
        )

    return await run_in_threadpool(work)


@router.post("/datasets", openapi_extra={"requestBody": _DATASET_BODY})
async def post_dataset(
    account: str,
    deployment: WritableDeployment,
    request: Request,
    session: SessionDep,
    name: str | None = Query(default=None, description="dataset name; a new upload replaces the old"),
) -> schemas.DatasetUploadResult:
    """Upload a JSONL sample dataset (prompt/completion, input/output or chat messages per line).

    All or nothing: a malformed line refuses the file (422) naming every bad line; over 50 MB or
    100,000 records is 413. Uploading under an existing name replaces that dataset.
    """
    media_type = (request.headers.get("content-type") or "").split(";", 1)[0].strip().lower()
    if media_type and media_type not in DATASET_MEDIA_TYPES:
        raise UnsupportedMediaTypeError(
            f"Content-Type {media_type!r} is not accepted; send {', '.join(sorted(DATASET_MEDIA_TYPES))}"
        )
    dataset_name = name if name is not None else f"upload-{utcnow():%Y%m%dT%H%M%SZ}"
    if not _DATASET_NAME.fullmatch(dataset_name):
        raise ValidationProblem(
            "name must be 1-200 letters, digits, '.', '_' or '-', starting with a letter or digit"
        )
    body = await read_body_limited(request, MAX_DATASET_BYTES)

    def work() -> StoreResult:
        try:
            items: list[TraceInput] = parse_dataset(body)
        except TraceValidationError as exc:
            raise _refusal(exc) from exc
        result = store_dataset(
            session=session,
            deployment_id=deployment.id,
            name=dataset_name,
            items=items,
            chat_folder=_chat_folder(session, deployment),
        )
        session.commit()
        return result

    result = await run_in_threadpool(work)
    return schemas.DatasetUploadResult.model_validate({"dataset_name": dataset_name, **result.as_dict()})


@router.get("/traces")
def get_traces(
    account: str,
    deployment: ReadableDeployment,
    session: SessionDep,
    limit: int = Query(default=100, ge=1, le=MAX_PAGE_SIZE),
    after_id: int = Query(default=0, ge=0, le=INT64_MAX),
) -> schemas.TracePage:
    """Stored traces (scrubbed text) in id order; pass ``next_after_id`` back for the next page."""
    page = list_traces(session=session, deployment_id=deployment.id, limit=limit, after_id=after_id)
    return schemas.TracePage(
        traces=[schemas.Trace.model_validate(trace) for trace in page.traces],
        next_after_id=page.next_after_id,
    )
