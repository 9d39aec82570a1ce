"""The draft tuning a deployment shows: expected speed-up for each k from its live per-position
acceptance and the measured drafter/target cost, with the best k; and for each draft-stop
confidence threshold from the records' counterfactual draft counts, with the threshold to serve.

Inputs come from the database (the last live records of the active drafter, a canary arm's
records, the latest shadow replay's cost measurements); the arithmetic is
:mod:`controlplane.tuning.draft_length` and :mod:`controlplane.tuning.draft_stop`. The draft-stop
counts are summed here from the records themselves, apart from the canary judge's tally.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from controlplane.db.models import AcceptanceRecordRow, Canary, Deployment
from controlplane.deployments.spec import speculation_of
from controlplane.drafters.service import active_drafter
from controlplane.ingest.record import ARM_LIVE
from controlplane.speculation_math import ASSUMED_DRAFTER_COST_RATIO
from controlplane.tuning import draft_length, draft_stop

RECENT_RECORDS = 2000


def measured_costs(session: Session, deployment_id: int) -> dict[str, Any]:
    """The newest shadow replay's cost ratio c and verify cost of k+1 tokens, if any."""
    for canary in session.scalars(
        select(Canary).where(Canary.deployment_id == deployment_id).order_by(Canary.id.desc()).limit(20)
    ):
        shadow = (canary.arms or {}).get("shadow") or {}
        costs = shadow.get("costs") or {}
        if isinstance(costs.get("cost_ratio"), int | float):
            return {"source": f"canary {canary.id} shadow replay", **costs}
    # Without a measurement yet, the assumed ratio; the answer says which one it used.
    return {"source": "default (no shadow replay measured yet)", "cost_ratio": ASSUMED_DRAFTER_COST_RATIO}


def live_acceptance(
    session: Session, deployment_id: int, drafter_version: int | None
) -> tuple[list[int], int]:
    """Accepted-per-position sums and verify steps over the deployment's latest live records."""
    rows = session.execute(
        select(AcceptanceRecordRow.accepted_per_position, AcceptanceRecordRow.verify_steps)
        .where(
            AcceptanceRecordRow.deployment_id == deployment_id,
            AcceptanceRecordRow.arm == ARM_LIVE,
            AcceptanceRecordRow.drafter_version.is_(None)
            if drafter_version is None
            else AcceptanceRecordRow.drafter_version == drafter_version,
        )
        .order_by(AcceptanceRecordRow.id.desc())
        .limit(RECENT_RECORDS)
    ).all()
    per_position: list[int] = []
    steps = 0
    for accepted, verify_steps in rows:
        counts = list(accepted or [])
        if len(counts) > len(per_position):
            per_position += [0] * (len(counts) - len(per_position))
        for i, c in enumerate(counts):
            per_position[i] += int(c)
        steps += int(verify_steps or 0)
    return per_position, steps


def verify_cost_of(costs: dict[str, Any]) -> dict[int, float] | None:
    """The measured verify cost of k+1 tokens by k, from a shadow replay's costs (JSON keys)."""
    verify_cost = costs.get("verify_cost")
    if not isinstance(verify_cost, dict):
        return None
    return {int(k): float(v) for k, v in verify_cost.items()}


def arm_draft_stop_counts(
    session: Session,
    deployment_id: int,
    arm: str,
    *,
    drafter_version: int | None = None,
    after_record_id: int = 0,
    serving_key_only: bool = False,
    reference_threshold: float | None = None,
    limit: int = RECENT_RECORDS,
) -> draft_stop.SummedDraftStopCounts | None:
    """The draft-stop counts of an arm's latest records (after ``after_record_id``, of
    ``drafter_version`` when given, written under a serving key when ``serving_key_only``),
    summed; ``reference_threshold``: the threshold the arm served at (None: none)."""
    r = AcceptanceRecordRow
    query = select(r.draft_stop_counts, r.drafted_tokens, r.accepted_tokens).where(
        r.deployment_id == deployment_id, r.arm == arm, r.id > after_record_id
    )
    if drafter_version is not None:
        query = query.where(r.drafter_version == drafter_version)
    if serving_key_only:
        query = query.where(r.from_serving_key.is_(True))
    rows = session.execute(query.order_by(r.id.desc()).limit(limit)).all()
    return draft_stop.sum_counts(
        ((counts, drafted, accepted) for counts, drafted, accepted in rows),
        reference_threshold=reference_threshold,
    )


def draft_stop_plan(
    counts: draft_stop.SummedDraftStopCounts | None, costs: dict[str, Any]
) -> tuple[float | None, dict[str, Any]]:
    """The threshold to serve from summed counts and a shadow replay's costs, with the plan as a
    dict; without counts or a cost measurement, what ran stands (with a note saying why)."""
    cost_ratio = costs.get("cost_ratio")
    reference = counts.reference_threshold if counts is not None else None
    if counts is None:
        return reference, {"choice": reference, "note": "no draft-stop counts in these records"}
    if not isinstance(cost_ratio, int | float):
        return reference, {"choice": reference, "note": "no cost measurement"}
    plan = draft_stop.plan_draft_stop(counts, float(cost_ratio), verify_cost=verify_cost_of(costs))
    return plan.choice, plan.as_dict()


def draft_length_table(*, session: Session, deployment: Deployment) -> dict[str, Any]:
    active = active_drafter(session=session, deployment_id=deployment.id)
    version = active.version if active else None
    per_position, steps = live_acceptance(session, deployment.id, version)
    costs = measured_costs(session, deployment.id)
    current_k = speculation_of(deployment).effective_draft_token_count
    current_threshold = deployment.draft_confidence_threshold
    counts = arm_draft_stop_counts(
        session,
        deployment.id,
        ARM_LIVE,
        drafter_version=version,
        reference_threshold=current_threshold,
    )
    base = {
        "drafter_version": version,
        "current_k": current_k,
        "verify_steps_observed": steps,
        "costs": costs,
        # Thresholds below the one serving are not observable: its rounds stopped there.
        "draft_stop": {"current_threshold": current_threshold, **draft_stop_plan(counts, costs)[1]},
    }
    if steps == 0 or not per_position:
        return {
            **base,
            "table": [],
            "best_k": None,
            "note": "none yet: no live records of the active drafter",
        }
    plan = draft_length.plan_draft_length(
        per_position, steps, float(costs["cost_ratio"]), verify_cost=verify_cost_of(costs)
    )
    return {**base, **plan.as_dict()}
