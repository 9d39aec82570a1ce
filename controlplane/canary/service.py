"""Canary and promotion services: start a canary for a candidate drafter, record its shadow replay,
judge its live split, promote (one transaction), reject, roll back, and the serving config the
serving fleet reads.

A canary moves through phases on its ``canaries`` row:

    shadow ──(replay recorded, not broken)──▶ live ──(decision)──▶ decided | watching ──▶ closed
       │                                        │                             │
       └── broken / harmful ──▶ decided          └── inconclusive ──▶ decided   └── rollback ──▶ rolled_back

``shadow``: the gpu worker replays held-out prompts through no speculation, the incumbent and the
candidate (paired, same k). ``live``: the serving config splits traffic by routing weights and the
ingested records, labelled by arm, feed the sequential decision. ``watching``: the candidate was
promoted; the first requests after the promotion are checked against the canary's estimate and
a significant shortfall rolls back. Every figure behind a decision is stored on the row.

Concurrency: every state change locks the deployment row first (``SELECT ... FOR UPDATE`` on
PostgreSQL; SQLite serialises writers), and the partial unique index on ``drafter_versions``
keeps exactly one active version whatever happens.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from controlplane.audit.service import record_change
from controlplane.db.models import (
    AcceptanceRecordRow,
    Account,
    Canary,
    Deployment,
    DrafterState,
    DrafterVersion,
    DriftEvent,
    DriftState,
    Job,
    JobKind,
    JobState,
    SpeculationMode,
    utcnow,
)
from controlplane.deployments.service import active_drafter, resource_name, speculation_of
from controlplane.errors import ConflictError, NotFoundError, ValidationProblem
from controlplane.ingest.record import ARM_BASELINE, ARM_CANARY_PREFIX, ARM_LIVE

# Phases of a canary row. Open canaries are the ones still to be judged or watched.
PHASE_SHADOW = "shadow"
PHASE_LIVE = "live"
PHASE_WATCHING = "watching"
PHASE_DECIDED = "decided"
PHASE_CLOSED = "closed"
PHASE_ROLLED_BACK = "rolled_back"
OPEN_PHASES = (PHASE_SHADOW, PHASE_LIVE, PHASE_WATCHING)

DECISION_PROMOTE = "promote"
DECISION_REJECT = "reject"
DECISION_INCONCLUSIVE = "inconclusive"

CANARY_POLICY_KEYS = frozenset(
    {
        "live_canary",  # False: decide on the shadow replay alone (a fleet that cannot split traffic)
        "candidate_weight",
        "baseline_weight",
        "alpha",
        "min_samples_per_arm",
        "max_requests",
        "max_duration_s",
        "non_inferiority_margin",
        "tune_draft_length",  # apply the tuner's k on promotion
        "watch_requests",  # requests after a promotion checked against the canary's estimate
        "shadow_prompts",
        "shadow_new_tokens",
    }
)
DEFAULT_CANARY_POLICY: dict[str, Any] = {
    "live_canary": True,
    "candidate_weight": 0.1,
    "baseline_weight": 0.1,
    "alpha": 0.05,
    "min_samples_per_arm": 50,
    "max_requests": 20_000,
    "max_duration_s": 6 * 3600,
    "non_inferiority_margin": 0.02,
    "tune_draft_length": False,
    "watch_requests": 500,
    "shadow_prompts": 24,
    "shadow_new_tokens": 64,
}


@dataclass(frozen=True, slots=True)
class ReferenceModels:
    """Where loosely named models ("target", "generic-drafter") resolve to HF folders."""

    root: Path

    def resolve(self, name: str | None) -> str | None:
        if not name:
            return None
        for candidate in (Path(name), self.root / name):
            if (candidate / "config.json").is_file():
                return str(candidate)
        return name  # the serving side resolves it (a path on its own disk, or a hub-free name)


def canary_policy(
    deployment: Deployment, *, alpha: float | None = None, min_samples: int | None = None
) -> dict[str, Any]:
    """The deployment's canary policy over the defaults (settings may override the defaults)."""
    policy = dict(DEFAULT_CANARY_POLICY)
    if alpha is not None:
        policy["alpha"] = alpha
    if min_samples is not None:
        policy["min_samples_per_arm"] = min_samples
    policy.update({k: v for k, v in (deployment.canary_policy or {}).items() if k in CANARY_POLICY_KEYS})
    return policy


def validate_canary_policy(changes: dict[str, Any]) -> dict[str, Any]:
    """Check a canary-policy patch; every bad field is named in one 422."""
    problems: list[str] = []
    unknown = sorted(set(changes) - CANARY_POLICY_KEYS)
    if unknown:
        problems.append(f"unknown field(s) {unknown}; allowed: {sorted(CANARY_POLICY_KEYS)}")
    for key in ("live_canary", "tune_draft_length"):
        if key in changes and not isinstance(changes[key], bool):
            problems.append(f"{key} must be true or false")
    for key in ("candidate_weight", "baseline_weight"):
        if key in changes and not (isinstance(changes[key], int | float) and 0 < changes[key] < 0.5):
            problems.append(f"{key} must be a share in (0, 0.5)")
    if "alpha" in changes and not (isinstance(changes["alpha"], int | float) and 0 < changes["alpha"] <= 0.2):
        problems.append("alpha must be in (0, 0.2]")
    if "non_inferiority_margin" in changes and not (
        isinstance(changes["non_inferiority_margin"], int | float)
        and 0 <= changes["non_inferiority_margin"] < 0.5
    ):
        problems.append("non_inferiority_margin must be in [0, 0.5)")
    for key, low, high in (
        ("min_samples_per_arm", 5, 100_000),
        ("max_requests", 100, 10_000_000),
        ("max_duration_s", 60, 30 * 86400),
        ("watch_requests", 0, 1_000_000),
        ("shadow_prompts", 2, 10_000),
        ("shadow_new_tokens", 8, 4096),
    ):
        if key in changes and not (
            isinstance(changes[key], int)
            and not isinstance(changes[key], bool)
            and low <= changes[key] <= high
        ):
            problems.append(f"{key} must be an integer in [{low}, {high}]")
    weights = {**DEFAULT_CANARY_POLICY, **changes}
    if not problems and weights["candidate_weight"] + weights["baseline_weight"] >= 0.9:
        problems.append("candidate_weight + baseline_weight must leave the incumbent at least 10% of traffic")
    if problems:
        raise ValidationProblem("; ".join(problems), details=problems)
    return dict(changes)


def _lock_deployment(session: Session, deployment_id: int) -> Deployment:
    deployment = session.scalar(select(Deployment).where(Deployment.id == deployment_id).with_for_update())
    if deployment is None or deployment.deleted_at is not None:
        raise NotFoundError(f"deployment {deployment_id} not found")
    return deployment


def _resource(session: Session, deployment: Deployment) -> str:
    account = session.get_one(Account, deployment.account_id)
    return resource_name(account.name, deployment.name)


def open_canary(*, session: Session, deployment_id: int) -> Canary | None:
    return session.scalar(
        select(Canary)
        .where(Canary.deployment_id == deployment_id, Canary.phase.in_(OPEN_PHASES))
        .order_by(Canary.id.desc())
    )


def _latest_record_id(session: Session, deployment_id: int) -> int:
    return int(
        session.scalar(
            select(func.max(AcceptanceRecordRow.id)).where(AcceptanceRecordRow.deployment_id == deployment_id)
        )
        or 0
    )


def start_canary(
    *, session: Session, version: DrafterVersion, actor: str = "system", reason: str = "realignment succeeded"
) -> tuple[Canary, Job]:
    """Open a canary for a candidate version and queue its shadow replay (a ``canary`` job).

    An open canary of the same deployment is superseded (its candidate goes back to ``candidate``):
    the newest candidate is trained on the newest traffic. Returns the canary and its job; the
    caller commits, then sends the job to the workers.
    """
    deployment = _lock_deployment(session, version.deployment_id)
    session.refresh(version)
    if version.state not in (DrafterState.candidate, DrafterState.canary):
        raise ConflictError(f"drafter version {version.version} is {version.state.value}, not a candidate")
    previous = open_canary(session=session, deployment_id=deployment.id)
    if previous is not None:
        if previous.phase == PHASE_WATCHING:
            _close(previous, "superseded by a newer candidate while watching")
        else:
            _decide(session, previous, DECISION_INCONCLUSIVE, "superseded by a newer candidate", {})
            prev_candidate = session.get(DrafterVersion, previous.candidate_version_id)
            if prev_candidate is not None and prev_candidate.state == DrafterState.canary:
                prev_candidate.state = DrafterState.candidate
    incumbent = active_drafter(session=session, deployment_id=deployment.id)
    config = speculation_of(deployment)
    version.state = DrafterState.canary
    job = Job(
        deployment_id=deployment.id,
        kind=JobKind.canary,
        state=JobState.queued,
        requested_by=actor,
        params={"candidate_version_id": version.id},
        result={},
        progress=0.0,
        progress_message="queued",
    )
    session.add(job)
    session.flush()
    canary = Canary(
        deployment_id=deployment.id,
        candidate_version_id=version.id,
        incumbent_version_id=incumbent.id if incumbent else None,
        job_id=job.id,
        phase=PHASE_SHADOW,
        routing_weights={},
        arms={
            "candidate_version": version.version,
            "incumbent_version": incumbent.version if incumbent else None,
            "incumbent_draft_model": deployment.draft_model,
            "incumbent_mode": config.mode.value,
            "incumbent_k": config.effective_draft_token_count,
            "k": config.effective_draft_token_count or 4,
        },
        reason=reason,
    )
    session.add(canary)
    session.flush()
    job.params = {**job.params, "canary_id": canary.id}
    record_change(
        session=session,
        account_id=deployment.account_id,
        actor=actor,
        action="canary.start",
        resource=f"{_resource(session, deployment)}/canaries/{canary.id}",
        before=None,
        after={"candidate_version": version.version, "incumbent_version": canary.arms["incumbent_version"]},
    )
    return canary, job


def _decide(session: Session, canary: Canary, decision: str, reason: str, figures: dict[str, Any]) -> None:
    canary.decision = decision
    canary.reason = reason
    canary.decided_at = utcnow()
    canary.phase = PHASE_DECIDED
    canary.routing_weights = {}
    canary.arms = {**canary.arms, "decision_figures": figures}


def _close(canary: Canary, note: str) -> None:
    canary.phase = PHASE_CLOSED
    canary.arms = {**canary.arms, "watch": {**canary.arms.get("watch", {}), "closed": note}}


def get_canary(*, session: Session, deployment_id: int, canary_id: int) -> Canary:
    canary = session.get(Canary, canary_id)
    if canary is None or canary.deployment_id != deployment_id:
        raise NotFoundError(f"canary {canary_id} not found")
    return canary


def list_canaries(*, session: Session, deployment_id: int, limit: int = 50) -> list[Canary]:
    return list(
        session.scalars(
            select(Canary)
            .where(Canary.deployment_id == deployment_id)
            .order_by(Canary.id.desc())
            .limit(limit)
        )
    )


def canary_summary(session: Session, canary: Canary) -> dict[str, Any]:
    candidate = session.get(DrafterVersion, canary.candidate_version_id)
    incumbent = (
        session.get(DrafterVersion, canary.incumbent_version_id) if canary.incumbent_version_id else None
    )
    return {
        "canary_id": canary.id,
        "phase": canary.phase,
        "candidate_version": candidate.version if candidate else None,
        "incumbent_version": incumbent.version if incumbent else None,
        "job_id": canary.job_id,
        "routing_weights": canary.routing_weights,
        "arms": canary.arms,
        "decision": canary.decision,
        "reason": canary.reason,
        "started_at": canary.started_at.isoformat(),
        "decided_at": canary.decided_at.isoformat() if canary.decided_at else None,
    }


def version_summary(version: DrafterVersion) -> dict[str, Any]:
    return {
        "version": version.version,
        "state": version.state.value,
        "parent_version_id": version.parent_version_id,
        "training_job_id": version.training_job_id,
        "artifact_sha256": version.artifact_sha256,
        "traffic_window_start": version.traffic_window_start.isoformat()
        if version.traffic_window_start
        else None,
        "traffic_window_end": version.traffic_window_end.isoformat() if version.traffic_window_end else None,
        "training_metrics": version.training_metrics,
        "eval_metrics": version.eval_metrics,
        "created_at": version.created_at.isoformat(),
        "activated_at": version.activated_at.isoformat() if version.activated_at else None,
    }


def list_versions(*, session: Session, deployment_id: int) -> list[DrafterVersion]:
    return list(
        session.scalars(
            select(DrafterVersion)
            .where(DrafterVersion.deployment_id == deployment_id)
            .order_by(DrafterVersion.version.desc())
        )
    )


def get_version(*, session: Session, deployment_id: int, version: int) -> DrafterVersion:
    row = session.scalar(
        select(DrafterVersion).where(
            DrafterVersion.deployment_id == deployment_id, DrafterVersion.version == version
        )
    )
    if row is None:
        raise NotFoundError(f"drafter version {version} not found")
    return row


# --- promotion, rejection, rollback -------------------------------------------------------------


def promote(
    *,
    session: Session,
    deployment_id: int,
    version_number: int,
    actor: str,
    reason: str,
    canary: Canary | None = None,
    figures: dict[str, Any] | None = None,
    draft_token_count: int | None = None,
    expected_hit_rate: float | None = None,
) -> DrafterVersion:
    """Make a candidate the active drafter, in the caller's transaction.

    The old active version becomes ``retired`` (kept for rollback) before the new one becomes
    ``active``: the partial unique index would refuse two actives, so a concurrent promotion that
    slipped past the row lock fails instead of leaving two.
    """
    deployment = _lock_deployment(session, deployment_id)
    version = get_version(session=session, deployment_id=deployment_id, version=version_number)
    session.refresh(version)
    if version.state not in (DrafterState.candidate, DrafterState.canary):
        raise ConflictError(
            f"drafter version {version.version} is {version.state.value}; only candidates promote"
        )
    canary = canary or session.scalar(
        select(Canary)
        .where(Canary.candidate_version_id == version.id, Canary.phase.in_((PHASE_SHADOW, PHASE_LIVE)))
        .order_by(Canary.id.desc())
    )
    old = active_drafter(session=session, deployment_id=deployment_id)
    config = speculation_of(deployment)
    before = {
        "active_version": old.version if old else None,
        "speculation_mode": config.mode.value,
        "draft_model": deployment.draft_model,
        "draft_token_count": deployment.draft_token_count,
        "ngram_speculation_length": deployment.ngram_speculation_length,
    }
    if old is not None:
        old.state = DrafterState.retired
        session.flush()
    version.state = DrafterState.active
    version.activated_at = utcnow()
    # What served before, so that a rollback (by hand or automatic) can bring it back exactly.
    version.eval_metrics = {
        **(version.eval_metrics or {}),
        "promotion": {"previous_version_id": old.id if old else None, "restore": before},
    }
    if deployment.speculation_mode in (
        SpeculationMode.ngram,
        SpeculationMode.disabled,
        SpeculationMode.default,
    ):
        # A promoted drafter is what the deployment speculates with (a guardrail may have
        # switched it to n-gram or off while no drafter paid).
        deployment.speculation_mode = SpeculationMode.draft_model
        deployment.ngram_speculation_length = None
        if deployment.draft_token_count is None:
            deployment.draft_token_count = config.effective_draft_token_count or 4
    if draft_token_count is not None:
        deployment.draft_token_count = draft_token_count
    deployment.row_version += 1
    session.flush()
    after = {
        "active_version": version.version,
        "speculation_mode": deployment.speculation_mode.value,
        "draft_token_count": deployment.draft_token_count,
    }
    # The alarm that led here is answered: the drift detector re-baselines on the new version.
    _answer_drift_events(session, deployment_id)
    if canary is not None:
        _decide(session, canary, DECISION_PROMOTE, reason, figures or canary.arms.get("decision_figures", {}))
        canary.phase = PHASE_WATCHING
        canary.arms = {
            **canary.arms,
            "restore": before,
            "watch": {
                "since_record_id": _latest_record_id(session, deployment_id),
                # Hit rate depends on k: when the promotion changes k, the caller passes the
                # rate expected at the new k, else the canary's measured one stands.
                "expected_hit_rate": expected_hit_rate
                if expected_hit_rate is not None
                else _expected_hit_rate(canary),
                "expected_hit_rate_se": _expected_hit_rate_se(canary),
                # What the canary measured at its own k: if the tuned k falls short, the watch
                # goes back to this k (and this rate) before it rolls the drafter back.
                "canary_k": int(canary.arms.get("k") or 0) or None,
                "measured_hit_rate": _expected_hit_rate(canary),
                "requests": 0,
            },
        }
    record_change(
        session=session,
        account_id=deployment.account_id,
        actor=actor,
        action="drafter.promote",
        resource=f"{_resource(session, deployment)}/drafter-versions/{version.version}",
        before=before,
        after={**after, "reason": reason, "canary_id": canary.id if canary else None},
    )
    return version


def _answer_drift_events(session: Session, deployment_id: int) -> None:
    """Close the deployment's open drift events: the canary that answered them has decided.

    After a rejection or an inconclusive end the drift is still there; closing the event re-arms
    the detector, which (after its cooldown) raises a new event and so a new realignment.
    """
    session.execute(
        update(DriftEvent)
        .where(
            DriftEvent.deployment_id == deployment_id,
            DriftEvent.state.in_([DriftState.open, DriftState.realigning]),
        )
        .values(state=DriftState.resolved, resolved_at=utcnow())
        .execution_options(synchronize_session=False)
    )


def _candidate_figure(canary: Canary, name: str, low: float, high: float) -> float | None:
    """A figure of the candidate arm as the canary measured it, in [low, high): live split first,
    else shadow replay."""
    figures = canary.arms.get("decision_figures") or {}
    shadow = canary.arms.get("shadow") or {}
    for source in (
        (figures.get("arm_counts") or {}).get("candidate"),
        (shadow.get("arms") or {}).get("candidate"),
    ):
        value = source.get(name) if isinstance(source, dict) else None
        if isinstance(value, int | float) and low <= value < high:
            return float(value)
    return None


def _expected_hit_rate(canary: Canary) -> float | None:
    """The candidate's measured hit rate (strictly between 0 and 1)."""
    rate = _candidate_figure(canary, "hit_rate", 0.0, 1.0)
    return rate if rate else None


def _expected_hit_rate_se(canary: Canary) -> float | None:
    """The request-level standard error of the candidate's measured hit rate."""
    return _candidate_figure(canary, "hit_rate_se", 0.0, math.inf)


def reject(
    *, session: Session, canary: Canary, actor: str, reason: str, figures: dict[str, Any] | None = None
) -> None:
    """Reject the canary's candidate; the incumbent keeps serving."""
    deployment = _lock_deployment(session, canary.deployment_id)
    session.refresh(canary)
    if canary.phase not in (PHASE_SHADOW, PHASE_LIVE):
        raise ConflictError(f"canary {canary.id} is {canary.phase}; only an undecided canary can be rejected")
    candidate = session.get_one(DrafterVersion, canary.candidate_version_id)
    candidate.state = DrafterState.rejected
    _answer_drift_events(session, deployment.id)
    _decide(session, canary, DECISION_REJECT, reason, figures or canary.arms.get("decision_figures", {}))
    record_change(
        session=session,
        account_id=deployment.account_id,
        actor=actor,
        action="drafter.reject",
        resource=f"{_resource(session, deployment)}/drafter-versions/{candidate.version}",
        before={"state": DrafterState.canary.value},
        after={"state": DrafterState.rejected.value, "reason": reason, "canary_id": canary.id},
    )


def end_inconclusive(*, session: Session, canary: Canary, reason: str, figures: dict[str, Any]) -> None:
    """Keep the incumbent; the candidate stays a candidate (a person may still promote it)."""
    deployment = _lock_deployment(session, canary.deployment_id)
    candidate = session.get_one(DrafterVersion, canary.candidate_version_id)
    if candidate.state == DrafterState.canary:
        candidate.state = DrafterState.candidate
    _answer_drift_events(session, deployment.id)
    _decide(session, canary, DECISION_INCONCLUSIVE, reason, figures)
    record_change(
        session=session,
        account_id=deployment.account_id,
        actor="system",
        action="canary.inconclusive",
        resource=f"{_resource(session, deployment)}/canaries/{canary.id}",
        before=None,
        after={"reason": reason},
    )


def rollback(*, session: Session, deployment_id: int, actor: str, reason: str) -> DrafterVersion | None:
    """Undo the last promotion: the active version is rejected and what served before returns,
    with its k and speculation mode. Returns the version now active (None: the deployment's
    configured drafter, which has no version row, serves again).
    """
    deployment = _lock_deployment(session, deployment_id)
    current = active_drafter(session=session, deployment_id=deployment_id)
    if current is None:
        raise ConflictError("nothing to roll back: the deployment has no promoted drafter version")
    promotion = session.scalar(
        select(Canary)
        .where(Canary.candidate_version_id == current.id, Canary.decision == DECISION_PROMOTE)
        .order_by(Canary.id.desc())
    )
    record = dict((current.eval_metrics or {}).get("promotion") or {})
    restore: dict[str, Any] = dict(record.get("restore") or {})
    previous: DrafterVersion | None = None
    if record.get("previous_version_id") is not None:
        previous = session.get(DrafterVersion, int(record["previous_version_id"]))
        if previous is not None and previous.state != DrafterState.retired:
            previous = None  # rejected or deleted since: the configured drafter serves instead
    current.state = DrafterState.rejected
    session.flush()
    if previous is not None and previous.state == DrafterState.retired:
        previous.state = DrafterState.active
        previous.activated_at = utcnow()
    if restore:
        deployment.speculation_mode = SpeculationMode(
            restore.get("speculation_mode", deployment.speculation_mode)
        )
        deployment.draft_token_count = restore.get("draft_token_count")
        deployment.draft_model = restore.get("draft_model", deployment.draft_model)
        deployment.ngram_speculation_length = restore.get("ngram_speculation_length")
    deployment.row_version += 1
    if promotion is not None:
        promotion.phase = PHASE_ROLLED_BACK
        promotion.arms = {
            **promotion.arms,
            "rollback": {"reason": reason, "at": utcnow().isoformat(), "by": actor},
        }
    record_change(
        session=session,
        account_id=deployment.account_id,
        actor=actor,
        action="drafter.rollback",
        resource=f"{_resource(session, deployment)}/drafter-versions/{current.version}",
        before={"active_version": current.version},
        after={
            "active_version": previous.version if previous else None,
            "draft_token_count": deployment.draft_token_count,
            "speculation_mode": deployment.speculation_mode.value,
            "reason": reason,
        },
    )
    return previous


# --- serving config -------------------------------------------------------------------------


def serving_config(*, session: Session, deployment: Deployment, models: ReferenceModels) -> dict[str, Any]:
    """What the serving fleet should run now: one ``live`` arm, plus the canary's arms while live.

    ``config_version`` changes whenever anything in the answer changes, so a server can cache it.
    """
    config = speculation_of(deployment)
    active = active_drafter(session=session, deployment_id=deployment.id)
    k = config.effective_draft_token_count
    mode = config.mode.value
    if mode == SpeculationMode.default.value:
        mode = (
            SpeculationMode.draft_model.value
            if (active or deployment.draft_model)
            else SpeculationMode.disabled.value
        )
    live: dict[str, Any] = {
        "arm": ARM_LIVE,
        "weight": 1.0,
        "speculation": mode,
        "drafter_path": active.artifact_path if active else models.resolve(deployment.draft_model),
        "drafter_sha256": active.artifact_sha256 if active else None,
        "drafter_version": active.version if active else None,
        "k": k or 4,
        "ngram_length": deployment.ngram_speculation_length or 3,
    }
    arms = [live]
    canary = open_canary(session=session, deployment_id=deployment.id)
    if canary is not None and canary.phase == PHASE_LIVE and canary.routing_weights:
        candidate = session.get_one(DrafterVersion, canary.candidate_version_id)
        weights = canary.routing_weights
        live["weight"] = round(1.0 - weights["candidate"] - weights["baseline"], 6)
        arms.append(
            {
                "arm": f"{ARM_CANARY_PREFIX}{candidate.version}",
                "weight": weights["candidate"],
                "speculation": SpeculationMode.draft_model.value,
                "drafter_path": candidate.artifact_path,
                "drafter_sha256": candidate.artifact_sha256,
                "drafter_version": candidate.version,
                "k": int(canary.arms.get("k") or live["k"]),
                "ngram_length": live["ngram_length"],
            }
        )
        arms.append(
            {
                "arm": ARM_BASELINE,
                "weight": weights["baseline"],
                "speculation": SpeculationMode.disabled.value,
                "drafter_path": None,
                "drafter_sha256": None,
                "drafter_version": None,
                "k": 0,
                "ngram_length": live["ngram_length"],
            }
        )
    body = {
        "model": deployment.name,
        "target_path": models.resolve(deployment.target_model),
        "target_sha256": None,
        "trace_sample_rate": deployment.trace_sample_rate,
        "arms": arms,
    }
    fingerprint = hashlib.sha256(repr((deployment.row_version, body)).encode()).hexdigest()[:16]
    return {**body, "config_version": fingerprint}
