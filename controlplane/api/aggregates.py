"""The route edges send windows of aggregates to: one body per (edge, window), fleet-wide.

A thin adapter: read the body under the size limit, validate (controlplane.ingest.aggregates),
store once (controlplane.ingest.aggregate_store), commit, and nudge the drift monitor's shards.
Parsing and inserting tens of thousands of aggregates take a while, so they run off the event loop.
"""

from __future__ import annotations

import orjson
from fastapi import APIRouter, Request, Response
from fastapi.concurrency import run_in_threadpool

from controlplane import messaging
from controlplane.api.deps import DataWriter, SessionDep, SettingsDep, read_body_limited
from controlplane.db.models import Role
from controlplane.errors import ValidationProblem
from controlplane.ingest.aggregate_store import EdgeWindowResult, store_edge_window
from controlplane.ingest.aggregates import FORMAT, EdgeWindowError, parse_edge_window

router = APIRouter(prefix="/v1/accounts/{account}", tags=["acceptance"])

_BODY = {
    "required": True,
    "content": {
        "application/json": {
            "schema": {
                "type": "object",
                "required": ["edge_id", "window_start", "window_s", "aggregates"],
                "properties": {
                    "format": {"type": "string", "enum": [FORMAT]},
                    "edge_id": {"type": "string", "minLength": 1, "maxLength": 200},
                    "window_start": {"type": "string", "format": "date-time"},
                    "window_s": {"type": "integer", "minimum": 10, "maximum": 3600},
                    "aggregates": {"type": "array", "items": {"type": "object"}},
                },
            }
        }
    },
}


@router.post("/aggregates", response_model=EdgeWindowResult, openapi_extra={"requestBody": _BODY})
async def ingest_edge_window(
    account: str,
    request: Request,
    principal: DataWriter,
    session: SessionDep,
    settings: SettingsDep,
) -> Response:
    """Store one edge's window of per-deployment aggregates (format ``edge-window/v1``).

    Idempotent per (edge id, window): a retry of a stored window answers ``duplicate: true`` and
    stores nothing; a different body for a stored window is a 409. All or nothing: any invalid
    aggregate or unknown deployment refuses the whole window (422, every problem listed).
    """
    body = await read_body_limited(request, settings.max_body_bytes)
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ValidationProblem(f"body is not valid JSON: {exc}") from exc

    def work() -> EdgeWindowResult:
        try:
            window = parse_edge_window(payload)
        except EdgeWindowError as exc:
            details = list(exc.problems)
            if exc.more:
                details.append({"field": "(more)", "message": f"{exc.more} more problem(s)"})
            raise ValidationProblem("the window is invalid; nothing was stored", details=details) from exc
        result = store_edge_window(
            session=session,
            account_id=principal.account_id,
            window=window,
            from_serving_key=principal.role is Role.serving,
        )
        session.commit()
        return result

    result = await run_in_threadpool(work)
    sender = request.app.state.task_sender
    if result.stored and sender is not None:
        sender.send_throttled("drift:aggregates", messaging.TaskMessage(messaging.DRIFT_MONITOR_ALL, ()))
    return Response(orjson.dumps(result.as_dict()), media_type="application/json")
