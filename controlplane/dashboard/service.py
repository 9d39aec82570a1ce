"""Read models for the web dashboard: one query function per page, all scoped to one account.

Every figure comes from the per-minute rollups and their coarser tiers (through
``controlplane.stats.service``), never from the raw acceptance table, so a page costs the same over
ten records as over ten million. Canaries are read straight from the ``canaries`` table and their
``arms`` JSON is handed on as stored: the page renders whatever the canary service put there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

from sqlalchemy import Select, func, or_, select
from sqlalchemy.orm import Session

from controlplane.audit.service import entry_summary
from controlplane.canary.tuning_view import measured_costs, verify_cost_of
from controlplane.db.models import (
    AcceptanceRollupRow,
    AuditEntry,
    Canary,
    Deployment,
    DrafterVersion,
    DriftEvent,
    DriftState,
    Job,
    JobState,
)
from controlplane.deployments.lookup import resource_name
from controlplane.errors import ValidationProblem
from controlplane.ingest.service import fold_before_reading
from controlplane.jobs.service import job_summary
from controlplane.loop.deployments import describe
from controlplane.speculation_math import ASSUMED_DRAFTER_COST_RATIO, speedup_from_hit_rate
from controlplane.stats.service import acceptance_series
from controlplane.timestamps import as_utc
from controlplane.tuning.draft_length import verify_cost_at, verify_cost_function

SelectT = TypeVar("SelectT", bound=Select[*tuple[Any, ...]])


@dataclass(frozen=True, slots=True)
class TimeRange:
    """A range the deployment page offers, and the bucket that keeps it to a few hundred points."""

    seconds: int
    bucket_seconds: int


# Each range's bucket is one rollup tier (60 s, 5 min, 1 h, 6 h), so a bucket is one row per arm
# and drafter version, whose stored percentiles need no histogram merge.
RANGES: dict[str, TimeRange] = {
    "1h": TimeRange(3600, 60),
    "6h": TimeRange(6 * 3600, 300),
    "24h": TimeRange(24 * 3600, 300),
    "7d": TimeRange(7 * 86400, 3600),
    "30d": TimeRange(30 * 86400, 6 * 3600),
}
DEFAULT_RANGE = "24h"
CURRENT_WINDOW = timedelta(hours=1)
BASELINE_ARM = "baseline"
# Audit actions that move the active drafter (written by the canary service).
PROMOTION_ACTION_WORDS = ("promote", "activate")
ROLLBACK_ACTION_WORDS = ("rollback",)
MAX_MARKERS_PER_KIND = 200
SERIES_FIELDS = (
    "start",
    "requests",
    "hit_rate",
    "mean_accepted_length",
    "inter_token_latency_ms_p50",
    "inter_token_latency_ms_p95",
    "total_latency_ms_p50",
    "total_latency_ms_p95",
    "throughput_tokens_per_s",
    "decode_tokens_per_s",
)


def _iso(value: datetime | None) -> str | None:
    aware = as_utc(value)
    return aware.isoformat() if aware else None


def resolve_range(*, name: str, end: datetime | None, now: datetime) -> tuple[datetime, datetime, int]:
    """(start, end, bucket seconds) for a named range ending at ``end`` (default: now).

    The end is rounded up to the bucket grid so that buckets line up with the rollup tiers (the
    fast path) and the current, partial bucket is included.
    """
    chosen = RANGES.get(name)
    if chosen is None:
        raise ValidationProblem(f"unknown range {name!r}; choose one of {sorted(RANGES)}")
    anchor = (as_utc(end) or now).timestamp()
    grid = chosen.bucket_seconds
    end_at = datetime.fromtimestamp(math.ceil(anchor / grid) * grid, tz=UTC)
    if end is None and end_at.timestamp() == anchor:
        end_at += timedelta(seconds=grid)  # "now" exactly on the grid: keep the current bucket
    return end_at - timedelta(seconds=chosen.seconds), end_at, grid


def estimate_costs(session: Session, deployment_id: int, k: int | None) -> tuple[float, float, str]:
    """(drafter cost ratio c, verify cost of k + 1 tokens, where they come from) for the speed-up
    estimate: the newest shadow replay's measurement, else the assumed ratio and a free verify."""
    costs = measured_costs(session, deployment_id)
    verify = verify_cost_of(costs)
    verify_cost = verify_cost_at(verify_cost_function(verify), k) if verify and k else 1.0
    return float(costs["cost_ratio"]), verify_cost, str(costs["source"])


def _slim(bucket: dict[str, Any]) -> dict[str, Any]:
    return {name: bucket.get(name) for name in SERIES_FIELDS}


def overview(*, session: Session, account_id: int, account_name: str, now: datetime) -> dict[str, Any]:
    """Every live deployment of the account with its current figures, open drift and running jobs."""
    deployments = list(
        session.scalars(
            select(Deployment)
            .where(Deployment.account_id == account_id, Deployment.deleted_at.is_(None))
            .order_by(Deployment.name)
        )
    )
    ids = [d.id for d in deployments]
    open_drift = _count_by_deployment(
        session, DriftEvent, ids, DriftEvent.state.in_([DriftState.open, DriftState.realigning])
    )
    running_jobs = _count_by_deployment(session, Job, ids, Job.state.in_([JobState.queued, JobState.running]))
    rows = []
    fold_before_reading(session=session, deployment_ids=ids)  # once for every row below
    for deployment in deployments:
        info = describe(session=session, deployment=deployment, account_name=account_name)
        current = acceptance_series(
            session=session,
            fold_pending=False,
            deployment_id=deployment.id,
            start=now - CURRENT_WINDOW,
            end=now,
            bucket_seconds=int(CURRENT_WINDOW.total_seconds()),
            percentiles=False,  # the overview shows counts and ratios only
        )["total"]
        k = info["effective_draft_token_count"]
        cost_ratio, verify_cost, cost_source = estimate_costs(session, deployment.id, k)
        rows.append(
            {
                "deployment_id": deployment.name,
                "display_name": deployment.display_name,
                "target_model": deployment.target_model,
                "speculation_mode": info["speculation_mode"],
                "active_drafter_version": info["active_drafter_version"],
                "k": k,
                "requests_last_hour": current["requests"],
                "hit_rate": current["hit_rate"],
                "mean_accepted_length": current["mean_accepted_length"],
                "speedup_estimate": speedup_from_hit_rate(current["hit_rate"], k, cost_ratio, verify_cost),
                "draft_cost_ratio": cost_ratio,
                "draft_cost_source": cost_source,
                "open_drift_events": open_drift.get(deployment.id, 0),
                "running_jobs": running_jobs.get(deployment.id, 0),
            }
        )
    return {
        "account": account_name,
        "generated_at": now.isoformat(),
        "current_window_s": int(CURRENT_WINDOW.total_seconds()),
        "assumed_draft_cost_ratio": ASSUMED_DRAFTER_COST_RATIO,
        "deployments": rows,
    }


def _count_by_deployment(session: Session, model: Any, ids: list[int], condition: Any) -> dict[int, int]:
    if not ids:
        return {}
    query = (
        select(model.deployment_id, func.count())
        .where(model.deployment_id.in_(ids), condition)
        .group_by(model.deployment_id)
    )
    return {deployment_id: int(count) for deployment_id, count in session.execute(query)}


def deployment_view(
    *,
    session: Session,
    deployment: Deployment,
    account_name: str,
    range_name: str,
    end: datetime | None,
    now: datetime,
) -> dict[str, Any]:
    """The deployment page's data in one request: the series, markers, per-position acceptance and
    the figures of each request category."""
    start_at, end_at, bucket_seconds = resolve_range(name=range_name, end=end, now=now)
    series = acceptance_series(
        session=session,
        deployment_id=deployment.id,
        start=start_at,
        end=end_at,
        bucket_seconds=bucket_seconds,
        per_category=True,
    )
    current = acceptance_series(
        session=session,
        deployment_id=deployment.id,
        start=end_at - CURRENT_WINDOW,
        end=end_at,
        bucket_seconds=int(CURRENT_WINDOW.total_seconds()),
        percentiles=False,  # read for its per-position acceptance only
        fold_pending=False,  # the series above folded
    )["total"]
    last_event = session.scalar(
        select(DriftEvent).where(DriftEvent.deployment_id == deployment.id).order_by(DriftEvent.id.desc())
    )
    event_baseline = (last_event.evidence or {}).get("baseline_per_position") if last_event else None
    info = describe(session=session, deployment=deployment, account_name=account_name)
    return {
        "deployment": info,
        "range": {
            "name": range_name,
            "start": start_at.isoformat(),
            "end": end_at.isoformat(),
            "bucket_seconds": bucket_seconds,
        },
        "series": [_slim(bucket) for bucket in series["buckets"]],
        "total": _slim(series["total"]),
        "positions": {
            # Conditional per-trial acceptance, the same scale as the drift detector's baseline.
            "current": current["per_position_conditional_acceptance"],
            "current_window_s": int(CURRENT_WINDOW.total_seconds()),
            "range": series["total"]["per_position_conditional_acceptance"],
            "last_drift_event_baseline": event_baseline if isinstance(event_baseline, list) else None,
        },
        "markers": markers(
            session=session,
            deployment=deployment,
            account_name=account_name,
            start=start_at,
            end=end_at,
            now=now,
        ),
        "categories": category_rows(
            series["per_category"],
            k=info["effective_draft_token_count"],
            costs=estimate_costs(session, deployment.id, info["effective_draft_token_count"])[:2],
        ),
    }


def category_rows(
    per_category: list[dict[str, Any]], *, k: int | None, costs: tuple[float, float]
) -> list[dict[str, Any]]:
    """The per-category table: requests, hit rate, and speed-up against no speculation, measured
    where the category has no-speculation records in the range, else Leviathan's estimate from
    ``costs`` (drafter cost ratio, verify cost of k + 1 tokens)."""
    return [
        {
            "category": figures["category"],
            "requests": figures["requests"],
            "hit_rate": figures["hit_rate"],
            "mean_accepted_length": figures["mean_accepted_length"],
            "no_speculation_requests": figures["no_speculation_requests"],
            "speedup_vs_no_speculation": figures["speedup_vs_no_speculation"],
            "speedup_estimate": speedup_from_hit_rate(figures["hit_rate"], k, *costs),
        }
        for figures in per_category
    ]


def markers(
    *,
    session: Session,
    deployment: Deployment,
    account_name: str,
    start: datetime,
    end: datetime,
    now: datetime,
) -> list[dict[str, Any]]:
    """Drift events, jobs, canary windows, promotions and rollbacks that touch [start, end)."""
    out: list[dict[str, Any]] = []
    # Plain column rows, not ORM objects: the tables also carry evidence, figures and results as
    # JSON that would be decoded on every refresh for nothing, and building entities costs more
    # than the queries themselves (about 2 ms per query against 0.3 ms in PostgreSQL).
    events = session.execute(
        select(
            DriftEvent.id,
            DriftEvent.detected_at,
            DriftEvent.state,
            DriftEvent.drop,
            DriftEvent.resolution,
            DriftEvent.resolution_reason,
        )
        .where(
            DriftEvent.deployment_id == deployment.id,
            DriftEvent.detected_at >= start,
            DriftEvent.detected_at < end,
        )
        .order_by(DriftEvent.detected_at)
        .limit(MAX_MARKERS_PER_KIND)
    )
    for event in events:
        drop = f", drop {event.drop:.3f}" if event.drop is not None else ""
        ended = f": {event.resolution.value}" if event.resolution is not None else ""
        reason = f" ({_short(event.resolution_reason)})" if event.resolution_reason else ""
        out.append(
            {
                "kind": "drift",
                "at": _iso(event.detected_at),
                "end": None,
                "label": f"drift #{event.id} ({event.state.value}{ended}{drop}){reason}",
            }
        )
    jobs = session.execute(
        select(Job.id, Job.kind, Job.state, Job.progress, Job.created_at, Job.started_at, Job.finished_at)
        .where(
            Job.deployment_id == deployment.id,
            Job.created_at < end,
            func.coalesce(Job.finished_at, now) >= start,
        )
        .order_by(Job.created_at)
        .limit(MAX_MARKERS_PER_KIND)
    )
    for job in jobs:
        out.append(
            {
                "kind": "job",
                "at": _iso(job.started_at or job.created_at),
                "end": _iso(job.finished_at or now),
                "label": f"{job.kind.value} job #{job.id} ({job.state.value}, {job.progress:.0%})",
            }
        )
    canaries = session.execute(
        select(Canary.id, Canary.started_at, Canary.decided_at, Canary.phase, Canary.decision)
        .where(
            Canary.deployment_id == deployment.id,
            Canary.started_at < end,
            func.coalesce(Canary.decided_at, now) >= start,
        )
        .order_by(Canary.started_at)
        .limit(MAX_MARKERS_PER_KIND)
    )
    for canary in canaries:
        out.append(
            {
                "kind": "canary",
                "at": _iso(canary.started_at),
                "end": _iso(canary.decided_at or now),
                "label": f"canary #{canary.id} ({canary.phase}, {canary.decision or 'undecided'})",
            }
        )
    moves = _drafter_moves_query(
        select(AuditEntry.id, AuditEntry.action, AuditEntry.actor, AuditEntry.created_at),
        account_id=deployment.account_id,
        prefix=resource_name(account_name, deployment.name),
        start=start,
        end=end,
    )
    for entry in sorted(session.execute(moves.limit(MAX_MARKERS_PER_KIND)), key=lambda row: row.id):
        action = entry.action.lower()
        kind = "rollback" if any(word in action for word in ROLLBACK_ACTION_WORDS) else "promotion"
        out.append(
            {
                "kind": kind,
                "at": _iso(entry.created_at),
                "end": None,
                "label": f"{entry.action} by {entry.actor}",
            }
        )
    return out


def _drafter_moves_query(
    query: SelectT,
    *,
    account_id: int,
    prefix: str,
    start: datetime | None = None,
    end: datetime | None = None,
) -> SelectT:
    """``query`` narrowed to audit rows that promoted or rolled back a drafter of one deployment,
    newest first."""
    words = PROMOTION_ACTION_WORDS + ROLLBACK_ACTION_WORDS
    query = query.where(
        AuditEntry.account_id == account_id,
        # The deployment itself or a path below it ("chat" must not match "chat-2").
        or_(AuditEntry.resource == prefix, AuditEntry.resource.startswith(prefix + "/", autoescape=True)),
        or_(*(func.lower(AuditEntry.action).contains(word, autoescape=True) for word in words)),
    )
    if start is not None:
        query = query.where(AuditEntry.created_at >= start)
    if end is not None:
        query = query.where(AuditEntry.created_at < end)
    return query.order_by(AuditEntry.id.desc())


def _drafter_moves(session: Session, *, account_id: int, prefix: str, limit: int) -> list[AuditEntry]:
    """Audit rows that promoted or rolled back a drafter of one deployment, oldest first."""
    query = _drafter_moves_query(select(AuditEntry), account_id=account_id, prefix=prefix)
    return sorted(session.scalars(query.limit(limit)), key=lambda row: row.id)


def promotion_history(
    *, session: Session, deployment: Deployment, account_name: str, limit: int = 100
) -> dict[str, Any]:
    """A deployment's drafter versions and every promotion or rollback, newest first."""
    versions = session.scalars(
        select(DrafterVersion)
        .where(DrafterVersion.deployment_id == deployment.id)
        .order_by(DrafterVersion.version.desc())
    )
    moves = _drafter_moves(
        session,
        account_id=deployment.account_id,
        prefix=resource_name(account_name, deployment.name),
        limit=limit,
    )
    return {
        "versions": [
            {
                "version": v.version,
                "state": v.state.value,
                "created_at": _iso(v.created_at),
                "activated_at": _iso(v.activated_at),
                "training_job_id": v.training_job_id,
            }
            for v in versions
        ],
        "moves": [entry_summary(e) for e in reversed(moves)],
    }


def account_jobs(*, session: Session, account_id: int, limit: int = 200) -> dict[str, Any]:
    """The account's jobs across deployments, active ones first, then the newest."""
    rows = session.execute(
        select(Job, Deployment.name)
        .join(Deployment, Deployment.id == Job.deployment_id)
        .where(Deployment.account_id == account_id)
        .order_by(Job.state.in_([JobState.queued, JobState.running]).desc(), Job.id.desc())
        .limit(max(1, min(limit, 500)))
    )
    return {"jobs": [{**job_summary(job), "deployment": name, "log": _job_log(job)} for job, name in rows]}


def _short(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _job_log(job: Job) -> list[str]:
    """The job's history as log lines, from the timestamps and messages the job row keeps."""
    lines = [f"{_iso(job.created_at)} created by {job.requested_by}"]
    if job.started_at:
        lines.append(f"{_iso(job.started_at)} started (attempt {job.attempts})")
    if job.progress_message:
        lines.append(f"progress {job.progress:.0%}: {job.progress_message}")
    if job.state == JobState.running and job.lease_expires_at:
        lines.append(f"lease held until {_iso(job.lease_expires_at)} (heartbeat {_iso(job.heartbeat_at)})")
    if job.state == JobState.queued and job.next_attempt_at:
        lines.append(f"next attempt not before {_iso(job.next_attempt_at)}")
    if job.finished_at:
        lines.append(f"{_iso(job.finished_at)} {job.state.value}")
    if job.error:
        lines.append(f"error: {job.error}")
    return lines


def canaries_view(
    *, session: Session, deployment: Deployment, now: datetime, limit: int = 20
) -> dict[str, Any]:
    """The deployment's canaries, newest first, and per-arm series over the newest one's window."""
    canaries = list(
        session.scalars(
            select(Canary)
            .where(Canary.deployment_id == deployment.id)
            .order_by(Canary.id.desc())
            .limit(max(1, min(limit, 100)))
        )
    )
    version_ids = {c.candidate_version_id for c in canaries} | {
        c.incumbent_version_id for c in canaries if c.incumbent_version_id is not None
    }
    numbers: dict[int, int] = {}
    if version_ids:
        query = select(DrafterVersion.id, DrafterVersion.version).where(DrafterVersion.id.in_(version_ids))
        numbers = {row.id: row.version for row in session.execute(query)}
    summaries = [
        {
            "canary_id": c.id,
            "phase": c.phase,
            "candidate_version": numbers.get(c.candidate_version_id),
            "incumbent_version": numbers.get(c.incumbent_version_id) if c.incumbent_version_id else None,
            "job_id": c.job_id,
            "routing_weights": c.routing_weights,
            "arms": c.arms,
            "decision": c.decision,
            "reason": c.reason,
            "started_at": _iso(c.started_at),
            "decided_at": _iso(c.decided_at),
        }
        for c in canaries
    ]
    arm_series: dict[str, list[dict[str, Any]]] = {}
    window: dict[str, Any] | None = None
    if canaries:
        newest = canaries[0]
        started = as_utc(newest.started_at) or now
        finished = as_utc(newest.decided_at) or now
        arm_series, window = _arm_series(session, deployment.id, started, finished)
    return {"canaries": summaries, "arm_series": arm_series, "arm_window": window}


def _arm_series(
    session: Session, deployment_id: int, started: datetime, finished: datetime
) -> tuple[dict[str, list[dict[str, Any]]], dict[str, Any]]:
    """Hit rate, accepted length, tokens/s and latency per serving arm over a canary's window."""
    start = started.replace(second=0, microsecond=0)
    end = max(finished, start + timedelta(minutes=1))
    span = (end - start).total_seconds()
    # About 120 points whatever the window, in whole minutes.
    bucket = max(60, math.ceil(span / 120 / 60) * 60)
    end = start + timedelta(seconds=math.ceil(span / bucket) * bucket)
    fold_before_reading(session=session, deployment_ids=[deployment_id])  # arms of deferred sums too
    arms = session.scalars(
        select(AcceptanceRollupRow.arm)
        .where(
            AcceptanceRollupRow.deployment_id == deployment_id,
            AcceptanceRollupRow.resolution_s == 60,
            AcceptanceRollupRow.bucket_start >= start,
            AcceptanceRollupRow.bucket_start < end,
        )
        .distinct()
    )
    out = {}
    for arm in sorted(arms):
        series = acceptance_series(
            session=session,
            deployment_id=deployment_id,
            start=start,
            end=end,
            bucket_seconds=bucket,
            arm=arm,
            fold_pending=False,  # folded above
        )
        out[arm] = [_slim(b) for b in series["buckets"]]
    return out, {"start": start.isoformat(), "end": end.isoformat(), "bucket_seconds": bucket}
