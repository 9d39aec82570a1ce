"""The drift monitor and drift-event services.

Each deployment's detector state lives in ``drift_monitor_states`` and is advanced over new
live acceptance records exactly once and in record-id order:

- a watermark (last record id consumed) moves in the same transaction as the detector state and
  any event it raised, guarded by a compare-and-set on a version number, so two monitor tasks
  running at once cannot both consume the same records (the loser rolls back and does nothing);
- ids are assigned when a row is inserted but become visible when its transaction commits, so a
  run only consumes ids up to the horizon the *previous* run saw (one beat interval earlier):
  by then every transaction that had taken such an id has committed or rolled back.

A new active drafter version (a promotion), a new speculation mode (a guardrail's switch to the
fallback, or a person's) or a new policy restarts the detector, which then re-estimates its
baseline on a fresh reference window.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from functools import partial
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from controlplane.accounts.service import Principal
from controlplane.audit.service import record_change
from controlplane.config import Settings
from controlplane.db.models import (
    AcceptanceRecordRow,
    Deployment,
    DriftEvent,
    DriftMonitorState,
    DriftState,
)
from controlplane.deployments.guardrail import guardrail_fallback
from controlplane.deployments.lookup import resource_name
from controlplane.deployments.spec import DEFAULT_DRAFT_TOKEN_COUNT, MAX_DRAFT_TOKENS
from controlplane.drafters.service import active_drafter
from controlplane.drift import policy as drift_policy
from controlplane.drift import states as drift_states
from controlplane.drift.mix_monitor import MixMonitor
from controlplane.drift.mixture_sr import MixtureSR
from controlplane.drift.observation import RequestObservation
from controlplane.errors import ConflictError
from controlplane.ingest.aggregates import full_matrix, moment_length
from controlplane.timestamps import as_utc, utcnow

MONITORED_ARM = "live"
DEFAULT_BATCH_LIMIT = 20_000


DETECTOR_NAME = "mixture_sr"
# The speculation mode the stored detector's baseline was measured under (kept in its state).
SERVING_MODE_KEY = "speculation_mode"


def new_detector(
    policy: drift_policy.DriftPolicy, *, n_positions: int, calibrate_on_freeze: bool = True
) -> MixtureSR:
    """The main detector for a policy: threshold derived from ARL0, drops below min_drop ignored.

    The latch and cooldown are kept by the monitor (in wall time), not by the detector.
    """
    return MixtureSR(
        arl0=float(policy.arl0_requests),
        min_drop=policy.min_drop,
        n_positions=n_positions,
        reference_size=policy.reference_requests,
        calibrate_on_freeze=calibrate_on_freeze,
    )


def evidence_of(detector: MixtureSR) -> dict[str, Any]:
    return {"detector": DETECTOR_NAME, **detector.evidence().to_dict()}


@dataclass(slots=True)
class DetectorPair:
    """The main detector and the workload-mix side monitor, persisted together.

    The main detector is risk-adjusted per category, so a pure mix change does not fire it; the
    side monitor says whether the mix moved and how much of a pooled hit-rate change the new mix
    explains, which every drift event records as its attribution.
    """

    main: MixtureSR
    mix: MixMonitor

    @classmethod
    def new(
        cls, policy: drift_policy.DriftPolicy, *, n_positions: int, calibrate_on_freeze: bool = True
    ) -> DetectorPair:
        return cls(
            new_detector(policy, n_positions=n_positions, calibrate_on_freeze=calibrate_on_freeze),
            MixMonitor(arl0=float(policy.arl0_requests), min_drop=policy.min_drop),
        )

    @classmethod
    def from_state(
        cls,
        state: dict[str, Any],
        policy: drift_policy.DriftPolicy,
        *,
        calibrate_on_freeze: bool | None = None,
    ) -> DetectorPair:
        if "main" in state:
            return cls(
                MixtureSR.from_state(state["main"], calibrate_on_freeze=calibrate_on_freeze),
                MixMonitor.from_state(state["mix"]),
            )
        # A state saved before the side monitor existed: keep the main detector, start the side one.
        return cls(
            MixtureSR.from_state(state, calibrate_on_freeze=calibrate_on_freeze),
            MixMonitor(arl0=float(policy.arl0_requests), min_drop=policy.min_drop),
        )

    def to_state(self) -> dict[str, Any]:
        return {"main": self.main.to_state(), "mix": self.mix.to_state()}

    def update(self, observation: RequestObservation) -> None:
        self.main.update(observation)
        self.mix.update(observation)

    def update_window(self, windows: Sequence[tuple[str | None, int, Mapping[str, Any]]]) -> int:
        """Advance both monitors by one edge window of one deployment's live aggregates, given as
        ``(category, speculated requests, sums)`` with the ``sums`` of
        controlplane.ingest.aggregate_store; returns the requests the window held."""
        main: list[tuple[str | None, int, Any, Any]] = []
        mix: list[tuple[str | None, int, float, float, list[float]]] = []
        for category, count, sums in windows:
            successes = sums.get("accepted_per_position") or []
            trials = sums.get("reached_per_position") or []
            if count <= 0 or not successes or len(trials) != len(successes):
                continue
            k = len(successes)
            moments = sums.get("position_moments") or [0.0] * moment_length(k)
            main.append((category or None, count, [*successes, *trials], partial(full_matrix, moments, k)))
            prompt = list(sums.get("prompt_log_length") or [0.0, 0.0, 0.0])
            mix.append((category or None, count, float(sum(successes)), float(sum(trials)), prompt))
        if main:
            self.main.update_window(main)
            self.mix.update_window(mix)
        return sum(g[1] for g in main)

    def evidence(self) -> dict[str, Any]:
        return {
            **evidence_of(self.main),
            "mix_shift_detected": self.mix.drift_detected,
            "mix_attribution": self.mix.attribution().to_dict(),
        }


@dataclass(slots=True)
class MonitorOutcome:
    deployment_id: int
    records_consumed: int
    events_raised: list[int]
    skipped: str | None = None
    # Records exist past the watermark that a later run (once they settle) will consume.
    pending: bool = False
    # Realign jobs created for this run's events (auto_realign), in the same transaction: the
    # caller sends ``realign.run`` for each once it has committed.
    realign_jobs: list[int] = field(default_factory=list)


def _observation(row: Any) -> RequestObservation | None:
    k = row.k or len(row.accepted_per_position or [])
    if not k or not row.accepted_per_position or row.verify_steps == 0:
        return None  # pooled counts or no speculation: nothing a per-position detector can use
    try:
        return RequestObservation.from_counts(
            k=k,
            verify_steps=row.verify_steps,
            accepted_per_position=row.accepted_per_position,
            drafted_tokens=row.drafted_tokens,
            accepted_tokens=row.accepted_tokens,
            category=row.category,
            prompt_tokens=row.prompt_tokens,
        )
    except ValueError:
        return None


# What follows a new drift event, in the transaction that records it: the id of a realign job
# created for the event, or None. The monitor only detects and records; the loop decides the
# response (controlplane.loop.drift.respond_to_drift) and hands it in.
DriftResponse = Callable[[Session, Deployment, DriftEvent], int | None]


def latest_record_id(session: Session, deployment_id: int) -> int:
    latest = session.scalar(
        select(func.max(AcceptanceRecordRow.id)).where(AcceptanceRecordRow.deployment_id == deployment_id)
    )
    return int(latest or 0)


def advance_monitor(
    *,
    session: Session,
    deployment_id: int,
    settings: Settings,
    respond: DriftResponse,
    batch_limit: int = DEFAULT_BATCH_LIMIT,
) -> MonitorOutcome:
    """Feed new settled records to the deployment's detector; record an event on alarm and
    ``respond`` to it.

    Runs in the caller's transaction; raises ``ConflictError`` if another monitor advanced the
    same deployment meanwhile (the caller rolls back: that run's work is simply not needed).
    """
    deployment = session.get(Deployment, deployment_id)
    if deployment is None or deployment.deleted_at is not None:
        return MonitorOutcome(deployment_id, 0, [], skipped="deployment gone")
    policy = drift_policy.resolve(deployment.drift_policy, settings)
    active = active_drafter(session=session, deployment_id=deployment_id)
    active_version = active.version if active else None
    horizon_now = latest_record_id(session, deployment_id)
    state = session.get(DriftMonitorState, deployment_id)
    if state is None:
        # History counts: the first records seen become the detector's reference window.
        state = DriftMonitorState(
            deployment_id=deployment_id,
            detector_state=None,
            watermark_record_id=0,
            pending_horizon_record_id=horizon_now,
            active_drafter_version=active_version,
            policy=policy.as_dict(),
            records_examined=0,
            version=0,
        )
        session.add(state)
        try:
            session.flush()
        except IntegrityError as exc:  # another monitor created it first: its run does the work
            raise ConflictError(
                f"deployment {deployment_id}: another monitor started it concurrently"
            ) from exc
        return MonitorOutcome(
            deployment_id,
            0,
            [],
            skipped="horizon recorded; records are consumed next run",
            pending=horizon_now > 0,
        )

    serving_mode = deployment.speculation_mode.value
    stored_mode = (state.detector_state or {}).get(SERVING_MODE_KEY, serving_mode)
    restart = (
        state.detector_state is None
        or state.active_drafter_version != active_version
        or (state.policy != policy.as_dict())
        # A switch to the fallback (or back) changes what speculates: the old baseline is not its.
        or stored_mode != serving_mode
    )
    n_positions = max(1, min(deployment.draft_token_count or DEFAULT_DRAFT_TOKEN_COUNT, MAX_DRAFT_TOKENS))
    detectors = (
        DetectorPair.new(policy, n_positions=n_positions)
        if restart
        else DetectorPair.from_state(state.detector_state or {}, policy)
    )
    detector = detectors.main
    settled = state.pending_horizon_record_id
    rows = session.execute(
        select(
            AcceptanceRecordRow.id,
            AcceptanceRecordRow.arm,
            AcceptanceRecordRow.k,
            AcceptanceRecordRow.verify_steps,
            AcceptanceRecordRow.accepted_per_position,
            AcceptanceRecordRow.drafted_tokens,
            AcceptanceRecordRow.accepted_tokens,
            AcceptanceRecordRow.category,
            AcceptanceRecordRow.prompt_tokens,
        )
        .where(
            AcceptanceRecordRow.deployment_id == deployment_id,
            AcceptanceRecordRow.id > state.watermark_record_id,
            AcceptanceRecordRow.id <= settled,
            # Samples of aggregated traffic: the detector reads their window's sums instead.
            AcceptanceRecordRow.counted_in_aggregate.is_(False),
        )
        .order_by(AcceptanceRecordRow.id)
        .limit(batch_limit)
    ).all()
    now = utcnow()
    events: list[int] = []
    realign_jobs: list[int] = []
    examined = state.records_examined if not restart else 0
    open_event = session.scalar(
        select(DriftEvent.id).where(
            DriftEvent.deployment_id == deployment_id,
            DriftEvent.state.in_(drift_states.UNANSWERED),
        )
    )
    last_alarm = state.last_alarm_at
    quiet_until = next_alarm_not_before(
        session=session, deployment_id=deployment_id, last_alarm_at=last_alarm, cooldown_s=policy.cooldown_s
    )
    # Live records from before a guardrail's switch were served by the drafter it switched away
    # from: the fallback's baseline is measured on its own records only.
    fallback = guardrail_fallback(deployment)
    before_switch = int(fallback.get("since_record_id") or 0) if fallback is not None else 0
    for row in rows:
        if row.arm != MONITORED_ARM or row.id <= before_switch:
            continue
        observation = _observation(row)
        if observation is None:
            continue
        if detector.drift_detected and open_event is None:
            # The last alarm's event was dismissed or resolved: re-arm on the same baseline.
            detector.reset()
            if detectors.mix.drift_detected:
                detectors.mix.reset()
        detectors.update(observation)
        examined += 1
        if not detector.drift_detected:
            continue
        cooling = quiet_until is not None and quiet_until > now
        if open_event is not None or cooling:
            continue  # latched: one open event per deployment, and a quiet period after each
        event_id, job_id = raise_drift_event(
            session=session,
            deployment=deployment,
            detectors=detectors,
            policy=policy,
            active_version=active_version,
            examined=examined,
            last_record_id=row.id,
            now=now,
            respond=respond,
        )
        events.append(event_id)
        if job_id is not None:
            realign_jobs.append(job_id)
        open_event = event_id
        last_alarm = now
        quiet_until = now + timedelta(seconds=policy.cooldown_s)
    new_watermark = rows[-1].id if len(rows) == batch_limit else settled
    result = session.execute(
        update(DriftMonitorState)
        .where(DriftMonitorState.deployment_id == deployment_id, DriftMonitorState.version == state.version)
        .values(
            detector_state={**detectors.to_state(), SERVING_MODE_KEY: serving_mode},
            watermark_record_id=new_watermark,
            pending_horizon_record_id=horizon_now if new_watermark == settled else settled,
            active_drafter_version=active_version,
            policy=policy.as_dict(),
            records_examined=examined,
            last_alarm_at=last_alarm,
            updated_at=now,
            version=state.version + 1,
        )
        .execution_options(synchronize_session=False)
    )
    if result.rowcount != 1:  # type: ignore[attr-defined]
        raise ConflictError(f"deployment {deployment_id}: another monitor advanced it concurrently")
    return MonitorOutcome(
        deployment_id, len(rows), events, pending=horizon_now > new_watermark, realign_jobs=realign_jobs
    )


def raise_drift_event(
    *,
    session: Session,
    deployment: Deployment,
    detectors: DetectorPair,
    policy: drift_policy.DriftPolicy,
    active_version: int | None,
    examined: int,
    last_record_id: int | None,
    now: datetime,
    respond: DriftResponse,
) -> tuple[int, int | None]:
    """Record the alarm of ``detectors`` as an open drift event and ``respond`` to it in the same
    transaction (a realign job, when the deployment realigns on drift); returns (event id, the
    new job's id or None)."""
    evidence = detectors.evidence()
    event = DriftEvent(
        deployment_id=deployment.id,
        detected_at=now,
        state=DriftState.open,
        detector=DETECTOR_NAME,
        baseline_rate=evidence.get("baseline_rate"),
        current_rate=evidence.get("current_estimate"),
        drop=evidence.get("drop"),
        position_most_affected=evidence.get("position_most_affected"),
        statistic=evidence.get("statistic"),
        threshold=evidence.get("threshold"),
        records_examined=examined,
        last_record_id=last_record_id,
        detection_delay_estimate=evidence.get("detection_delay_estimate"),
        evidence={**evidence, "policy": policy.as_dict(), "drafter_version": active_version},
    )
    session.add(event)
    session.flush()
    return event.id, respond(session, deployment, event)


def next_alarm_not_before(
    *, session: Session, deployment_id: int, last_alarm_at: datetime | None, cooldown_s: int
) -> datetime | None:
    """When the detector may raise its next event: the policy's cooldown after the later of the
    last alarm and the end of the last event (a realignment that took an hour and failed does not
    leave the deployment without a quiet period); None when it never alarmed."""
    last_end = session.scalar(
        select(func.max(DriftEvent.resolved_at)).where(DriftEvent.deployment_id == deployment_id)
    )
    marks = [as_utc(t) for t in (last_alarm_at, last_end) if t is not None]
    return max(marks) + timedelta(seconds=cooldown_s) if marks else None


def deployments_with_new_records(*, session: Session) -> list[int]:
    """Live deployments whose records moved past their monitor's watermark (or never monitored)."""
    latest = (
        select(AcceptanceRecordRow.deployment_id, func.max(AcceptanceRecordRow.id).label("latest"))
        .group_by(AcceptanceRecordRow.deployment_id)
        .subquery()
    )
    rows = session.execute(
        select(Deployment.id)
        .join(latest, latest.c.deployment_id == Deployment.id)
        .outerjoin(DriftMonitorState, DriftMonitorState.deployment_id == Deployment.id)
        .where(
            Deployment.deleted_at.is_(None),
            (DriftMonitorState.deployment_id.is_(None))
            | (DriftMonitorState.watermark_record_id < latest.c.latest),
        )
    )
    return [int(r[0]) for r in rows]


def update_policy(
    *,
    session: Session,
    principal: Principal,
    deployment: Deployment,
    changes: dict[str, Any],
    settings: Settings,
) -> dict[str, Any]:
    """Change the deployment's drift policy (audited); the detector restarts with it."""
    valid = drift_policy.validate_changes(changes)
    before = drift_policy.resolve(deployment.drift_policy, settings).as_dict()
    deployment.drift_policy = {**deployment.drift_policy, **valid}
    after = drift_policy.resolve(deployment.drift_policy, settings).as_dict()
    session.flush()
    record_change(
        session=session,
        account_id=principal.account_id,
        actor=principal.actor,
        action="deployment.drift_policy",
        resource=resource_name(principal.account_name, deployment.name),
        before=before,
        after=after,
    )
    return after


def monitor_status(
    *,
    session: Session,
    deployment: Deployment,
    settings: Settings,
    guardrail_recovery: dict[str, Any] | None,
) -> dict[str, Any]:
    """The detector's current statistic vs threshold, watermark and open events; with
    ``guardrail_recovery``, what the jobs service says of a guardrail fallback."""
    state = session.get(DriftMonitorState, deployment.id)
    policy = drift_policy.resolve(deployment.drift_policy, settings)
    open_events = session.scalar(
        select(func.count()).where(
            DriftEvent.deployment_id == deployment.id, DriftEvent.state.in_(drift_states.UNANSWERED)
        )
    )
    status: dict[str, Any] = {
        "policy": policy.as_dict(),
        "open_events": int(open_events or 0),
        "records_examined": state.records_examined if state else 0,
        "watermark_record_id": state.watermark_record_id if state else 0,
        "updated_at": state.updated_at.isoformat() if state and state.updated_at else None,
        "detector": None,
        # Why a realignment is queued while a guardrail keeps the deployment on its fallback.
        "guardrail_recovery": guardrail_recovery,
    }
    if state is not None and state.detector_state:
        detectors = DetectorPair.from_state(state.detector_state, policy)
        quiet_until = next_alarm_not_before(
            session=session,
            deployment_id=deployment.id,
            last_alarm_at=state.last_alarm_at,
            cooldown_s=policy.cooldown_s,
        )
        status["detector"] = {
            **detectors.evidence(),
            "in_reference_window": detectors.main.in_reference,
            "drift_detected": detectors.main.drift_detected,
            # Re-armed: no event left unanswered, so the next alarm (after the cooldown) raises one.
            "armed": not open_events,
            "next_alarm_not_before": quiet_until.isoformat() if quiet_until is not None else None,
        }
    return status
