"""Canary rows: open a canary for a candidate drafter, move it through its phases
(``canary.phases``), decide it (promote, reject, inconclusive), roll a promotion back, and the
deployment's canary policy. The drafter-version side of each decision is ``drafters.service``'s;
the drift events a decision answers end here, through ``drift.events``. On a deployment with an
actuator, a promotion, a rollback and a canary's start (when its candidate pool is to load the
candidate) also write their event for the fleet (``fleet.actuators``) in the same transaction.

The automation that drives these (recording a replay, judging a live split, watching a promotion,
guardrails) is ``canary.evaluate``. Concurrency: every state change locks the deployment row first
(``deployments.lookup.lock_deployment``).
"""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from controlplane.accounts.service import Principal
from controlplane.artifacts.manifest import ArtifactVerificationError
from controlplane.artifacts.store import ArtifactStoreError, VerifiedArtifactCache
from controlplane.audit.service import record_change
from controlplane.canary.phases import OPEN, UNDECIDED, CanaryDecision, CanaryPhase, move
from controlplane.canary_policy import CanaryPolicy, CanaryPolicyError
from controlplane.config import Settings, get_settings
from controlplane.db.models import (
    Canary,
    Deployment,
    DrafterVersion,
    DriftResolution,
    Job,
    JobKind,
    JobState,
    SpeculationMode,
)
from controlplane.deployments.guardrail import guardrail_fallback
from controlplane.deployments.lookup import lock_deployment, resource_name, resource_of
from controlplane.deployments.spec import DEFAULT_DRAFT_TOKEN_COUNT, speculation_of
from controlplane.drafters import service as drafters
from controlplane.drafters.serving import incumbent_location
from controlplane.drafters.weights import canary_weights, standing_share
from controlplane.drift.events import end_unanswered_events
from controlplane.drift.service import latest_record_id
from controlplane.errors import ConflictError, NotFoundError, ValidationProblem
from controlplane.fleet import actuators
from controlplane.fleet.payloads import EVENT_CANARY_START, EVENT_PROMOTION, EVENT_ROLLBACK
from controlplane.jobs.service import (
    TRIGGER_MANUAL,
    candidate_lost_to_fallback,
    end_guardrail_fallback,
    resume_guardrail_fallback,
)
from controlplane.models.location import location_of_version
from controlplane.timestamps import parse_utc, utcnow

# --- policy ---------------------------------------------------------------------------------


def canary_policy(deployment: Deployment, settings: Settings | None = None) -> CanaryPolicy:
    """The deployment's canary policy: its stored fields over the service-wide defaults."""
    return CanaryPolicy.for_deployment(
        deployment.canary_policy,
        alpha=settings.canary_alpha if settings else None,
        min_samples=settings.canary_min_samples_per_arm if settings else None,
    )


def update_canary_policy(
    *, session: Session, principal: Principal, deployment: Deployment, changes: dict[str, Any]
) -> None:
    """Patch the deployment's stored canary policy (audited); every bad field is named in one 422
    and nothing is stored."""
    try:
        valid = CanaryPolicy.validate_changes(changes)
    except CanaryPolicyError as exc:
        raise ValidationProblem(str(exc), details=exc.problems) from exc
    before = dict(deployment.canary_policy or {})
    deployment.canary_policy = {**before, **valid}
    deployment.row_version += 1
    record_change(
        session=session,
        account_id=principal.account_id,
        actor=principal.actor,
        action="canary_policy.update",
        resource=resource_name(principal.account_name, deployment.name),
        before=before,
        after=dict(deployment.canary_policy),
    )


# --- reads ----------------------------------------------------------------------------------


def open_canary(*, session: Session, deployment_id: int) -> Canary | None:
    """The deployment's canary still being judged or watched, if any."""
    return session.scalar(
        select(Canary)
        .where(Canary.deployment_id == deployment_id, Canary.phase.in_(OPEN))
        .order_by(Canary.id.desc())
    )


def deployments_with_open_canaries(*, session: Session) -> list[int]:
    """Live deployments with a canary to judge or watch: what the beat's judge visits."""
    rows = session.scalars(
        select(Canary.deployment_id)
        .join(Deployment, Deployment.id == Canary.deployment_id)
        .where(Canary.phase.in_(OPEN), Deployment.deleted_at.is_(None))
        .distinct()
        .order_by(Canary.deployment_id)
    )
    return [int(d) for d in rows]


def record_evaluation_error(*, session: Session, deployment_id: int, error: str) -> None:
    """Count a judge tick that failed on the deployment's open canary (the tick itself was rolled
    back): ``arms["evaluation_errors"]`` keeps the count, the last error and when, for /metrics."""
    canary = open_canary(session=session, deployment_id=deployment_id)
    if canary is None:
        return
    arms = canary.arms if isinstance(canary.arms, dict) else {}
    errors = arms.get("evaluation_errors")
    count = int(errors.get("count") or 0) if isinstance(errors, dict) else 0
    canary.arms = {
        **arms,
        "evaluation_errors": {"count": count + 1, "last": error[:1000], "at": utcnow().isoformat()},
    }


def evaluation_error_count(canary: Canary) -> int:
    """How many judge ticks failed on this canary."""
    errors = canary.arms.get("evaluation_errors") if isinstance(canary.arms, dict) else None
    return int(errors.get("count") or 0) if isinstance(errors, dict) else 0


def canary_of_job(*, session: Session, job_id: int) -> Canary | None:
    return session.scalar(select(Canary).where(Canary.job_id == job_id))


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


def canary_resource(session: Session, canary: Canary) -> str:
    deployment = session.get_one(Deployment, canary.deployment_id)
    return f"{resource_of(session, deployment)}/canaries/{canary.id}"


# --- phase changes --------------------------------------------------------------------------


def start_canary(
    *, session: Session, version: DrafterVersion, actor: str = "system", reason: str = "realignment succeeded"
) -> tuple[Canary, Job]:
    """Open a canary for a candidate version and queue its shadow replay (a ``canary`` job).

    An open canary of the same deployment is superseded (its candidate goes back to ``candidate``):
    the newest candidate is trained on the newest traffic. Returns the canary and its job; the
    caller commits, then sends the job to the workers.
    """
    deployment = lock_deployment(session=session, deployment_id=version.deployment_id)
    drafters.enter_canary(session=session, version=version)
    previous = open_canary(session=session, deployment_id=deployment.id)
    if previous is not None and previous.candidate_version_id != version.id:
        if previous.phase == CanaryPhase.watching:
            close_watch(previous, "superseded by a newer candidate while watching")
        else:
            _decide(previous, CanaryDecision.inconclusive, "superseded by a newer candidate", {})
            prev_candidate = session.get(DrafterVersion, previous.candidate_version_id)
            if prev_candidate is not None:
                drafters.leave_canary(version=prev_candidate)
    elif previous is not None:
        _decide(previous, CanaryDecision.inconclusive, "superseded by a new canary of the same candidate", {})
    config = speculation_of(deployment)
    # After a guardrail switched the deployment to n-gram or off, the active version no longer
    # serves: the candidate is judged against the fallback that does (the live arm).
    incumbent = (
        drafters.active_drafter(session=session, deployment_id=deployment.id)
        if config.mode not in (SpeculationMode.ngram, SpeculationMode.disabled)
        else None
    )
    training = session.get(Job, version.training_job_id) if version.training_job_id is not None else None
    job = Job(
        deployment_id=deployment.id,
        kind=JobKind.canary,
        state=JobState.queued,
        requested_by=actor,
        # The canary answers what started its candidate's training (a candidate registered by
        # hand has no training job: a person asked).
        trigger=training.trigger if training is not None else TRIGGER_MANUAL,
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
        phase=CanaryPhase.shadow,
        routing_weights={},
        arms={
            "candidate_version": version.version,
            "incumbent_version": incumbent.version if incumbent else None,
            "incumbent_draft_model": deployment.draft_model,
            "incumbent_mode": config.mode.value,
            "incumbent_k": config.effective_draft_token_count,
            "k": config.effective_draft_token_count or DEFAULT_DRAFT_TOKEN_COUNT,
        },
        reason=reason,
        # The caller sends the replay's message once this commits: count that send now.
        shadow_sent_at=utcnow(),
        shadow_attempts=1,
    )
    session.add(canary)
    session.flush()
    job.params = {**job.params, "canary_id": canary.id}
    record_change(
        session=session,
        account_id=deployment.account_id,
        actor=actor,
        action="canary.start",
        resource=canary_resource(session, canary),
        before=None,
        after={"candidate_version": version.version, "incumbent_version": canary.arms["incumbent_version"]},
    )
    return canary, job


def go_live(*, session: Session, canary: Canary, policy: CanaryPolicy, shadow_decision: str) -> None:
    """shadow -> live: the serving config starts splitting traffic by the policy's weights."""
    canary.phase = move(canary.phase, CanaryPhase.live)
    # The split judged (and checked for sample-ratio mismatch) is the one the serving config
    # routes: its baseline arm takes the deployment's standing no-speculation share when larger.
    owner = session.get_one(Deployment, canary.deployment_id)
    share = standing_share(
        owner.adaptation_policy, speculating=owner.speculation_mode != SpeculationMode.disabled
    )
    split = canary_weights(policy.candidate_weight, policy.baseline_weight, share)
    canary.routing_weights = {"candidate": split["candidate"], "baseline": split["baseline"]}
    canary.arms = {
        **canary.arms,
        "live_since_record_id": latest_record_id(session, canary.deployment_id),
        "live_started_at": utcnow().isoformat(),
    }
    deployment = session.get_one(Deployment, canary.deployment_id)
    record_change(
        session=session,
        account_id=deployment.account_id,
        actor="system",
        action="canary.live",
        resource=canary_resource(session, canary),
        before=None,
        after={"routing_weights": canary.routing_weights, "shadow_decision": shadow_decision},
    )


POOL_WAITING, POOL_READY = "waiting", "ready"


def pool_state(canary: Canary) -> str | None:
    """``waiting`` while a passed shadow canary waits for its candidate pool, ``ready`` after."""
    pool = canary.arms.get("pool")
    return str(pool.get("state")) if isinstance(pool, dict) else None


def wait_for_pool(
    *,
    session: Session,
    canary: Canary,
    deployment: Deployment,
    shadow_decision: str,
    settings: Settings | None = None,
) -> None:
    """The shadow replay passed on a deployment with an actuator: tell the fleet to load the
    candidate (``canary-start``) and keep the canary in ``shadow``, with no traffic split, until
    its candidate pool is ready (``pool_ready``) or ``ready_timeout_s`` runs out."""
    now = utcnow()
    timeout = actuators.ready_timeout_s(deployment)
    canary.arms = {
        **canary.arms,
        "pool": {
            "state": POOL_WAITING,
            "since": now.isoformat(),
            "deadline": (now + timedelta(seconds=timeout)).isoformat(),
            "ready_timeout_s": timeout,
            "shadow_decision": shadow_decision,
        },
    }
    candidate = session.get_one(DrafterVersion, canary.candidate_version_id)
    actuators.record_event(
        session=session,
        deployment=deployment,
        event=EVENT_CANARY_START,
        canary=canary,
        version=candidate,
        k=int(canary.arms.get("k") or DEFAULT_DRAFT_TOKEN_COUNT),
        settings=settings,
    )
    record_change(
        session=session,
        account_id=deployment.account_id,
        actor="system",
        action="canary.pool_waiting",
        resource=canary_resource(session, canary),
        before=None,
        after={"deadline": canary.arms["pool"]["deadline"], "shadow_decision": shadow_decision},
    )


def pool_deadline_passed(canary: Canary) -> bool:
    deadline = (canary.arms.get("pool") or {}).get("deadline")
    return isinstance(deadline, str) and utcnow() > parse_utc(deadline)


def pool_ready(
    *, session: Session, canary: Canary, policy: CanaryPolicy, by: str, evidence: dict[str, Any]
) -> bool:
    """The candidate pool is ready: a waiting canary goes live (as ``go_live`` does without an
    actuator). False, and nothing changes, for a canary that is not waiting (say, a second call)."""
    lock_deployment(session=session, deployment_id=canary.deployment_id)
    session.refresh(canary)
    if canary.phase != CanaryPhase.shadow or pool_state(canary) != POOL_WAITING:
        return False
    pool = dict(canary.arms["pool"])
    go_live(session=session, canary=canary, policy=policy, shadow_decision=str(pool.get("shadow_decision")))
    canary.arms = {
        **canary.arms,
        "pool": {**pool, "state": POOL_READY, "ready_at": utcnow().isoformat(), "by": by, **evidence},
    }
    return True


def close_watch(canary: Canary, note: str) -> None:
    """watching -> closed: the promotion stands (or a newer candidate takes over the watch)."""
    canary.phase = move(canary.phase, CanaryPhase.closed)
    canary.arms = {**canary.arms, "watch": {**canary.arms.get("watch", {}), "closed": note}}


def _decide(canary: Canary, decision: CanaryDecision, reason: str, figures: dict[str, Any]) -> None:
    canary.phase = move(canary.phase, CanaryPhase.decided)
    canary.decision = decision
    canary.reason = reason
    canary.decided_at = utcnow()
    canary.routing_weights = {}
    canary.arms = {**canary.arms, "decision_figures": figures}


# --- decisions ------------------------------------------------------------------------------


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
    """Make a candidate the active drafter and watch it, in the caller's transaction; the drift
    events it answers end as ``promoted`` (the detector re-baselines on the new version)."""
    deployment = lock_deployment(session=session, deployment_id=deployment_id)
    version = drafters.get_version(session=session, deployment_id=deployment_id, version=version_number)
    if canary is not None and canary.phase not in UNDECIDED:
        raise ConflictError(
            f"canary {canary.id} is {canary.phase}; "
            f"promote its candidate as drafter version {version.version}"
        )
    canary = canary or session.scalar(
        select(Canary)
        .where(Canary.candidate_version_id == version.id, Canary.phase.in_(UNDECIDED))
        .order_by(Canary.id.desc())
    )
    _refuse_unverified(version)
    fallback = guardrail_fallback(deployment)  # read before the promotion switches the mode back
    restore = drafters.promote_version(
        session=session,
        deployment=deployment,
        version=version,
        actor=actor,
        reason=reason,
        draft_token_count=draft_token_count,
        canary_id=canary.id if canary else None,
    )
    end_drift_events(
        session=session, deployment_id=deployment_id, resolution=DriftResolution.promoted, reason=reason
    )
    # A drafter serves again: a guardrail fallback it ended needs no more realignments (kept on
    # the canary, so that a rollback to the fallback resumes them).
    if canary is not None and fallback is not None:
        canary.arms = {**canary.arms, "guardrail_fallback": fallback}
    end_guardrail_fallback(
        session=session,
        deployment=deployment,
        actor=actor,
        reason=f"drafter version {version.version} promoted",
    )
    actuators.record_event(
        session=session, deployment=deployment, event=EVENT_PROMOTION, canary=canary, version=version
    )
    if canary is not None:
        canary.phase = move(canary.phase, CanaryPhase.watching)
        canary.decision = CanaryDecision.promote
        canary.reason = reason
        canary.decided_at = utcnow()
        canary.routing_weights = {}
        # The figures first: the watch's expectations below are read from them.
        canary.arms = {**canary.arms, "decision_figures": figures or canary.arms.get("decision_figures", {})}
        canary.arms = {
            **canary.arms,
            "restore": restore,
            "watch": {
                "since_record_id": latest_record_id(session, deployment_id),
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
    return version


class UnverifiedArtifactError(ConflictError):
    """The candidate's artifact no longer matches its manifest: it is never promoted."""


def _refuse_unverified(version: DrafterVersion) -> None:
    """A version whose artifact no longer matches its manifest is never promoted.

    Versions registered before artifacts recorded a manifest digest have none to check here; the
    servers still verify their folder's own manifest when they load them.
    """
    if version.manifest_sha256 is None:
        return
    settings = get_settings()
    location = location_of_version(version)
    cache = VerifiedArtifactCache(settings.artifact_cache_dir, s3_endpoint_url=settings.s3_endpoint_url)
    try:
        cache.local_folder(location.uri, location.manifest_sha256)
    except (ArtifactVerificationError, ArtifactStoreError, ValueError) as exc:
        raise UnverifiedArtifactError(
            f"drafter version {version.version} failed verification and is not promoted: {exc}"
        ) from exc


def reject(
    *,
    session: Session,
    canary: Canary,
    actor: str,
    reason: str,
    figures: dict[str, Any] | None = None,
    resolution: DriftResolution = DriftResolution.candidate_rejected,
) -> None:
    """Reject the canary's candidate; the incumbent keeps serving and the drift events it answered
    end with ``resolution``."""
    deployment = lock_deployment(session=session, deployment_id=canary.deployment_id)
    session.refresh(canary)
    if canary.phase not in UNDECIDED:
        raise ConflictError(f"canary {canary.id} is {canary.phase}; only an undecided canary can be rejected")
    candidate = session.get_one(DrafterVersion, canary.candidate_version_id)
    drafters.reject_version(
        session=session, version=candidate, actor=actor, reason=reason, canary_id=canary.id
    )
    end_drift_events(session=session, deployment_id=deployment.id, resolution=resolution, reason=reason)
    _decide(canary, CanaryDecision.reject, reason, figures or canary.arms.get("decision_figures", {}))
    _retry_after_fallback_win(session, deployment, canary)


def end_inconclusive(
    *,
    session: Session,
    canary: Canary,
    reason: str,
    figures: dict[str, Any],
    resolution: DriftResolution = DriftResolution.canary_inconclusive,
) -> None:
    """Keep the incumbent; the candidate stays a candidate (a person may still promote it).

    The drift is likely still there: ending its event re-arms the detector, which (after its
    cooldown) raises a new event and so a new realignment.
    """
    deployment = lock_deployment(session=session, deployment_id=canary.deployment_id)
    candidate = session.get_one(DrafterVersion, canary.candidate_version_id)
    drafters.leave_canary(version=candidate)
    end_drift_events(session=session, deployment_id=deployment.id, resolution=resolution, reason=reason)
    _decide(canary, CanaryDecision.inconclusive, reason, figures)
    record_change(
        session=session,
        account_id=deployment.account_id,
        actor="system",
        action="canary.inconclusive",
        resource=canary_resource(session, canary),
        before=None,
        after={"reason": reason},
    )
    _retry_after_fallback_win(session, deployment, canary)


def _retry_after_fallback_win(session: Session, deployment: Deployment, canary: Canary) -> None:
    """A candidate judged against the fallback a guardrail switched to did not beat it: the loop
    tries again, after a longer wait (``jobs.service.candidate_lost_to_fallback``)."""
    if canary.arms.get("incumbent_mode") in (SpeculationMode.ngram.value, SpeculationMode.disabled.value):
        candidate_lost_to_fallback(session=session, deployment=deployment, settings=get_settings())


def end_drift_events(
    *, session: Session, deployment_id: int, resolution: DriftResolution, reason: str
) -> list[int]:
    """End the deployment's unanswered drift events with ``resolution`` and the sentence that says
    why (a canary decision, a replay that never answered, a guardrail); the detector re-arms."""
    return end_unanswered_events(
        session=session, deployment_id=deployment_id, resolution=resolution, reason=reason
    )


def rollback(*, session: Session, deployment_id: int, actor: str, reason: str) -> DrafterVersion | None:
    """Undo the last promotion (``drafters.roll_back``) and mark its canary rolled back. Returns
    the version now active (None: the deployment's configured drafter serves again)."""
    deployment = lock_deployment(session=session, deployment_id=deployment_id)
    current = drafters.active_drafter(session=session, deployment_id=deployment_id)
    promotion = (
        session.scalar(
            select(Canary)
            .where(Canary.candidate_version_id == current.id, Canary.decision == CanaryDecision.promote)
            .order_by(Canary.id.desc())
        )
        if current is not None
        else None
    )
    outcome = drafters.roll_back(session=session, deployment=deployment, actor=actor, reason=reason)
    if actuators.waits_for_pool(deployment):
        # What serves again: the previous version, else the registered drafter (if any).
        fallback = None
        if outcome.restored is None:
            registered = incumbent_location(session=session, deployment=deployment)
            fallback = registered.uri if registered is not None else None
        actuators.record_event(
            session=session,
            deployment=deployment,
            event=EVENT_ROLLBACK,
            canary=promotion,
            version=outcome.restored,
            fallback_uri=fallback,
        )
    if promotion is not None:
        promotion.phase = move(promotion.phase, CanaryPhase.rolled_back)
        promotion.arms = {
            **promotion.arms,
            "rollback": {"reason": reason, "at": utcnow().isoformat(), "by": actor},
        }
        fallback = promotion.arms.get("guardrail_fallback")
        if isinstance(fallback, dict) and actor == "system":
            # The watch put the fallback a guardrail chose back: the loop goes on trying drafters
            # (a person's rollback is theirs to follow up).
            resume_guardrail_fallback(
                session=session, deployment=deployment, settings=get_settings(), marker=fallback
            )
    return outcome.restored


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
