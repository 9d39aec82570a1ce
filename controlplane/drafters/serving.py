"""The serving config: what the fleet should run now for a deployment (target, drafter, k, the
canary's traffic split while one is live, the standing no-speculation share, and the backends of
each pool).

Every deployment that speculates routes a small share of its traffic (``standing_baseline_share``
of its adaptation policy, 0 for none) to a ``baseline`` arm without speculation, canary or not, so
whether speculation pays is always measured (``controlplane.speculation_check``). During a live
canary the baseline arm serves the larger of the canary's share and the standing share.

Every model is named by location and digest (``ModelRef``): a registered model's folder with the
sha256 of each file, or a trained drafter's artifact URI with its manifest's sha256. Servers load
nothing they have not verified against these. ``config_version`` changes whenever anything in the
answer changes.
"""

from __future__ import annotations

import hashlib
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from controlplane.db.models import Canary, CanaryPhase, Deployment, DrafterVersion, SpeculationMode
from controlplane.deployments.spec import DEFAULT_DRAFT_TOKEN_COUNT, speculation_of
from controlplane.drafters.service import active_drafter
from controlplane.drafters.weights import canary_weights, standing_share, standing_weights
from controlplane.errors import ConflictError
from controlplane.fleet.backends import backend_summary, list_backends
from controlplane.ingest.record import ARM_BASELINE, ARM_CANARY_PREFIX, ARM_LIVE
from controlplane.models.location import ModelLocation, location_of_version
from controlplane.models.service import drafter_choice, find_model, location_of


def target_location(*, session: Session, deployment: Deployment) -> ModelLocation:
    """The deployment's registered target; a target unregistered since is a clear conflict,
    never a substitute."""
    target = find_model(session=session, account_id=deployment.account_id, name=deployment.target_model)
    if target is None:
        raise ConflictError(
            f"target model {deployment.target_model!r} of deployment {deployment.name!r} is no longer "
            "registered; register it again or point the deployment at a registered model"
        )
    return location_of(target)


def incumbent_location(
    *, session: Session, deployment: Deployment, active: DrafterVersion | None = None
) -> ModelLocation | None:
    """The drafter serving now: the active trained version (``active`` when the caller has read
    it), else the registered drafter the deployment names or inherits from its target; None when
    it speculates with no drafter."""
    active = active or active_drafter(session=session, deployment_id=deployment.id)
    if active is not None:
        return location_of_version(active)
    choice = drafter_choice(session=session, deployment=deployment)
    return location_of(choice.model) if choice.model is not None else None


def serving_config(*, session: Session, deployment: Deployment) -> dict[str, Any]:
    """What the serving fleet should run now: the ``live`` arm, the canary's arm while one is live,
    and the ``baseline`` arm (no speculation) whenever its share is above 0."""
    config = speculation_of(deployment)
    active = active_drafter(session=session, deployment_id=deployment.id)
    drafter = incumbent_location(session=session, deployment=deployment, active=active)
    k = config.effective_draft_token_count
    mode = config.mode.value
    if mode == SpeculationMode.default.value:
        mode = SpeculationMode.draft_model.value if drafter is not None else SpeculationMode.disabled.value
    uses_drafter = mode == SpeculationMode.draft_model.value
    live: dict[str, Any] = {
        "arm": ARM_LIVE,
        "weight": 1.0,
        "speculation": mode,
        "drafter": drafter.to_dict() if drafter is not None and uses_drafter else None,
        "drafter_version": active.version if active and uses_drafter else None,
        "k": k or DEFAULT_DRAFT_TOKEN_COUNT,
        "ngram_length": deployment.ngram_speculation_length or 3,
        # Draft rounds stop at the first draft below this probability (None: never early).
        "draft_confidence_threshold": deployment.draft_confidence_threshold if uses_drafter else None,
    }
    arms = [live]
    share = standing_share(deployment.adaptation_policy, speculating=mode != SpeculationMode.disabled.value)
    baseline: dict[str, Any] = {
        "arm": ARM_BASELINE,
        "weight": 0.0,
        "speculation": SpeculationMode.disabled.value,
        "drafter": None,
        "drafter_version": None,
        "k": 0,
        "ngram_length": live["ngram_length"],
        "draft_confidence_threshold": None,
    }
    canary = session.scalar(
        select(Canary)
        .where(Canary.deployment_id == deployment.id, Canary.phase == CanaryPhase.live)
        .order_by(Canary.id.desc())
    )
    if canary is not None and canary.routing_weights:
        candidate = session.get_one(DrafterVersion, canary.candidate_version_id)
        weights = canary_weights(
            float(canary.routing_weights["candidate"]), float(canary.routing_weights["baseline"]), share
        )
        live["weight"] = weights["live"]
        arms.append(
            {
                "arm": f"{ARM_CANARY_PREFIX}{candidate.version}",
                "weight": weights["candidate"],
                "speculation": SpeculationMode.draft_model.value,
                "drafter": location_of_version(candidate).to_dict(),
                "drafter_version": candidate.version,
                "k": int(canary.arms.get("k") or live["k"]),
                "ngram_length": live["ngram_length"],
                # Never early: its records then count every draft-stop threshold for the tuner.
                "draft_confidence_threshold": None,
            }
        )
        arms.append({**baseline, "weight": weights["baseline"]})
    elif share > 0:
        weights = standing_weights(share)
        live["weight"] = weights["live"]
        arms.append({**baseline, "weight": weights["baseline"]})
    body = {
        "model": deployment.name,
        "target": target_location(session=session, deployment=deployment).to_dict(),
        "trace_sample_rate": deployment.trace_sample_rate,
        "raw_record_sample_rate": deployment.raw_record_sample_rate,
        "arms": arms,
        # The fleet's endpoints by pool: the router sends each arm's traffic to its pool.
        "backends": [backend_summary(b) for b in list_backends(session=session, deployment_id=deployment.id)],
    }
    fingerprint = hashlib.sha256(repr((deployment.row_version, body)).encode()).hexdigest()[:16]
    return {**body, "config_version": fingerprint}
