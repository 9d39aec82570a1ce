"""Thin Celery tasks of the canary: the shadow replay on the gpu queue, and the beat task that judges
live canaries, watches promotions and applies the guardrails (control-plane code, no torch).

The replay itself is ``workers.canary.replay.shadow_replay``; the decisions are
``controlplane.canary.evaluate``. A redelivered replay after a crash simply runs again: recording a
result is conditional on the canary still being in its shadow phase.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import OperationalError

from controlplane.canary.evaluate import evaluate_deployment, record_shadow_result
from controlplane.canary.service import OPEN_PHASES, ReferenceModels, canary_policy
from controlplane.config import get_settings
from controlplane.db.models import Canary, Deployment, DrafterVersion, Job, JobState, Trace
from controlplane.db.session import unit_of_work
from controlplane.deployments.service import active_drafter, speculation_of
from controlplane.errors import ConflictError
from controlplane.jobs.service import fail_job, finish_job, report_progress, start_job
from controlplane.jobs.states import TERMINAL
from workers.celery_app import InstrumentedTask, TransientError, celery_app, torch_threads_for_this_process

log = logging.getLogger(__name__)

PROMPT_TOKENS = 256  # the prompt tail the replay keeps: what a drafter's context window sees


@celery_app.task(name="canary.evaluate_all", base=InstrumentedTask, ignore_result=True)
def evaluate_all() -> dict[str, Any]:
    """Beat entry point: judge every live canary, watch promotions, apply guardrails."""
    settings = get_settings()
    outcomes: dict[str, Any] = {}
    try:
        with unit_of_work(settings.database_url) as session:
            ids = list(session.scalars(select(Deployment.id).where(Deployment.deleted_at.is_(None))))
    except OperationalError as exc:
        raise TransientError(str(exc)) from exc
    for deployment_id in ids:
        try:
            with unit_of_work(settings.database_url) as session:
                outcome = evaluate_deployment(session=session, deployment_id=deployment_id, settings=settings)
            if outcome:
                outcomes[str(deployment_id)] = outcome
        except ConflictError as exc:  # another evaluator or a person acted first: next tick sees it
            log.info("canary evaluation of deployment %s skipped: %s", deployment_id, exc)
    return outcomes


def _held_out_requests(
    session: Any, deployment: Deployment, candidate: DrafterVersion, n: int
) -> list[tuple[str, str]]:
    """Recent requests (prompt, served completion) the candidate never trained on: traces after its
    traffic window, then the window's held-out share (the trainer's own hash split), newest first."""
    from workers.training.realign import RealignConfig, _held_out

    seed = int((candidate.training_metrics or {}).get("seed", 0))
    share = RealignConfig().holdout_share
    rows = list(
        session.scalars(
            select(Trace).where(Trace.deployment_id == deployment.id).order_by(Trace.id.desc()).limit(20 * n)
        )
    )
    end = candidate.traffic_window_end
    fresh = [t for t in rows if end is not None and _aware(t.created_at) > _aware(end)]
    held = [t for t in rows if t not in fresh and _held_out(f"trace-{t.id}", seed, share)]
    return [(t.prompt, t.completion) for t in (fresh + held)[:n]]


def _aware(value: Any) -> Any:
    from datetime import UTC

    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


@celery_app.task(name="canary.shadow_replay", base=InstrumentedTask, bind=True)
def shadow_replay(self: InstrumentedTask, job_id: int) -> dict[str, Any]:
    """Replay held-out prompts through no speculation, the incumbent and the candidate; record it."""
    settings = get_settings()
    url = settings.database_url
    models = ReferenceModels(settings.reference_models_dir)
    try:
        with unit_of_work(url) as session:
            job = session.get(Job, job_id)
            if job is None:
                return {"job_id": job_id, "skipped": "no such job"}
            if job.state in TERMINAL:
                return {"job_id": job_id, "skipped": f"job is {job.state.value}"}
            canary = session.scalar(select(Canary).where(Canary.job_id == job_id))
            if canary is None or canary.phase not in OPEN_PHASES:
                fail_job(session=session, job_id=job_id, error="the canary is gone or already decided")
                return {"job_id": job_id, "skipped": "canary not open"}
            if job.state == JobState.queued:
                start_job(session=session, job_id=job_id, celery_task_id=self.request.id)
            deployment = session.get_one(Deployment, canary.deployment_id)
            candidate = session.get_one(DrafterVersion, canary.candidate_version_id)
            incumbent = active_drafter(session=session, deployment_id=deployment.id)
            policy = canary_policy(deployment)
            config = speculation_of(deployment)
            plan = {
                "canary_id": canary.id,
                "target": models.resolve(deployment.target_model),
                "candidate": (candidate.artifact_path, candidate.artifact_sha256),
                "incumbent": (
                    (incumbent.artifact_path, incumbent.artifact_sha256)
                    if incumbent is not None
                    else (models.resolve(deployment.draft_model), None)
                ),
                "k": int(canary.arms.get("k") or config.effective_draft_token_count or 4),
                "requests": _held_out_requests(session, deployment, candidate, int(policy["shadow_prompts"])),
                "new_tokens": int(policy["shadow_new_tokens"]),
            }
    except OperationalError as exc:
        raise TransientError(str(exc)) from exc

    def progress(fraction: float, message: str) -> bool:
        self.report_progress(fraction, message)
        with unit_of_work(url) as session:
            return report_progress(session=session, job_id=job_id, fraction=fraction, message=message)

    try:
        result = _replay(plan, progress)
    except _Cancelled:
        return {"job_id": job_id, "stopped": "cancelled"}
    except Exception as exc:  # bad artifacts or data do not get better on retry
        log.exception("shadow replay of job %s failed", job_id)
        with unit_of_work(url) as session:
            fail_job(session=session, job_id=job_id, error=f"{type(exc).__name__}: {exc}")
        return {"job_id": job_id, "failed": str(exc)}
    with unit_of_work(url) as session:
        phase = record_shadow_result(
            session=session, canary_id=plan["canary_id"], result=result, settings=settings
        )
        job = session.get_one(Job, job_id)
        if job.state == JobState.running:
            finish_job(
                session=session, job_id=job_id, result={"canary_id": plan["canary_id"], "phase": phase}
            )
    return {"job_id": job_id, "canary_id": plan["canary_id"], "phase": phase}


class _Cancelled(Exception):
    """The canary job was cancelled during the replay."""


def _replay(plan: dict[str, Any], progress: Any) -> dict[str, Any]:
    # torch is imported here, not at module import: beat loads this module too.
    import torch

    from workers.canary.replay import ReplayCancelledError
    from workers.canary.replay import shadow_replay as replay
    from workers.engine.hf_io import load_hf_folder

    if not plan["requests"]:
        raise ValueError("no held-out prompts: the deployment has no traces the candidate did not train on")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.set_num_threads(torch_threads_for_this_process())
    target, tokenizer = load_hf_folder(plan["target"], device=device)
    arms: dict[str, Any] = {"baseline": None}
    for name in ("incumbent", "candidate"):
        path, sha = plan[name]
        if path is None or not Path(path, "config.json").is_file():
            if name == "candidate":
                raise ValueError(f"candidate artifact {path} is missing")
            continue  # no incumbent drafter (speculation was off): two arms
        model, tok = load_hf_folder(path, device=device, expected_sha256=sha)
        if tok.fingerprint != tokenizer.fingerprint:
            raise ValueError(f"the {name} drafter's tokenizer differs from the target's")
        arms[name] = model
    # Each request replays at the length it was served (capped by the policy's shadow_new_tokens):
    # one a client ended with a stop string is not replayed into text nobody asked for.
    cap = int(plan["new_tokens"])
    requests = [
        (ids[-PROMPT_TOKENS:], min(cap, max(1, len(tokenizer.encode(completion)))))
        for prompt, completion in plan["requests"]
        if (ids := tokenizer.encode(prompt))
    ]
    random.Random(0).shuffle(requests)
    prompts = [ids for ids, _ in requests]
    progress(0.05, f"replaying {len(prompts)} held-out prompts through {len(arms)} arms")
    try:
        result = replay(
            target,
            tokenizer,
            arms,
            prompts,
            k=plan["k"],
            max_new_tokens=[n for _, n in requests],
            progress=lambda fraction, message: progress(0.05 + 0.9 * fraction, message),
        )
    except ReplayCancelledError as exc:
        raise _Cancelled(str(exc)) from exc
    progress(0.95, "replay done")
    out = result.to_dict()
    out.pop("order", None)  # bulky and of no use once judged
    return out
