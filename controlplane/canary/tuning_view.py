"""The draft-length table a deployment shows: expected speed-up for each k from its live
per-position acceptance and the measured drafter/target cost, with the best k.

Inputs come from the database (the last live records of the active drafter, the latest shadow
replay's cost measurements); the arithmetic is :mod:`controlplane.tuning.draft_length`.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from controlplane.db.models import AcceptanceRecordRow, Canary, Deployment
from controlplane.deployments.spec import speculation_of
from controlplane.drafters.service import active_drafter
from controlplane.ingest.record import ARM_LIVE
from controlplane.tuning import draft_length

RECENT_RECORDS = 2000
# Without a measurement yet: the drafter/target step cost on the reference setup (FEASIBILITY.md
# measured 0.07 for a 0.9M drafter against a 12M target). The answer says which one it used.
DEFAULT_COST_RATIO = 0.07


def measured_costs(session: Session, deployment_id: int) -> dict[str, Any]:
    """The newest shadow replay's cost ratio c and verify cost of k+1 tokens, if any."""
    for canary in session.scalars(
        select(Canary).where(Canary.deployment_id == deployment_id).order_by(Canary.id.desc()).limit(20)
    ):
        shadow = (canary.arms or {}).get("shadow") or {}
        costs = shadow.get("costs") or {}
        if isinstance(costs.get("cost_ratio"), int | float):
            return {"source": f"canary {canary.id} shadow replay", **costs}
    return {"source": "default (no shadow replay measured yet)", "cost_ratio": DEFAULT_COST_RATIO}


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


def draft_length_table(*, session: Session, deployment: Deployment) -> dict[str, Any]:
    active = active_drafter(session=session, deployment_id=deployment.id)
    version = active.version if active else None
    per_position, steps = live_acceptance(session, deployment.id, version)
    costs = measured_costs(session, deployment.id)
    current_k = speculation_of(deployment).effective_draft_token_count
    base = {
        "drafter_version": version,
        "current_k": current_k,
        "verify_steps_observed": steps,
        "costs": costs,
    }
    if steps == 0 or not per_position:
        return {
            **base,
            "table": [],
            "best_k": None,
            "note": "none yet: no live records of the active drafter",
        }
    verify_cost = costs.get("verify_cost")
    plan = draft_length.plan_draft_length(
        per_position,
        steps,
        float(costs["cost_ratio"]),
        verify_cost={int(k): float(v) for k, v in verify_cost.items()}
        if isinstance(verify_cost, dict)
        else None,
    )
    return {**base, **plan.as_dict()}
