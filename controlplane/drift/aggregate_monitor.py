"""The drift monitor over edge aggregates: one set-based pass per shard of deployments.

A fleet of ten thousand deployments sends ten thousand windows of aggregates a minute; walking
deployments one by one (a query, a detector load and a write each) cannot keep up. One pass of
:func:`monitor_aggregates` instead:

1. reads every live aggregate of its shard (``deployment_id % shards == shard``) that arrived
   after the deployment's watermark over edge windows, in one query;
2. loads what the detectors need for all those deployments at once (policies, active drafter
   versions, monitor states, open events) in a few ``IN`` queries;
3. advances each deployment's detectors one step per edge window (the detector's cost is per
   window, not per request), raising drift events exactly as the per-request monitor does;
4. writes every state back in one executemany, each row guarded by its compare-and-set version.

Shards are independent, so Celery workers on the ``default`` queue each take some (add workers to
go faster). A worker keeps the detectors it wrote in a :class:`DetectorCache` keyed by the
state's version, so the next pass skips decoding them; any other writer (the per-request monitor
of the same deployment, a second pass of the same shard) bumps the version, which invalidates the
entry, and a pass that loses a compare-and-set raises ``ConflictError`` and is rolled back whole
(its windows are consumed by the next pass). Mixed inputs for one deployment feed one detector:
records through their watermark, aggregates through theirs.

Edge-window ids become visible when their transaction commits, so, as for records, a pass only
consumes ids up to the newest id the *previous* pass of its shard saw (one pass earlier).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, cast

from sqlalchemy import Table, bindparam, func, insert, select, true, update
from sqlalchemy.orm import Session

from controlplane.config import Settings
from controlplane.db.models import (
    AcceptanceAggregateRow,
    Deployment,
    DrafterState,
    DrafterVersion,
    DriftEvent,
    DriftMonitorState,
    EdgeWindowRow,
)
from controlplane.db.session import driver_cursor, json_dumps
from controlplane.deployments.spec import DEFAULT_DRAFT_TOKEN_COUNT, MAX_DRAFT_TOKENS
from controlplane.drift import policy as drift_policy
from controlplane.drift import states as drift_states
from controlplane.drift.service import (
    MONITORED_ARM,
    SERVING_MODE_KEY,
    DetectorPair,
    DriftResponse,
    next_alarm_not_before,
    raise_drift_event,
)
from controlplane.errors import ConflictError
from controlplane.ingest.aggregates import MAX_WINDOW_AGE
from controlplane.timestamps import as_utc, utcnow

_IN_CHUNK = 5_000
# An edge window's id is taken when its ingest transaction starts and becomes visible when it
# commits (a 20,000-aggregate window takes about a second): ids are consumed only up to a
# horizon seen at least this long ago, by when every transaction that took a lower id is done.
DEFAULT_SETTLE_S = 2.0
# Seconds a pass may spend giving frozen detectors still at the Pollak bound their simulated
# threshold (about half a second each): the rest wait for a later pass.
DEFAULT_CALIBRATION_BUDGET_S = 0.5


@dataclass
class DetectorCache:
    """One worker's detectors as it last wrote them, and each shard's last seen horizon."""

    # deployment -> (state version written, detectors, the serving mode their baseline is of)
    detectors: dict[int, tuple[int, DetectorPair, str]] = field(default_factory=dict)
    # Per (shard, shards): (monotonic time, newest edge-window id seen then), oldest first.
    horizons: dict[tuple[int, int], list[tuple[float, int]]] = field(default_factory=dict)

    def settled(self, shard: int, shards: int, settle_s: float, now: float) -> int | None:
        """The newest horizon seen at least ``settle_s`` ago (None: none yet)."""
        seen = self.horizons.get((shard, shards), [])
        old = [h for t, h in seen if now - t >= settle_s]
        return old[-1] if old else None

    def saw(self, shard: int, shards: int, horizon: int, now: float, settle_s: float) -> None:
        seen = self.horizons.setdefault((shard, shards), [])
        seen.append((now, horizon))
        # Keep the newest settled entry and everything younger.
        settled = [i for i, (t, _) in enumerate(seen) if now - t >= settle_s]
        if settled:
            del seen[: settled[-1]]

    def forget(self, deployment_ids: Iterable[int] | None = None) -> None:
        if deployment_ids is None:
            self.detectors.clear()
            return
        for deployment_id in deployment_ids:
            self.detectors.pop(deployment_id, None)


@dataclass
class AggregatePass:
    """What one pass did; ``commit`` must be called once its transaction has committed."""

    shard: int
    shards: int
    horizon: int
    settled: int
    deployments: int = 0
    windows: int = 0
    requests: int = 0
    events_raised: list[int] = field(default_factory=list)
    realign_jobs: list[int] = field(default_factory=list)
    # Seconds from each consumed window's end to this pass (the window's wait for detection).
    window_lags_s: list[float] = field(default_factory=list)
    edge_window_ids: set[int] = field(default_factory=set)
    calibrated: int = 0
    calibration_s: float = 0.0
    seconds: float = 0.0
    _written: dict[int, tuple[int, DetectorPair, str]] = field(default_factory=dict)

    def commit(self, cache: DetectorCache) -> None:
        cache.detectors.update(self._written)

    def as_dict(self) -> dict[str, Any]:
        return {
            "shard": self.shard,
            "shards": self.shards,
            "deployments": self.deployments,
            "windows": self.windows,
            "requests": self.requests,
            "events_raised": self.events_raised,
            "realign_jobs": self.realign_jobs,
            "calibrated": self.calibrated,
            "seconds": round(self.seconds, 4),
        }


def _chunks(ids: list[int]) -> Iterable[list[int]]:
    for start in range(0, len(ids), _IN_CHUNK):
        yield ids[start : start + _IN_CHUNK]


def monitor_aggregates(
    *,
    session: Session,
    settings: Settings,
    respond: DriftResponse,
    shard: int = 0,
    shards: int = 1,
    cache: DetectorCache | None = None,
    now: datetime | None = None,
    settle_s: float = DEFAULT_SETTLE_S,
    calibration_budget_s: float = DEFAULT_CALIBRATION_BUDGET_S,
) -> AggregatePass:
    """One pass over the shard's deployments with pending aggregates (see the module docstring).

    Runs in the caller's transaction; raises ``ConflictError`` when another writer advanced one
    of the deployments meanwhile (the caller rolls back; the next pass does the work).
    """
    if not 0 <= shard < shards:
        raise ValueError(f"shard must lie in [0, {shards})")
    started = time.perf_counter()
    cache = cache if cache is not None else DetectorCache()
    now = now or utcnow()
    horizon = int(session.scalar(select(func.max(EdgeWindowRow.id))) or 0)
    clock = time.monotonic()
    settled = cache.settled(shard, shards, settle_s, clock)
    cache.saw(shard, shards, horizon, clock, settle_s)
    outcome = AggregatePass(shard, shards, horizon, settled if settled is not None else 0)
    if settled is None or settled <= 0:
        outcome.seconds = time.perf_counter() - started
        return outcome  # nothing settled yet: this worker's first sight of the shard
    agg = AcceptanceAggregateRow
    state = DriftMonitorState
    in_shard = (agg.deployment_id % shards) == shard if shards > 1 else true()
    low = session.scalar(
        select(func.min(func.coalesce(state.watermark_edge_window_id, 0))).where(
            (state.deployment_id % shards) == shard if shards > 1 else true()
        )
    )
    watermark = func.coalesce(state.watermark_edge_window_id, 0)
    rows = session.execute(
        select(
            agg.deployment_id,
            agg.edge_window_id,
            agg.window_start,
            agg.window_s,
            agg.category,
            agg.speculated_requests,
            agg.sums,
        )
        .outerjoin(state, state.deployment_id == agg.deployment_id)
        .where(
            agg.edge_window_id > int(low or 0),
            agg.edge_window_id <= settled,
            agg.edge_window_id > watermark,
            # Windows are accepted up to MAX_WINDOW_AGE late: older partitions cannot hold news.
            agg.window_start >= now - MAX_WINDOW_AGE - timedelta(days=1),
            agg.arm == MONITORED_ARM,
            in_shard,
        )
        .order_by(agg.deployment_id, agg.edge_window_id)
    ).all()
    if not rows:
        outcome.seconds = time.perf_counter() - started
        return outcome
    by_deployment: dict[int, list[Any]] = {}
    for row in rows:
        by_deployment.setdefault(int(row.deployment_id), []).append(row)
    ids = sorted(by_deployment)
    deployments: dict[int, Any] = {}
    active: dict[int, int] = {}
    states: dict[int, Any] = {}
    d: Any
    s: Any
    open_events: set[int] = set()
    for chunk in _chunks(ids):
        for d in session.execute(
            select(
                Deployment.id,
                Deployment.drift_policy,
                Deployment.draft_token_count,
                Deployment.speculation_mode,
                Deployment.deleted_at,
            ).where(Deployment.id.in_(chunk))
        ):
            deployments[int(d.id)] = d
        for deployment_id, version in session.execute(
            select(DrafterVersion.deployment_id, DrafterVersion.version).where(
                DrafterVersion.deployment_id.in_(chunk), DrafterVersion.state == DrafterState.active
            )
        ):
            active[int(deployment_id)] = int(version)
        for s in session.execute(
            select(
                state.deployment_id,
                state.watermark_edge_window_id,
                state.active_drafter_version,
                state.policy,
                state.records_examined,
                state.last_alarm_at,
                state.version,
            ).where(state.deployment_id.in_(chunk))
        ):
            states[int(s.deployment_id)] = s
        open_events.update(
            int(v)
            for v in session.scalars(
                select(DriftEvent.deployment_id).where(
                    DriftEvent.deployment_id.in_(chunk), DriftEvent.state.in_(drift_states.UNANSWERED)
                )
            )
        )
    # Decoding a stored detector costs more than advancing it: only cache misses read theirs.
    missing = [
        deployment_id
        for deployment_id, s in states.items()
        if (cache.detectors.get(deployment_id) or (None,))[0] != s.version
    ]
    stored_states: dict[int, dict[str, Any]] = {}
    for chunk in _chunks(sorted(missing)):
        for deployment_id, detector_state in session.execute(
            select(state.deployment_id, state.detector_state).where(state.deployment_id.in_(chunk))
        ):
            stored_states[int(deployment_id)] = detector_state or {}
    policies: dict[str, tuple[drift_policy.DriftPolicy, dict[str, Any]]] = {}
    updates: list[dict[str, Any]] = []
    inserts: list[dict[str, Any]] = []
    for deployment_id in ids:
        d = deployments.get(deployment_id)
        if d is None or d.deleted_at is not None:
            continue
        # Most deployments share a policy: resolve each distinct stored one once per pass.
        policy_key = json_dumps(d.drift_policy or {})
        if policy_key not in policies:
            resolved = drift_policy.resolve(d.drift_policy or {}, settings)
            policies[policy_key] = (resolved, resolved.as_dict())
        policy, policy_dict = policies[policy_key]
        active_version = active.get(deployment_id)
        serving_mode = d.speculation_mode.value
        s = states.get(deployment_id)
        # Taken out: a pass that fails leaves no half-advanced detector behind (commit puts back).
        cached = cache.detectors.pop(deployment_id, None)
        if cached is not None and s is not None and cached[0] == s.version:
            stored: dict[str, Any] = {SERVING_MODE_KEY: cached[2]}
        else:
            cached = None
            stored = stored_states.get(deployment_id, {})
        restart = (
            s is None
            or not stored
            or s.active_drafter_version != active_version
            or s.policy != policy_dict
            or stored.get(SERVING_MODE_KEY, serving_mode) != serving_mode
        )
        n_positions = max(1, min(d.draft_token_count or DEFAULT_DRAFT_TOKEN_COUNT, MAX_DRAFT_TOKENS))
        if restart:
            # Thousands of reference windows fill in the same minute on a fleet: each freezes at
            # the Pollak bound (safe, a little slow to alarm) and is calibrated below, in turn.
            detectors = DetectorPair.new(policy, n_positions=n_positions, calibrate_on_freeze=False)
        elif cached is not None:
            detectors = cached[1]
        else:
            detectors = DetectorPair.from_state(stored, policy, calibrate_on_freeze=False)
        examined = 0 if restart or s is None else int(s.records_examined)
        last_alarm = s.last_alarm_at if s is not None else None
        open_event = deployment_id in open_events
        windows: dict[int, list[Any]] = {}
        for row in by_deployment[deployment_id]:
            windows.setdefault(int(row.edge_window_id), []).append(row)
        quiet_until: datetime | None | bool = False  # computed on the first alarm only
        for window_rows in windows.values():
            main = detectors.main
            if main.drift_detected and not open_event:
                main.reset()
                if detectors.mix.drift_detected:
                    detectors.mix.reset()
            requests = detectors.update_window(
                [(r.category, r.speculated_requests, r.sums) for r in window_rows]
            )
            examined += requests
            outcome.windows += 1
            outcome.requests += requests
            first = window_rows[0]
            window_end = as_utc(first.window_start) + timedelta(seconds=int(first.window_s))
            outcome.window_lags_s.append((now - window_end).total_seconds())
            if not main.drift_detected or open_event:
                continue
            if quiet_until is False:
                quiet_until = next_alarm_not_before(
                    session=session,
                    deployment_id=deployment_id,
                    last_alarm_at=last_alarm,
                    cooldown_s=policy.cooldown_s,
                )
            if isinstance(quiet_until, datetime) and quiet_until > now:
                continue
            deployment = session.get(Deployment, deployment_id)
            assert deployment is not None
            event_id, job_id = raise_drift_event(
                session=session,
                deployment=deployment,
                detectors=detectors,
                policy=policy,
                active_version=active_version,
                examined=examined,
                last_record_id=None,
                now=now,
                respond=respond,
            )
            outcome.events_raised.append(event_id)
            if job_id is not None:
                outcome.realign_jobs.append(job_id)
            open_event = True
            last_alarm = now
            quiet_until = now + timedelta(seconds=policy.cooldown_s)
        if detectors.main.calibration_pending and outcome.calibration_s < calibration_budget_s:
            calibrating = time.perf_counter()
            detectors.main.calibrate()
            outcome.calibrated += 1
            outcome.calibration_s += time.perf_counter() - calibrating
        consumed_to = max(windows)
        outcome.edge_window_ids.update(windows)
        values = {
            "detector_state": {**detectors.to_state(), SERVING_MODE_KEY: serving_mode},
            "watermark_edge_window_id": consumed_to,
            "active_drafter_version": active_version,
            "policy": policy_dict,
            "records_examined": examined,
            "last_alarm_at": last_alarm,
            "updated_at": now,
        }
        if s is None:
            inserts.append(
                {
                    "deployment_id": deployment_id,
                    "watermark_record_id": 0,
                    "pending_horizon_record_id": 0,
                    "version": 1,
                    **values,
                }
            )
            outcome._written[deployment_id] = (1, detectors, serving_mode)
        else:
            updates.append(
                {"b_deployment_id": deployment_id, "b_version": s.version, **values, "version": s.version + 1}
            )
            outcome._written[deployment_id] = (s.version + 1, detectors, serving_mode)
        outcome.deployments += 1
    table = cast(Table, DriftMonitorState.__table__)
    if updates:
        if session.get_bind().dialect.name == "postgresql":
            written = _write_back_postgres(session, updates, now)
        else:
            statement = (
                update(table)
                .where(
                    table.c.deployment_id == bindparam("b_deployment_id"),
                    table.c.version == bindparam("b_version"),
                )
                .execution_options(synchronize_session=False)
            )
            written = session.connection().execute(statement, updates).rowcount
        if written != len(updates):
            cache.forget(by_deployment)
            raise ConflictError(
                f"shard {shard}/{shards}: {len(updates) - written} deployment(s) advanced "
                "by another monitor meanwhile"
            )
    if inserts:
        session.connection().execute(insert(table), inserts)
    outcome.seconds = time.perf_counter() - started
    return outcome


# Every state of a pass in one statement: a row per deployment through SQLAlchemy's executemany
# cost more CPU than advancing its detectors. Each row still applies only at its read version.
# Parameters go in binary (``%b``): the text format escapes every quote of every state with a regex.
_UPDATE_STATES_SQL = """
UPDATE drift_monitor_states AS s SET
    detector_state = u.detector_state::json,
    watermark_edge_window_id = u.watermark,
    active_drafter_version = u.active_version,
    policy = u.policy::json,
    records_examined = u.examined,
    last_alarm_at = u.last_alarm_at,
    updated_at = %(now)b,
    version = s.version + 1
FROM unnest(
    %(ids)b::integer[], %(versions)b::integer[], %(states)b::text[], %(watermarks)b::bigint[],
    %(active)b::integer[], %(policies)b::text[], %(examined)b::bigint[], %(last_alarm)b::timestamptz[]
) AS u(deployment_id, version, detector_state, watermark, active_version, policy, examined, last_alarm_at)
WHERE s.deployment_id = u.deployment_id AND s.version = u.version
"""


def _write_back_postgres(session: Session, updates: list[dict[str, Any]], now: datetime) -> int:
    """The pass's compare-and-set updates in one statement; returns the rows it changed."""
    policies: dict[int, str] = {}  # most deployments share one resolved policy dict
    for u in updates:
        policies.setdefault(id(u["policy"]), json_dumps(u["policy"]))
    with driver_cursor(session) as cursor:
        cursor.execute(
            _UPDATE_STATES_SQL,
            {
                "now": now,
                "ids": [u["b_deployment_id"] for u in updates],
                "versions": [u["b_version"] for u in updates],
                "states": [json_dumps(u["detector_state"]) for u in updates],
                "watermarks": [u["watermark_edge_window_id"] for u in updates],
                "active": [u["active_drafter_version"] for u in updates],
                "policies": [policies[id(u["policy"])] for u in updates],
                "examined": [u["records_examined"] for u in updates],
                "last_alarm": [u["last_alarm_at"] for u in updates],
            },
        )
        return int(cursor.rowcount)
