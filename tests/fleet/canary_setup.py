"""Put a deployment into a live canary without a GPU: a candidate drafter version recorded in the
database and a shadow replay that passes, so serving-config splits traffic three ways. For router
tests and benchmarks that need the control plane's real split, not a trained drafter."""

from __future__ import annotations

import random
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from controlplane.canary.evaluate import record_shadow_result
from controlplane.canary.service import start_canary
from controlplane.config import Settings
from controlplane.db.models import Deployment, DrafterState, DrafterVersion
from controlplane.db.session import get_sessionmaker


def passing_shadow(n: int = 30) -> dict[str, Any]:
    """Per-prompt figures for the three arms in which the candidate neither breaks nor harms."""
    rng = random.Random(1)

    def arm(tps: float, ms: float) -> dict[str, list[float]]:
        return {
            "tokens_per_step": [tps * rng.uniform(0.9, 1.1) for _ in range(n)],
            "ms_per_token": [ms * rng.uniform(0.9, 1.1) for _ in range(n)],
        }

    return {
        "arms": {"baseline": {}, "incumbent": {}, "candidate": {}},
        "per_prompt": {"baseline": arm(1.0, 5.0), "incumbent": arm(2.0, 3.2), "candidate": arm(2.6, 2.5)},
        "costs": {"cost_ratio": 0.07},
    }


def candidate_version(session: Session, deployment_id: int, number: int, **fields: Any) -> DrafterVersion:
    """An untrained candidate drafter version ``number`` (its artifact a placeholder), added and
    flushed; ``fields`` add to or replace its columns."""
    columns: dict[str, Any] = {
        "artifact_path": f"/artifacts/v{number}",
        "artifact_sha256": f"{number:064d}",
        "state": DrafterState.candidate,
        "training_metrics": {"seed": 0},
        "eval_metrics": {},
    }
    version = DrafterVersion(deployment_id=deployment_id, version=number, **(columns | fields))
    session.add(version)
    session.flush()
    return version


def open_live_canary(database_url: str, deployment_name: str, version_number: int = 1) -> int:
    """A candidate ``version_number`` of ``deployment_name`` in a live canary; returns its id."""
    sessions = get_sessionmaker(database_url)
    with sessions() as session:
        deployment = session.scalars(
            select(Deployment).where(Deployment.name == deployment_name, Deployment.deleted_at.is_(None))
        ).one()
        version = candidate_version(
            session,
            deployment.id,
            version_number,
            artifact_path=f"file:///artifacts/{deployment_name}/v{version_number}",
            training_metrics={},
        )
        canary, _job = start_canary(session=session, version=version)
        session.commit()
        canary_id = canary.id
    with sessions() as session:
        phase = record_shadow_result(
            session=session,
            canary_id=canary_id,
            result=passing_shadow(),
            settings=Settings(database_url=database_url),
        )
        session.commit()
    if phase != "live":
        raise AssertionError(f"the canary went {phase}, not live")
    return canary_id


def arm_records(
    arm: str, n: int, *, tps: float, ms: float, hit: float, version: int | None, start: int
) -> list[dict[str, Any]]:
    """Native acceptance records of one arm: tokens per step, latency per token and hit rate."""
    rng = random.Random(start)
    out = []
    for i in range(n):
        steps = 20
        generated = int(round(steps * tps * rng.uniform(0.92, 1.08)))
        drafted = 0 if arm == "baseline" else steps * 4
        accepted = 0 if arm == "baseline" else min(drafted, int(round(drafted * hit * rng.uniform(0.8, 1.2))))
        out.append(
            {
                "request_id": f"{arm}-{start + i}",
                "arm": arm,
                "drafter_version": version,
                "k": 0 if arm == "baseline" else 4,
                "drafted_tokens": drafted,
                "accepted_tokens": accepted,
                "verify_steps": generated if arm == "baseline" else steps,
                "generated_tokens": generated,
                "accepted_per_position": []
                if arm == "baseline"
                else [accepted // 4 + (1 if p < accepted % 4 else 0) for p in range(4)],
                "inter_token_ms": ms * rng.uniform(0.9, 1.1),
            }
        )
    return out
