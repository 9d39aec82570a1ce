"""The serving config: what the fleet should run now for a deployment (target, drafter, k, and the
canary's traffic split while one is live), and where loosely named reference models live.

Servers poll it; ``config_version`` changes whenever anything in the answer changes.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from controlplane.canary.phases import CanaryPhase
from controlplane.db.models import Canary, Deployment, DrafterVersion, SpeculationMode
from controlplane.deployments.spec import DEFAULT_DRAFT_TOKEN_COUNT, speculation_of
from controlplane.drafters.service import active_drafter
from controlplane.ingest.record import ARM_BASELINE, ARM_CANARY_PREFIX, ARM_LIVE


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


def serving_config(*, session: Session, deployment: Deployment, models: ReferenceModels) -> dict[str, Any]:
    """What the serving fleet should run now: one ``live`` arm, plus the canary's arms while live."""
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
        "k": k or DEFAULT_DRAFT_TOKEN_COUNT,
        "ngram_length": deployment.ngram_speculation_length or 3,
    }
    arms = [live]
    canary = session.scalar(
        select(Canary)
        .where(Canary.deployment_id == deployment.id, Canary.phase == CanaryPhase.live)
        .order_by(Canary.id.desc())
    )
    if canary is not None and canary.routing_weights:
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
