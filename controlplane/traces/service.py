"""Trace storage: scrubbed on the way in, all or nothing, paged out by id, deleted by retention.

Owns every write to and read of the ``traces`` table. Text is scrubbed (controlplane.traces.scrub)
before it reaches the session, so nothing unscrubbed is ever flushed, logged by the database or
kept in a failed transaction. Functions take a session and never commit: the caller owns the
transaction, which is what makes a batch or a file all or nothing.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Final, cast

from sqlalchemy import CursorResult, Delete, delete, insert, select
from sqlalchemy.orm import Session

from controlplane.db.models import Deployment, Trace, TraceSource
from controlplane.timestamps import as_utc, utcnow
from controlplane.traces.chat_template import InvalidMessages, TemplateError, render_chat
from controlplane.traces.formats import MAX_CATEGORY_CHARS, MAX_TRACE_RETENTION_DAYS, TraceInput
from controlplane.traces.scrub import Entity, scrub, scrub_trace

MAX_PAGE_SIZE: Final = 1_000
# Rows per INSERT statement: large enough to amortise round trips, small enough for SQLite's
# bound-parameter limit and for PostgreSQL's statement size with 64 KB texts.
_INSERT_CHUNK: Final = 500


@dataclass(frozen=True, slots=True)
class StoreResult:
    """What a batch or dataset upload stored, and how many entities were scrubbed, per kind."""

    stored: int
    scrubbed: dict[str, int]
    replaced: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {"stored": self.stored, "scrubbed": self.scrubbed, "replaced": self.replaced}


@dataclass(frozen=True, slots=True)
class TracePage:
    """One page of traces in id order; ``next_after_id`` is None on the last page."""

    traces: list[dict[str, Any]] = field(default_factory=list)
    next_after_id: int | None = None


def _execute_dml(session: Session, statement: Delete) -> int:
    """Run a bulk DELETE as plain SQL (no ORM objects loaded or synchronised); rows affected."""
    result = session.execute(statement.execution_options(synchronize_session=False))
    return int(cast(CursorResult[Any], result).rowcount or 0)


def store_traces(
    *,
    session: Session,
    deployment_id: int,
    items: Sequence[TraceInput],
    source: TraceSource = TraceSource.sampled,
    dataset_name: str | None = None,
    now: datetime | None = None,
    chat_folder: str | None = None,
) -> StoreResult:
    """Scrub and add every item in the caller's transaction; count the entities scrubbed. A chat
    is stored as the prompt the target was given: rendered with the chat template of
    ``chat_folder``, the deployment's target folder (the plain rendering where there is none, or
    where its template refuses the conversation)."""
    created_at = as_utc(now or utcnow())
    totals = dict.fromkeys((entity.value for entity in Entity), 0)
    rows: list[dict[str, Any]] = []

    def stored_document(label: str) -> str:
        # A document label is an identity, not text to read: the held-out split compares it to
        # keep all of one document's prompts on one side. A label holding personal data is stored
        # as its digest, which keeps that identity without the value (a surrogate drawn per trace
        # would make one document many).
        counts = scrub(label).counts
        for entity, count in counts.items():
            totals[entity.value] += count
        return "sha256:" + hashlib.sha256(label.encode()).hexdigest() if any(counts.values()) else label

    for item in items:
        # One trace's texts together: a value gets the same surrogate in prompt and completion.
        prompt = _as_served(item, chat_folder)
        texts = [prompt, item.completion] + ([item.category] if item.category is not None else [])
        results = scrub_trace(texts)
        for result in results:
            for entity, count in result.counts.items():
                totals[entity.value] += count
        category = results[2].text if item.category is not None else None
        rows.append(
            {
                "deployment_id": deployment_id,
                "created_at": created_at,
                "source": source,
                "dataset_name": dataset_name,
                # A surrogate can be longer than what it replaced; the column is not.
                "category": category[:MAX_CATEGORY_CHARS] if category is not None else None,
                "document": stored_document(item.document) if item.document is not None else None,
                "prompt": results[0].text,
                "completion": results[1].text,
            }
        )
    for start in range(0, len(rows), _INSERT_CHUNK):
        session.execute(insert(Trace), rows[start : start + _INSERT_CHUNK])
    return StoreResult(stored=len(rows), scrubbed=totals)


def _as_served(item: TraceInput, folder: str | None) -> str:
    """A trace's prompt as the target saw it: a chat rendered with the target's chat template."""
    if item.messages is None or folder is None:
        return item.prompt
    try:
        return render_chat(folder, item.messages)
    except (InvalidMessages, TemplateError):
        # A conversation the template refuses could not have been served with it: the plain
        # rendering keeps the trace's text rather than losing it.
        return item.prompt


def store_dataset(
    *,
    session: Session,
    deployment_id: int,
    name: str,
    items: Sequence[TraceInput],
    now: datetime | None = None,
    chat_folder: str | None = None,
) -> StoreResult:
    """Store an uploaded sample dataset, replacing any earlier upload of the same name (chats
    rendered as :func:`store_traces` renders them)."""
    removed = _execute_dml(
        session,
        delete(Trace).where(Trace.deployment_id == deployment_id, Trace.dataset_name == name),
    )
    stored = store_traces(
        session=session,
        deployment_id=deployment_id,
        items=items,
        source=TraceSource.dataset,
        dataset_name=name,
        now=now,
        chat_folder=chat_folder,
    )
    return StoreResult(stored=stored.stored, scrubbed=stored.scrubbed, replaced=removed)


def apply_retention(*, session: Session, now: datetime) -> dict[int, int]:
    """Delete traces older than their deployment's retention; deleted rows per deployment id.

    One indexed DELETE per deployment (deployment_id, created_at): no row is loaded into Python.
    Soft-deleted deployments keep their retention: their traces age out like any other.
    """
    deleted: dict[int, int] = {}
    moment = as_utc(now)
    deployments = session.execute(select(Deployment.id, Deployment.trace_retention_days)).all()
    for deployment_id, retention_days in deployments:
        # Clamped, so that a value stored before retention was bounded cannot stop every
        # deployment's cleanup with an overflowing date.
        days = min(max(int(retention_days), 1), MAX_TRACE_RETENTION_DAYS)
        count = _execute_dml(
            session,
            delete(Trace).where(
                Trace.deployment_id == deployment_id,
                Trace.created_at < moment - timedelta(days=days),
            ),
        )
        if count:
            deleted[deployment_id] = count
    return deleted


def describe_trace(trace: Trace) -> dict[str, Any]:
    """A stored trace as the API shows it (already scrubbed)."""
    return {
        "id": trace.id,
        "created_at": as_utc(trace.created_at).isoformat(),
        "source": trace.source.value,
        "dataset_name": trace.dataset_name,
        "category": trace.category,
        "document": trace.document,
        "prompt": trace.prompt,
        "completion": trace.completion,
    }


def list_traces(*, session: Session, deployment_id: int, limit: int = 100, after_id: int = 0) -> TracePage:
    """Up to ``limit`` traces of the deployment with ids above ``after_id``, in id order."""
    limit = max(1, min(limit, MAX_PAGE_SIZE))
    rows = list(
        session.scalars(
            select(Trace)
            .where(Trace.deployment_id == deployment_id, Trace.id > after_id)
            .order_by(Trace.id)
            .limit(limit)
        )
    )
    return TracePage(
        traces=[describe_trace(row) for row in rows],
        next_after_id=rows[-1].id if len(rows) == limit else None,
    )
