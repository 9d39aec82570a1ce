"""Prometheus metrics for one account, computed from the database on every scrape.

Nothing is counted in process memory: the rollups, jobs, drift events, canaries and audit log
already hold every figure, so each API worker answers a scrape with the same numbers, restarts
lose nothing, and no multiprocess directory is needed. A scrape reads aggregates only (the daily
rollup tier for all-time counters, the minute tier for the last five minutes), so it costs the same
over ten records as over ten million.

Names follow Prometheus conventions: a ``specctl_`` prefix, base units in the name (``_seconds``,
``_ratio``, ``_tokens``), ``_total`` on counters, and labels for the dimensions (account,
deployment, arm, category, kind, state, decision). The request category comes from clients; its
values are bounded by the rollups' per-deployment cap (controlplane.ingest.rollups), so it
cannot explode the series count.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from datetime import datetime, timedelta

from prometheus_client.core import (
    CollectorRegistry,
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import generate_latest
from sqlalchemy import func, or_, select
from sqlalchemy.orm import Session

from controlplane.canary.service import evaluation_error_count
from controlplane.config import Settings
from controlplane.db.models import (
    AcceptanceRollupRow,
    AuditEntry,
    Canary,
    Deployment,
    DriftEvent,
    DriftState,
    Job,
    JobState,
)
from controlplane.deployments.lookup import resource_name
from controlplane.drafters.service import active_drafter
from controlplane.ingest.service import fold_before_reading, quarantined_counts
from controlplane.loop.drift import monitor_status
from controlplane.speculation_check.metrics import speculation_families
from controlplane.speculation_math import hit_rate, mean_accepted_length
from controlplane.timestamps import as_utc

DAY = 86400
RECENT_WINDOW = timedelta(minutes=5)
# Realignment runs for minutes to hours; canary replays for seconds to minutes.
JOB_DURATION_BUCKETS = (10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0, 7200.0, 21600.0)
PROMOTION_WORDS = ("promote", "activate")
ROLLBACK_WORDS = ("rollback",)


class _Families:
    """A fixed list of metric families, in the shape a CollectorRegistry collects from."""

    def __init__(self, families: Sequence[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


def exposition(families: Sequence[Metric]) -> bytes:
    """The Prometheus text exposition of ``families``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families))
    return generate_latest(registry)


def account_metrics(
    *, session: Session, account_id: int, account_name: str, settings: Settings, now: datetime
) -> list[Metric]:
    """Every metric family for one account's live deployments."""
    began = time.perf_counter()
    deployments = list(
        session.scalars(
            select(Deployment)
            .where(Deployment.account_id == account_id, Deployment.deleted_at.is_(None))
            .order_by(Deployment.id)
        )
    )
    names = {d.id: d.name for d in deployments}
    # The rollups below then count every acknowledged record.
    fold_before_reading(session=session, deployment_ids=list(names))
    families: list[Metric] = []
    families += _acceptance_totals(session, account_name, names)
    families += _acceptance_recent(session, account_name, names, now)
    families.append(_rollup_quarantine(session, account_name, names))
    families += _drafters_and_drift(session, account_name, deployments, settings)
    families += _jobs(session, account_name, names, now)
    families += _canaries(session, account_name, names)
    families += _drafter_moves(session, account_id, account_name, names)
    families += speculation_families(
        session=session, account_id=account_id, account=account_name, names=names
    )
    scrape = GaugeMetricFamily(
        "specctl_metrics_scrape_duration_seconds",
        "Time this API process took to compute the account's metrics from the database.",
        labels=["account"],
    )
    scrape.add_metric([account_name], time.perf_counter() - began)
    families.append(scrape)
    return families


def _acceptance_totals(session: Session, account: str, names: dict[int, str]) -> list[Metric]:
    labels = ["account", "deployment", "arm"]
    records = CounterMetricFamily(
        "specctl_acceptance_records",
        "Acceptance records ingested (one per served request); rate() gives the ingest rate.",
        labels=labels,
    )
    drafted = CounterMetricFamily("specctl_drafted_tokens", "Draft tokens proposed.", labels=labels)
    accepted = CounterMetricFamily(
        "specctl_accepted_tokens", "Draft tokens the target accepted.", labels=labels
    )
    generated = CounterMetricFamily("specctl_generated_tokens", "Tokens generated.", labels=labels)
    families: list[Metric] = [records, drafted, accepted, generated]
    if not names:
        return families
    r = AcceptanceRollupRow
    # The daily tier holds every record exactly once, in a handful of rows per deployment and arm.
    rows = session.execute(
        select(
            r.deployment_id,
            r.arm,
            func.sum(r.requests),
            func.sum(r.drafted_tokens),
            func.sum(r.accepted_tokens),
            func.sum(r.generated_tokens),
        )
        .where(r.deployment_id.in_(list(names)), r.resolution_s == DAY)
        .group_by(r.deployment_id, r.arm)
        .order_by(r.deployment_id, r.arm)
    )
    for deployment_id, arm, n, draft, accept, gen in rows:
        key = [account, names[deployment_id], arm]
        records.add_metric(key, float(n or 0))
        drafted.add_metric(key, float(draft or 0))
        accepted.add_metric(key, float(accept or 0))
        generated.add_metric(key, float(gen or 0))
    return families


def _rollup_quarantine(session: Session, account: str, names: dict[int, str]) -> Metric:
    quarantined = CounterMetricFamily(
        "specctl_rollup_records_quarantined",
        "Stored acceptance records the rollup fold could not sum and set aside (in no figure).",
        labels=["account", "deployment"],
    )
    counts = quarantined_counts(session=session, deployment_ids=list(names))
    for deployment_id, name in names.items():
        quarantined.add_metric([account, name], float(counts.get(deployment_id, 0)))
    return quarantined


def _acceptance_recent(session: Session, account: str, names: dict[int, str], now: datetime) -> list[Metric]:
    labels = ["account", "deployment", "arm"]
    window = int(RECENT_WINDOW.total_seconds() // 60)
    hit = GaugeMetricFamily(
        "specctl_hit_ratio",
        f"Hit rate (accepted / drafted draft tokens) over the last {window} minutes of rollups.",
        labels=labels,
    )
    length = GaugeMetricFamily(
        "specctl_accepted_length_tokens",
        f"Mean tokens per target verify step (1 + accepted / steps) over the last {window} minutes.",
        labels=labels,
    )
    by_category = GaugeMetricFamily(
        "specctl_category_hit_ratio",
        f'Hit rate per request category over the last {window} minutes of rollups (category "": '
        'requests without one; "other": categories past the per-deployment cap).',
        labels=[*labels, "category"],
    )
    if not names:
        return [hit, length, by_category]
    r = AcceptanceRollupRow
    since = (now - RECENT_WINDOW).replace(second=0, microsecond=0)
    rows = session.execute(
        select(
            r.deployment_id,
            r.arm,
            r.category,
            func.sum(r.drafted_tokens),
            func.sum(r.accepted_tokens),
            func.sum(r.verify_steps),
        )
        .where(r.deployment_id.in_(list(names)), r.resolution_s == 60, r.bucket_start >= since)
        .group_by(r.deployment_id, r.arm, r.category)
        .order_by(r.deployment_id, r.arm, r.category)
    )
    # Per (deployment, arm): drafted, accepted, verify steps over every category.
    per_arm: dict[tuple[int, str], list[int]] = {}
    for deployment_id, arm, category, draft, accept, steps in rows:
        sums = per_arm.setdefault((deployment_id, arm), [0, 0, 0])
        sums[0] += int(draft or 0)
        sums[1] += int(accept or 0)
        sums[2] += int(steps or 0)
        category_rate = hit_rate(int(accept or 0), int(draft or 0))
        if category_rate is not None:
            by_category.add_metric([account, names[deployment_id], arm, category], category_rate)
    for (deployment_id, arm), (draft, accept, steps) in per_arm.items():
        key = [account, names[deployment_id], arm]
        rate, accepted_length = hit_rate(accept, draft), mean_accepted_length(accept, steps)
        if rate is not None:
            hit.add_metric(key, rate)
        if accepted_length is not None:
            length.add_metric(key, accepted_length)
    return [hit, length, by_category]


def _drafters_and_drift(
    session: Session, account: str, deployments: list[Deployment], settings: Settings
) -> list[Metric]:
    labels = ["account", "deployment"]
    version = GaugeMetricFamily(
        "specctl_active_drafter_version", "Version number of the deployment's active drafter.", labels=labels
    )
    statistic = GaugeMetricFamily(
        "specctl_drift_statistic",
        "The drift detector's statistic (log scale); it alarms at the threshold.",
        labels=labels,
    )
    threshold = GaugeMetricFamily(
        "specctl_drift_threshold", "The drift detector's alarm threshold.", labels=labels
    )
    opened = GaugeMetricFamily(
        "specctl_drift_events_open", "Drift events not yet resolved or dismissed.", labels=labels
    )
    raised = CounterMetricFamily("specctl_drift_events", "Drift events raised.", labels=labels)
    resolved = CounterMetricFamily(
        "specctl_drift_events_resolved",
        "Drift events ended, by resolution (realignment_failed, not_enough_data, promoted, ...).",
        labels=[*labels, "resolution"],
    )
    ids = [d.id for d in deployments]
    counts: dict[tuple[int, DriftState], int] = {}
    by_resolution: dict[int, dict[str, int]] = defaultdict(dict)
    if ids:
        for deployment_id, state, count in session.execute(
            select(DriftEvent.deployment_id, DriftEvent.state, func.count())
            .where(DriftEvent.deployment_id.in_(ids))
            .group_by(DriftEvent.deployment_id, DriftEvent.state)
        ):
            counts[(deployment_id, state)] = int(count)
        for deployment_id, ending, count in session.execute(
            select(DriftEvent.deployment_id, DriftEvent.resolution, func.count())
            .where(DriftEvent.deployment_id.in_(ids), DriftEvent.resolution.is_not(None))
            .group_by(DriftEvent.deployment_id, DriftEvent.resolution)
        ):
            if ending is not None:
                by_resolution[deployment_id][ending.value] = int(count)
    for deployment in deployments:
        key = [account, deployment.name]
        active = active_drafter(session=session, deployment_id=deployment.id)
        if active is not None:
            version.add_metric(key, float(active.version))
        status = monitor_status(session=session, deployment=deployment, settings=settings)
        detector = status.get("detector") or {}
        if isinstance(detector.get("statistic"), int | float):
            statistic.add_metric(key, float(detector["statistic"]))
        if isinstance(detector.get("threshold"), int | float):
            threshold.add_metric(key, float(detector["threshold"]))
        mine = {state: n for (d, state), n in counts.items() if d == deployment.id}
        opened.add_metric(key, float(mine.get(DriftState.open, 0) + mine.get(DriftState.realigning, 0)))
        raised.add_metric(key, float(sum(mine.values())))
        for ending_name, count in sorted(by_resolution.get(deployment.id, {}).items()):
            resolved.add_metric([*key, ending_name], float(count))
    return [version, statistic, threshold, opened, raised, resolved]


def _jobs(session: Session, account: str, names: dict[int, str], now: datetime) -> list[Metric]:
    jobs = GaugeMetricFamily(
        "specctl_jobs", "Jobs by kind and state.", labels=["account", "deployment", "kind", "state"]
    )
    progress = GaugeMetricFamily(
        "specctl_job_progress_ratio",
        "Progress of each running job, 0 to 1.",
        labels=["account", "deployment", "kind", "job_id"],
    )
    duration = HistogramMetricFamily(
        "specctl_job_duration_seconds",
        "Run time of finished jobs, from start to finish.",
        labels=["account", "deployment", "kind", "state"],
    )
    attempts_total = CounterMetricFamily(
        "specctl_job_attempts",
        "Attempts started, over all jobs (more than one per job: retries and lost workers).",
        labels=["account", "deployment", "kind"],
    )
    retrying = GaugeMetricFamily(
        "specctl_jobs_awaiting_retry",
        "Queued jobs waiting out the backoff after a failed or lost attempt.",
        labels=["account", "deployment", "kind"],
    )
    families: list[Metric] = [jobs, progress, duration, attempts_total, retrying]
    if not names:
        return families
    counted: dict[tuple[int, str, str], int] = defaultdict(int)
    durations: dict[tuple[int, str, str], list[float]] = defaultdict(list)
    attempts_by: dict[tuple[int, str], int] = defaultdict(int)
    retrying_by: dict[tuple[int, str], int] = defaultdict(int)
    rows = session.execute(
        select(
            Job.id,
            Job.deployment_id,
            Job.kind,
            Job.state,
            Job.progress,
            Job.started_at,
            Job.finished_at,
            Job.attempts,
            Job.next_attempt_at,
        )
        .where(Job.deployment_id.in_(list(names)))
        .order_by(Job.id)
    )
    for job_id, deployment_id, kind, state, fraction, started, finished, attempts, next_attempt in rows:
        counted[(deployment_id, kind.value, state.value)] += 1
        attempts_by[(deployment_id, kind.value)] += int(attempts or 0)
        if state == JobState.queued and next_attempt is not None:
            retrying_by[(deployment_id, kind.value)] += 1
        if state == JobState.running:
            progress.add_metric([account, names[deployment_id], kind.value, str(job_id)], float(fraction))
        if started is not None and finished is not None:
            run_s = max(0.0, (as_utc(finished) - as_utc(started)).total_seconds())
            durations[(deployment_id, kind.value, state.value)].append(run_s)
    for (deployment_id, kind_name, state_name), count in sorted(counted.items()):
        jobs.add_metric([account, names[deployment_id], kind_name, state_name], float(count))
    for (deployment_id, kind_name, state_name), runs in sorted(durations.items()):
        cumulative = [
            (str(bound), float(sum(1 for run_s in runs if run_s <= bound))) for bound in JOB_DURATION_BUCKETS
        ]
        cumulative.append(("+Inf", float(len(runs))))
        duration.add_metric([account, names[deployment_id], kind_name, state_name], cumulative, sum(runs))
    for (deployment_id, kind_name), count in sorted(attempts_by.items()):
        attempts_total.add_metric([account, names[deployment_id], kind_name], float(count))
    for (deployment_id, kind_name), count in sorted(retrying_by.items()):
        retrying.add_metric([account, names[deployment_id], kind_name], float(count))
    return families


def _canaries(session: Session, account: str, names: dict[int, str]) -> list[Metric]:
    decisions = CounterMetricFamily(
        "specctl_canary_decisions",
        "Canaries decided, by decision (e.g. promote, reject, inconclusive).",
        labels=["account", "deployment", "decision"],
    )
    running = GaugeMetricFamily(
        "specctl_canaries_undecided",
        "Canaries still running (no decision yet).",
        labels=["account", "deployment"],
    )
    errors = CounterMetricFamily(
        "specctl_canary_evaluation_errors",
        "Canary judge ticks that failed on a deployment (rolled back; the other deployments went on).",
        labels=["account", "deployment"],
    )
    if not names:
        return [decisions, running, errors]
    failed: dict[int, int] = defaultdict(int)
    for canary in session.scalars(select(Canary).where(Canary.deployment_id.in_(list(names)))):
        failed[canary.deployment_id] += evaluation_error_count(canary)
    undecided: dict[int, int] = defaultdict(int)
    for deployment_id, decision, count in session.execute(
        select(Canary.deployment_id, Canary.decision, func.count())
        .where(Canary.deployment_id.in_(list(names)))
        .group_by(Canary.deployment_id, Canary.decision)
    ):
        if decision is None:
            undecided[deployment_id] += int(count)
        else:
            decisions.add_metric([account, names[deployment_id], decision], float(count))
    for deployment_id, name in names.items():
        running.add_metric([account, name], float(undecided.get(deployment_id, 0)))
        errors.add_metric([account, name], float(failed.get(deployment_id, 0)))
    return [decisions, running, errors]


def _drafter_moves(session: Session, account_id: int, account: str, names: dict[int, str]) -> list[Metric]:
    promotions = CounterMetricFamily(
        "specctl_drafter_promotions",
        "Drafter promotions (from the audit log).",
        labels=["account", "deployment"],
    )
    rollbacks = CounterMetricFamily(
        "specctl_drafter_rollbacks",
        "Drafter rollbacks (from the audit log).",
        labels=["account", "deployment"],
    )
    promoted: dict[str, int] = defaultdict(int)
    rolled_back: dict[str, int] = defaultdict(int)
    action = func.lower(AuditEntry.action)
    rows = session.execute(
        select(AuditEntry.action, AuditEntry.resource, func.count())
        .where(
            AuditEntry.account_id == account_id,
            or_(*(action.contains(word, autoescape=True) for word in PROMOTION_WORDS + ROLLBACK_WORDS)),
        )
        .group_by(AuditEntry.action, AuditEntry.resource)
    )
    prefixes = {resource_name(account, name): name for name in names.values()}
    for audited_action, resource, count in rows:
        deployment = _deployment_of(resource, prefixes)
        if deployment is None:
            continue
        if any(word in audited_action.lower() for word in ROLLBACK_WORDS):
            rolled_back[deployment] += int(count)
        else:
            promoted[deployment] += int(count)
    for name in names.values():
        promotions.add_metric([account, name], float(promoted.get(name, 0)))
        rollbacks.add_metric([account, name], float(rolled_back.get(name, 0)))
    return [promotions, rollbacks]


def _deployment_of(resource: str, prefixes: dict[str, str]) -> str | None:
    """The live deployment an audit resource belongs to (its name or a path below it)."""
    for prefix, name in prefixes.items():
        if resource == prefix or resource.startswith(prefix + "/"):
            return name
    return None
