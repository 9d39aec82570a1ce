"""The speculation check's service: advance each deployment's standing test over its new
acceptance records, store the verdict, and act when speculation does not pay.

The test (:mod:`controlplane.speculation_check.sequential`) compares the ``live`` arm with the
standing no-speculation ``baseline`` arm (``controlplane.drafters.serving``). Its sums live on the
deployment's ``SpeculationCheck`` row with a watermark, so each run reads only new records; as in
the drift monitor, only ids up to the newest id the previous run saw are consumed (ids become
visible when their transaction commits). Only records written under a serving key count: an
ingest key must not be able to switch speculation off. A new serving set-up (mode, drafter,
k, draft-stop threshold) starts a new test from the newest record.

When speculation does not pay, one action, in this order, each tried once until speculation pays
again (the ``ladder``):

1. ``draft_length``: the live per-position acceptance, the measured live step cost and a
   measured verify-cost curve for the deployment's target model (the newest shadow replay's, of
   this deployment or another of the account's with the same target) say another k pays: set it
   (the active version cannot be canaried against itself: drafter versions are canaried only as
   candidates) and keep testing at the new k. Without a measured curve k is never changed: a
   plan on the flat-verify assumption is recorded, not acted on
   (:meth:`~controlplane.speculation_check.sequential.PaysTest.draft_length_plan` says why);
2. ``realign``: the deployment realigns automatically, has traces and GPU budget left: request a
   realignment (``Job.trigger = "unprofitable"``); its candidate is canaried against no
   speculation as a drift's is;
3. ``fallback_ngram`` (a drafter served) or ``fallback_disabled`` (n-gram served): switch, as the
   canary's guardrail does, and enter the guardrail fallback, whose realignments try to win the
   deployment back (``jobs.service.enter_guardrail_fallback``).

Every action is stored with its reason and time, audited (``speculation_check.<action>``), and
followed by a fresh test: the evidence that caused it never causes another. No action is taken
while a canary is judging the deployment against no speculation itself, or while a realignment
is queued or running outside a guardrail fallback.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from controlplane.adaptation.service import deployment_gpu_seconds
from controlplane.adaptation_policy import AdaptationPolicy
from controlplane.audit.service import record_change
from controlplane.canary.phases import UNDECIDED
from controlplane.canary.tuning_view import verify_cost_of
from controlplane.config import Settings
from controlplane.db.models import (
    AcceptanceRecordRow,
    Canary,
    Deployment,
    SpeculationCheck,
    SpeculationMode,
    Trace,
)
from controlplane.deployments.guardrail import guardrail_fallback
from controlplane.deployments.lookup import lock_deployment, resource_of
from controlplane.deployments.spec import speculation_of
from controlplane.drafters.service import active_drafter
from controlplane.drafters.serving import incumbent_location
from controlplane.drafters.weights import standing_share
from controlplane.drift.service import latest_record_id
from controlplane.errors import NotFoundError
from controlplane.ingest.record import ARM_BASELINE, ARM_LIVE
from controlplane.jobs.service import (
    REALIGNABLE_MODES,
    TRIGGER_UNPROFITABLE,
    active_realign_job,
    enter_guardrail_fallback,
    request_realign,
)
from controlplane.speculation_check.sequential import NOT_PAYING, PAYS, UNKNOWN, PaysTest, PaysVerdict
from controlplane.timestamps import as_utc, utcnow

ACTOR = "speculation-check"
AUDIT_PREFIX = "speculation_check."
ACTION_DRAFT_LENGTH = "draft_length"
ACTION_REALIGN = "realign"
ACTION_NGRAM = "fallback_ngram"
ACTION_DISABLED = "fallback_disabled"
ACTIONS = (ACTION_DRAFT_LENGTH, ACTION_REALIGN, ACTION_NGRAM, ACTION_DISABLED)
# What the API shows of the draft-length plan (the full table stays in the service).
DRAFT_LENGTH_PLAN_FIELDS = (
    "best_k",
    "best_speedup",
    "cost_ratio",
    "measured_step_cost",
    "cost_model",
    "verify_cost_source",
    "verify_cost_at_live_k",
    "verify_cost_at_best_k",
    "worst_case_speedup",
    "actionable",
    "why",
)
# At most this many records are folded per run: a deployment far behind catches up over several.
BATCH_LIMIT = 50_000
HISTORY_KEPT = 20
# Canaries searched for a measured verify-cost curve, newest first.
COST_CANARIES_SEARCHED = 20


@dataclass(frozen=True)
class VerifyCostCurve:
    """A measured cost of verifying k + 1 tokens relative to one, by k, and where it came from."""

    verify_cost: dict[int, float]
    source: str


@dataclass
class CheckOutcome:
    """What one run did: the verdict, the action taken (if any) and the realignment jobs to send."""

    deployment_id: int
    verdict: str
    action: str | None = None
    records_consumed: int = 0
    realign_jobs: list[int] = field(default_factory=list)
    skipped: str | None = None


def serving_key(*, session: Session, deployment: Deployment) -> dict[str, Any]:
    """The set-up the live arm serves now; a test belongs to one (a change starts a new one)."""
    config = speculation_of(deployment)
    active = active_drafter(session=session, deployment_id=deployment.id)
    mode = config.mode.value
    if mode == SpeculationMode.default.value:
        drafter = incumbent_location(session=session, deployment=deployment, active=active)
        mode = SpeculationMode.draft_model.value if drafter is not None else SpeculationMode.disabled.value
    uses_drafter = mode == SpeculationMode.draft_model.value
    return {
        "mode": mode,
        "drafter_version": active.version if active is not None and uses_drafter else None,
        "draft_model": deployment.draft_model if uses_drafter else None,
        "k": config.effective_draft_token_count if mode != SpeculationMode.disabled.value else 0,
        "draft_confidence_threshold": deployment.draft_confidence_threshold if uses_drafter else None,
    }


def _served_by_key(row: Any, key: dict[str, Any]) -> bool:
    """Whether a live record was served by the key's set-up: servers pick a change up within a
    config poll, so records of the previous set-up may still arrive after a restart."""
    if row.k is not None and key["k"] and row.k != key["k"]:
        return False
    return key["drafter_version"] is None or row.drafter_version == key["drafter_version"]


def _stored_test(state: dict[str, Any]) -> PaysTest | None:
    stored = state.get("test")
    if not isinstance(stored, dict):
        return None
    try:
        return PaysTest.from_state(stored)
    except ValueError:
        return None  # written by another version of this code: start over


def _check_row(session: Session, deployment_id: int, latest: int) -> SpeculationCheck:
    check = session.get(SpeculationCheck, deployment_id)
    if check is None:
        # History before the first run was served under set-ups nobody recorded: start now.
        check = SpeculationCheck(
            deployment_id=deployment_id,
            watermark_record_id=latest,
            records_examined=0,
            state={},
            verdict=UNKNOWN,
        )
        session.add(check)
    return check


def run_check(
    *, session: Session, deployment_id: int, settings: Settings, batch_limit: int = BATCH_LIMIT
) -> CheckOutcome:
    """Advance the deployment's test over its settled new records, store the verdict, and act when
    speculation does not pay. Runs in the caller's transaction, under the deployment's row lock."""
    try:
        deployment = lock_deployment(session=session, deployment_id=deployment_id)
    except NotFoundError:
        return CheckOutcome(deployment_id, UNKNOWN, skipped="deployment gone")
    policy = AdaptationPolicy.for_deployment(deployment.adaptation_policy)
    key = serving_key(session=session, deployment=deployment)
    latest = latest_record_id(session, deployment_id)
    now = utcnow()
    check = _check_row(session, deployment_id, latest)
    state = dict(check.state or {})
    test = _stored_test(state)
    if test is None or test.key != key:
        test = PaysTest(key)
        check.watermark_record_id = latest
        state["horizon"] = latest
        state["started_at"] = now.isoformat()
    share = standing_share(
        deployment.adaptation_policy, speculating=key["mode"] != SpeculationMode.disabled.value
    )
    if share <= 0:
        reason = (
            "speculation is off: there is nothing to compare with no speculation"
            if key["mode"] == SpeculationMode.disabled.value
            else "the standing no-speculation share is 0: nothing measures whether speculation pays"
        )
        test = PaysTest(key)
        check.watermark_record_id = latest
        _store(check, state, test, None, verdict=UNKNOWN, reason=reason, now=now, horizon=latest)
        return CheckOutcome(deployment_id, UNKNOWN, skipped=reason)

    horizon = int(state.get("horizon") or check.watermark_record_id)
    rows = (
        session.execute(
            select(
                AcceptanceRecordRow.id,
                AcceptanceRecordRow.arm,
                AcceptanceRecordRow.k,
                AcceptanceRecordRow.drafter_version,
                AcceptanceRecordRow.generated_tokens,
                AcceptanceRecordRow.verify_steps,
                AcceptanceRecordRow.drafted_tokens,
                AcceptanceRecordRow.accepted_tokens,
                AcceptanceRecordRow.accepted_per_position,
                AcceptanceRecordRow.inter_token_ms,
                AcceptanceRecordRow.total_ms,
                AcceptanceRecordRow.ttft_ms,
            )
            .where(
                AcceptanceRecordRow.deployment_id == deployment_id,
                AcceptanceRecordRow.id > check.watermark_record_id,
                AcceptanceRecordRow.id <= horizon,
                AcceptanceRecordRow.arm.in_([ARM_LIVE, ARM_BASELINE]),
                AcceptanceRecordRow.from_serving_key.is_(True),
            )
            .order_by(AcceptanceRecordRow.id)
            .limit(batch_limit)
        ).all()
        if horizon > check.watermark_record_id
        else []
    )
    for row in rows:
        if row.arm == ARM_LIVE and not _served_by_key(row, key):
            continue
        test.add(row.arm, row)
    if rows and len(rows) == batch_limit:
        check.watermark_record_id = rows[-1].id  # the rest of the settled range next run
    else:
        check.watermark_record_id, horizon = horizon, latest
    check.records_examined = int(check.records_examined or 0) + len(rows)
    verdict = test.verdict(alpha=policy.pays_alpha, min_requests_per_arm=policy.pays_min_requests_per_arm)
    outcome = CheckOutcome(deployment_id, verdict.verdict, records_consumed=len(rows))
    ladder = [str(a) for a in state.get("ladder") or []]
    reason = verdict.reason
    if verdict.verdict == PAYS and ladder:
        ladder = []  # what was tried helped: a later slowdown starts from the first rung again
    if verdict.verdict == NOT_PAYING:
        blocked = _busy(session, deployment)
        if blocked is not None:
            reason = f"{reason}; no action now: {blocked}"
        else:
            action, detail, jobs = _act(
                session, deployment, test, key, ladder, settings, policy, verdict, now
            )
            reason = f"{reason}; {detail}"
            if action is not None:
                outcome.action, outcome.realign_jobs = action, jobs
                ladder.append(action)
                check.action, check.acted_at = action, now
                history = list(state.get("history") or [])[-(HISTORY_KEPT - 1) :]
                state["history"] = [
                    *history,
                    {"action": action, "at": now.isoformat(), "detail": detail, "ratio": verdict.ratio},
                ]
                state["acted_on"] = verdict.as_dict()
                # Fresh evidence only: the records that caused this action never cause another.
                test = PaysTest(serving_key(session=session, deployment=deployment))
                check.watermark_record_id = horizon = latest_record_id(session, deployment_id)
                state["started_at"] = now.isoformat()
    state["ladder"] = ladder
    _store(check, state, test, verdict, verdict=verdict.verdict, reason=reason, now=now, horizon=horizon)
    return outcome


def _store(
    check: SpeculationCheck,
    state: dict[str, Any],
    test: PaysTest,
    figures: PaysVerdict | None,
    *,
    verdict: str,
    reason: str,
    now: datetime,
    horizon: int,
) -> None:
    check.verdict = verdict
    check.reason = reason[:2000]
    check.checked_at = now
    # A new dict: an in-place change of the stored value would compare equal and never be written.
    check.state = {
        **state,
        "test": test.to_state(),
        "horizon": horizon,
        "figures": figures.as_dict() if figures is not None else None,
    }


def _busy(session: Session, deployment: Deployment) -> str | None:
    """Why the check must not act now, else None."""
    canary = session.scalar(
        select(Canary.id).where(Canary.deployment_id == deployment.id, Canary.phase.in_(UNDECIDED))
    )
    if canary is not None:
        return f"canary {canary} is judging the deployment against no speculation"
    job = active_realign_job(session=session, deployment_id=deployment.id)
    if job is not None and guardrail_fallback(deployment) is None:
        return f"realignment job {job.id} is {job.state.value}"
    return None


def _has_traces(session: Session, deployment_id: int) -> bool:
    return session.scalar(select(Trace.id).where(Trace.deployment_id == deployment_id).limit(1)) is not None


def measured_verify_cost(*, session: Session, deployment: Deployment) -> VerifyCostCurve | None:
    """The newest shadow replay's verify-cost curve for the deployment's target model: its own
    canaries first, then those of the account's other deployments serving the same target (the
    cost of a wider verify pass belongs to the target and the hardware, not to a drafter). None
    when no replay measured one. Another account's measurements are never read."""
    own = Canary.deployment_id == deployment.id
    rows = session.execute(
        select(Canary.id, Canary.deployment_id, Canary.arms)
        .join(Deployment, Deployment.id == Canary.deployment_id)
        .where(
            Deployment.account_id == deployment.account_id,
            Deployment.target_model == deployment.target_model,
        )
        .order_by(own.desc(), Canary.id.desc())
        .limit(COST_CANARIES_SEARCHED)
    )
    for canary_id, deployment_id, arms in rows:
        costs = ((arms or {}).get("shadow") or {}).get("costs") or {}
        try:
            curve = verify_cost_of(costs)
        except (TypeError, ValueError):
            continue  # a stored figure this code cannot read is no measurement
        if curve:
            where = "" if deployment_id == deployment.id else f" of deployment {deployment_id}"
            return VerifyCostCurve(curve, f"canary {canary_id}{where} shadow replay")
    return None


def _plan(test: PaysTest, key: dict[str, Any], curve: VerifyCostCurve | None) -> dict[str, Any] | None:
    return test.draft_length_plan(
        k=int(key.get("k") or 0),
        verify_cost=curve.verify_cost if curve is not None else None,
        verify_cost_source=curve.source if curve is not None else None,
    )


def _act(
    session: Session,
    deployment: Deployment,
    test: PaysTest,
    key: dict[str, Any],
    ladder: list[str],
    settings: Settings,
    policy: AdaptationPolicy,
    verdict: PaysVerdict,
    now: datetime,
) -> tuple[str | None, str, list[int]]:
    """The next rung of the ladder: (action or None, what was done or why nothing, jobs to send)."""
    mode = key["mode"]
    skipped: list[str] = []
    # What the draft-length rung saw, audited with whichever rung acts (its cost model included).
    considered: dict[str, Any] = {}
    if mode == SpeculationMode.draft_model.value:
        if ACTION_DRAFT_LENGTH in ladder or ACTION_REALIGN in ladder:
            skipped.append("another k was already tried")
        else:
            curve = measured_verify_cost(session=session, deployment=deployment)
            plan = _plan(test, key, curve)
            if plan is not None and plan["actionable"]:
                best = int(plan["best_k"])
                _set_draft_length(session, deployment, best, plan, verdict)
                return (
                    ACTION_DRAFT_LENGTH,
                    f"k {key['k']} -> {best}: the live acceptance and measured costs expect "
                    f"{plan['best_speedup']:.2f}x no speculation there "
                    f"(verify cost {plan['verify_cost_at_best_k']:.2f} at k {best}, "
                    f"from {plan['verify_cost_source']})",
                    [],
                )
            if plan is not None:
                considered = {"draft_length_plan": {f: plan[f] for f in DRAFT_LENGTH_PLAN_FIELDS}}
            skipped.append(
                f"k unchanged: {plan['why']}"
                if plan is not None
                else "no per-position acceptance to plan another k with"
            )
        realign_blocker = _realign_blocker(session, deployment, ladder, policy, now)
        if realign_blocker is None:
            request = request_realign(
                session=session,
                deployment=deployment,
                actor=ACTOR,
                settings=settings,
                trigger=TRIGGER_UNPROFITABLE,
            )
            why_not_earlier = "; ".join(skipped)
            _audit(
                session,
                deployment,
                ACTION_REALIGN,
                {"job_id": request.job.id, "why_not_earlier": why_not_earlier, **considered},
                verdict,
            )
            jobs = [request.job.id] if request.created else []
            why = f" ({why_not_earlier})" if why_not_earlier else ""
            return ACTION_REALIGN, f"realignment job {request.job.id} requested{why}", jobs
        skipped.append(realign_blocker)
    if mode in (SpeculationMode.draft_model.value, SpeculationMode.ngram.value):
        action = _fall_back(session, deployment, key, settings, verdict, "; ".join(skipped), considered)
        target = "n-gram lookup" if action == ACTION_NGRAM else "no speculation"
        why = f" ({'; '.join(skipped)})" if skipped else ""
        return action, f"switched to {target}{why}", []
    return None, f"no action for speculation mode {mode}", []


def _realign_blocker(
    session: Session, deployment: Deployment, ladder: list[str], policy: AdaptationPolicy, now: datetime
) -> str | None:
    if ACTION_REALIGN in ladder:
        return "a realignment was already tried"
    if not deployment.auto_realign:
        return "the deployment does not realign automatically"
    if deployment.speculation_mode not in REALIGNABLE_MODES:
        return "its speculation mode has no drafter to realign"
    if not _has_traces(session, deployment.id):
        return "no traces to realign on"
    used = deployment_gpu_seconds(session=session, deployment_id=deployment.id, now=now)
    if used >= policy.gpu_seconds_per_day:
        return f"the day's GPU budget is spent ({used:.0f} of {policy.gpu_seconds_per_day:g} s)"
    return None


def _audit(
    session: Session, deployment: Deployment, action: str, after: dict[str, Any], verdict: PaysVerdict
) -> None:
    record_change(
        session=session,
        account_id=deployment.account_id,
        actor=ACTOR,
        action=f"{AUDIT_PREFIX}{action}",
        resource=resource_of(session, deployment),
        before=None,
        after={
            **after,
            "reason": verdict.reason,
            "ratio": verdict.ratio,
            "ratio_low": verdict.ratio_low,
            "live_requests": verdict.live_requests,
            "baseline_requests": verdict.baseline_requests,
        },
    )


def _set_draft_length(
    session: Session, deployment: Deployment, k: int, plan: dict[str, Any], verdict: PaysVerdict
) -> None:
    before = deployment.draft_token_count
    deployment.draft_token_count = k
    deployment.row_version += 1
    _audit(
        session,
        deployment,
        ACTION_DRAFT_LENGTH,
        {
            "draft_token_count_before": before,
            "draft_token_count": k,
            "expected_speedup": plan["best_speedup"],
            "cost_ratio": plan["cost_ratio"],
            "cost_model": plan["cost_model"],
            "verify_cost_source": plan["verify_cost_source"],
            "measured_step_cost": plan["measured_step_cost"],
            "verify_cost_at_live_k": plan["verify_cost_at_live_k"],
            "verify_cost_at_best_k": plan["verify_cost_at_best_k"],
        },
        verdict,
    )


def _fall_back(
    session: Session,
    deployment: Deployment,
    key: dict[str, Any],
    settings: Settings,
    verdict: PaysVerdict,
    why: str,
    considered: dict[str, Any],
) -> str:
    """A drafter that does not pay gives way to n-gram lookup; n-gram lookup that does not pay, to
    no speculation (as the canary's guardrail does). The guardrail fallback it enters keeps
    realigning the drafter that served, and a promotion switches back to a drafter."""
    previous_version = key["drafter_version"]
    previous_draft_model = deployment.draft_model
    before = {
        "speculation_mode": deployment.speculation_mode.value,
        "draft_model": deployment.draft_model,
        "ngram_speculation_length": deployment.ngram_speculation_length,
    }
    if key["mode"] == SpeculationMode.draft_model.value:
        action = ACTION_NGRAM
        deployment.speculation_mode = SpeculationMode.ngram
        deployment.draft_model = None  # n-gram and a draft model are exclusive (a DB constraint)
        deployment.ngram_speculation_length = deployment.ngram_speculation_length or 3
    else:
        action = ACTION_DISABLED
        deployment.speculation_mode = SpeculationMode.disabled
    deployment.row_version += 1
    _audit(
        session,
        deployment,
        action,
        {
            "before": before,
            "speculation_mode": deployment.speculation_mode.value,
            "why_not_earlier": why,
            **considered,
        },
        verdict,
    )
    enter_guardrail_fallback(
        session=session,
        deployment=deployment,
        settings=settings,
        previous_draft_model=previous_draft_model,
        previous_version=previous_version,
        reason=f"speculation check: {verdict.reason}"[:500],
    )
    return action


# --- reading ------------------------------------------------------------------------------------


def _iso(moment: datetime | None) -> str | None:
    return as_utc(moment).isoformat() if moment is not None else None


def check_status(*, session: Session, deployment: Deployment) -> dict[str, Any]:
    """What the API shows: the verdict, why, the last action, and the figures behind them."""
    check = session.get(SpeculationCheck, deployment.id)
    policy = AdaptationPolicy.for_deployment(deployment.adaptation_policy)
    state = dict(check.state or {}) if check is not None else {}
    stored_figures = state.get("figures")
    figures: dict[str, Any] = stored_figures if isinstance(stored_figures, dict) else {}
    test = _stored_test(state)
    plan = (
        _plan(test, test.key, measured_verify_cost(session=session, deployment=deployment))
        if test is not None
        else None
    )
    return {
        "verdict": check.verdict if check is not None else UNKNOWN,
        "reason": check.reason if check is not None else "not checked yet",
        "action": check.action if check is not None else None,
        "acted_at": _iso(check.acted_at if check is not None else None),
        "checked_at": _iso(check.checked_at if check is not None else None),
        "records_examined": int(check.records_examined or 0) if check is not None else 0,
        "standing_baseline_share": policy.standing_baseline_share,
        "alpha": policy.pays_alpha,
        "min_requests_per_arm": policy.pays_min_requests_per_arm,
        "arms": {
            ARM_LIVE: {
                "requests": int(figures.get("live_requests") or 0),
                "ms_per_token": figures.get("live_ms_per_token"),
            },
            ARM_BASELINE: {
                "requests": int(figures.get("baseline_requests") or 0),
                "ms_per_token": figures.get("baseline_ms_per_token"),
            },
        },
        "ratio": figures.get("ratio"),
        "ratio_low": figures.get("ratio_low"),
        "ratio_high": figures.get("ratio_high"),
        "serving": test.key if test is not None else None,
        "test_started_at": state.get("started_at"),
        "draft_length_plan": {field: plan[field] for field in DRAFT_LENGTH_PLAN_FIELDS}
        if plan is not None
        else None,
        "ladder": list(state.get("ladder") or []),
        "history": list(state.get("history") or []),
    }
