"""Thin Celery tasks of the canary: the shadow replay on the gpu queue, and the beat task on the
default queue that re-sends (or ends) replays that never answered, judges live canaries, watches
promotions and applies the guardrails, one deployment per transaction.

The replay itself is ``workers.canary.replay.shadow_replay``; its job's reads and writes are
``controlplane.canary.shadow``; the decisions are ``controlplane.canary.evaluate``.
"""

from __future__ import annotations

import logging
import random
from typing import Any

from controlplane import messaging
from controlplane.artifacts.manifest import ArtifactVerificationError
from controlplane.canary.evaluate import evaluate_deployment
from controlplane.canary.service import deployments_with_open_canaries, record_evaluation_error
from controlplane.canary.shadow import (
    ReplayPlan,
    claim_replay,
    fail_replay,
    finish_replay,
    record_replay_heartbeat,
    sweep_overdue_replays,
)
from controlplane.config import Settings, get_settings
from controlplane.db.session import TRANSIENT_DATABASE_ERRORS, unit_of_work
from controlplane.errors import ConflictError, DomainError
from controlplane.fleet.actuators import take_outbox
from controlplane.jobs.service import report_progress
from workers.celery_app import (
    InstrumentedTask,
    TransientError,
    celery_app,
    project_task,
    torch_threads_for_this_process,
)
from workers.tasks import Progress

log = logging.getLogger(__name__)

PROMPT_TOKENS = 256  # the prompt tail the replay keeps: what a drafter's context window sees


@project_task(messaging.CANARY_EVALUATE_ALL, ignore_result=True)
def evaluate_all() -> dict[str, Any]:
    """Beat entry point: re-send or end shadow replays that never answered, then judge every live
    canary, watch promotions and apply guardrails.

    Each deployment runs in its own transaction: one whose evaluation fails is rolled back, logged
    and counted on its canary (``specctl_canary_evaluation_errors_total``), and the tick goes on
    with the next deployment.
    """
    return judge_tick(get_settings())


def judge_tick(settings: Settings) -> dict[str, Any]:
    """One tick of ``evaluate_all`` on the database ``settings`` name."""
    outcomes: dict[str, Any] = {}
    try:
        outcomes["shadow_replays"] = _sweep_replays(settings)
    except Exception:  # the judge below must still run
        log.exception("shadow replay sweep failed")
    try:
        with unit_of_work(settings.database_url) as session:
            ids = deployments_with_open_canaries(session=session)
    except TRANSIENT_DATABASE_ERRORS as exc:
        raise TransientError(str(exc)) from exc
    for deployment_id in ids:
        outcome = evaluate_one(settings, deployment_id)
        if outcome:
            outcomes[str(deployment_id)] = outcome
    return outcomes


def evaluate_one(settings: Settings, deployment_id: int) -> dict[str, Any] | None:
    """One deployment's tick in its own transaction; a failure is logged and counted, never raised."""
    try:
        with unit_of_work(settings.database_url) as session:
            outcome = evaluate_deployment(session=session, deployment_id=deployment_id, settings=settings)
            deliveries = take_outbox(session)
        # After the commit: an actuator event (canary start, promotion, rollback) goes out now
        # rather than with the next resend sweep.
        messaging.send_all(celery_app, deliveries)
        return outcome
    except ConflictError as exc:  # another evaluator or a person acted first: next tick sees it
        log.info("canary evaluation of deployment %s skipped: %s", deployment_id, exc)
        return None
    except Exception as exc:
        log.exception("canary evaluation of deployment %s failed", deployment_id)
        error = f"{type(exc).__name__}: {exc}"
        try:
            with unit_of_work(settings.database_url) as session:
                record_evaluation_error(session=session, deployment_id=deployment_id, error=error)
        except Exception:
            log.exception("could not count the failed evaluation of deployment %s", deployment_id)
        return {"error": error}


def _sweep_replays(settings: Settings) -> dict[str, list[int]]:
    with unit_of_work(settings.database_url) as session:
        sweep = sweep_overdue_replays(
            session=session,
            resend_after_s=settings.shadow_resend_after_s,
            max_sends=settings.shadow_max_sends,
        )
    for job_id in sweep.resend_jobs:
        log.warning("shadow replay job %s has not answered; sending it again", job_id)
    messaging.send_all(
        celery_app,
        [messaging.TaskMessage(messaging.SHADOW_REPLAY, (job_id,)) for job_id in sweep.resend_jobs],
    )
    return {"resent_jobs": sweep.resend_jobs, "ended_canaries": sweep.ended_canaries}


@project_task(messaging.SHADOW_REPLAY, bind=True)
def shadow_replay(self: InstrumentedTask, job_id: int) -> dict[str, Any]:
    """Replay held-out prompts through no speculation, the incumbent and the candidate; record it."""
    settings = get_settings()
    url = settings.database_url
    try:
        with unit_of_work(url) as session:
            claim = claim_replay(session=session, job_id=job_id, delivery_id=self.request.id)
    except TRANSIENT_DATABASE_ERRORS as exc:
        raise TransientError(str(exc)) from exc
    except DomainError as exc:  # e.g. the target was unregistered: nothing to replay against
        with unit_of_work(url) as session:
            return fail_replay(session=session, job_id=job_id, error=exc.message, candidate_refused=False)
    if claim.done is not None or claim.plan is None:
        return claim.done or {"job_id": job_id, "skipped": "nothing to replay"}
    plan = claim.plan

    def progress(fraction: float, message: str) -> bool:
        self.report_progress(fraction, message)
        with unit_of_work(url) as session:
            record_replay_heartbeat(session=session, job_id=job_id)
            return report_progress(session=session, job_id=job_id, fraction=fraction, message=message)

    try:
        result = _replay(plan, settings, progress)
    except _Cancelled:
        return {"job_id": job_id, "stopped": "cancelled"}
    except _CandidateRefused as exc:  # a changed or missing file: this candidate never serves
        log.error("shadow replay of job %s refused the candidate: %s", job_id, exc)
        with unit_of_work(url) as session:
            return fail_replay(session=session, job_id=job_id, error=str(exc), candidate_refused=True)
    except Exception as exc:  # bad artifacts or data do not get better on retry
        log.exception("shadow replay of job %s failed", job_id)
        with unit_of_work(url) as session:
            return fail_replay(
                session=session,
                job_id=job_id,
                error=f"{type(exc).__name__}: {exc}",
                candidate_refused=False,
            )
    try:
        with unit_of_work(url) as session:
            finished = finish_replay(
                session=session, job_id=job_id, canary_id=plan.canary_id, result=result, settings=settings
            )
            deliveries = take_outbox(session)
    except TRANSIENT_DATABASE_ERRORS as exc:
        raise TransientError(str(exc)) from exc
    except Exception as exc:  # a result that cannot be recorded would only fail again on a resend
        log.exception("recording the shadow replay of job %s failed", job_id)
        with unit_of_work(url) as session:
            return fail_replay(
                session=session,
                job_id=job_id,
                error=f"recording the replay failed: {type(exc).__name__}: {exc}",
                candidate_refused=False,
            )
    messaging.send_all(celery_app, deliveries)
    return finished


class _Cancelled(Exception):
    """The canary job was cancelled during the replay."""


class _CandidateRefused(Exception):
    """The candidate's artifact failed verification (a file changed, missing or unexpected)."""


def _replay(plan: ReplayPlan, settings: Settings, progress: Progress) -> dict[str, Any]:
    # torch is imported here, not at module import: beat loads this module too.
    import torch

    from workers.canary.replay import ReplayCancelledError
    from workers.canary.replay import shadow_replay as replay
    from workers.devices import resolve_device, weights_dtype
    from workers.engine.eagle import HeadProposer
    from workers.engine.head_io import is_head_folder, load_head_folder
    from workers.engine.hf_io import load_hf_folder
    from workers.engine.proposers import NgramProposer
    from workers.engine.tokenizer import ensure_same_tokenizer
    from workers.loading import VerifiedModels
    from workers.model_cache import TARGETS

    if not plan.requests:
        raise ValueError("no held-out prompts: the deployment has no traces the candidate did not train on")
    device = resolve_device(settings.worker_device)
    dtype = weights_dtype(device)
    torch.set_num_threads(torch_threads_for_this_process())
    models = VerifiedModels(settings)
    try:
        candidate_folder = models.folder(plan.candidate, reverify=True)
    except ArtifactVerificationError as exc:
        raise _CandidateRefused(str(exc)) from exc
    target_folder = models.folder(plan.target)
    target, tokenizer = TARGETS.get(
        target_folder,
        identity=plan.target.identity,
        device=device,
        dtype=dtype,
        loader=lambda: load_hf_folder(target_folder, device=device, dtype=dtype),
    )
    folders = {"candidate": (plan.candidate.name, candidate_folder)}
    arms: dict[str, Any] = {"baseline": None}
    # The incumbent is what the live arm serves: a drafter, n-gram or no speculation at all.
    if plan.incumbent_speculation == "ngram":
        arms["incumbent"] = NgramProposer(plan.ngram_length)
    elif plan.incumbent_speculation == "disabled":
        arms["incumbent"] = None
    elif plan.incumbent is not None:
        folders["incumbent"] = (plan.incumbent.name, models.folder(plan.incumbent))
    for arm, (name, folder) in folders.items():
        # Either kind of drafter: a small model, or a head over the target's states.
        if is_head_folder(folder):
            head, tok = load_head_folder(folder, target)
            ensure_same_tokenizer(tokenizer, tok, plan.target.name, name)
            arms[arm] = HeadProposer(head, name=name)
            continue
        model, tok = load_hf_folder(folder, device=device, dtype=dtype)
        ensure_same_tokenizer(tokenizer, tok, plan.target.name, name)
        arms[arm] = model
    # Each request replays at the length it was served (capped by the policy's shadow_new_tokens):
    # one a client ended with a stop string is not replayed into text nobody asked for.
    cap = plan.new_tokens
    requests = [
        (ids[-PROMPT_TOKENS:], min(cap, max(1, len(tokenizer.encode(completion)))))
        for prompt, completion in plan.requests
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
            k=plan.k,
            max_new_tokens=[n for _, n in requests],
            progress=lambda fraction, message: progress(0.05 + 0.9 * fraction, message),
            # The candidate's measured ceiling: one more arm, the cheapest of them (it needs the
            # fewest target passes), drafting the continuations the lossless check computes anyway:
            # +15% on a reference-pair replay of three arms (20.8 s -> 23.8 s, medians of two).
            ceiling_of="candidate",
        )
    except ReplayCancelledError as exc:
        raise _Cancelled(str(exc)) from exc
    progress(0.95, "replay done")
    out = result.to_dict()
    out.pop("order", None)  # bulky and of no use once judged
    return out
