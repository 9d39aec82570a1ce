"""A deployment with six hours of history through the whole loop, for the dashboard's tests and
bench: healthy traffic, a workload shift, the drift event, the realignment job, the three-arm
canary, the promotion, then healthy traffic on the new drafter, and a realignment running now.

Acceptance records go through the real write path (``store_records``, which maintains every
rollup tier); the loop's own rows (drift event, jobs, drafter versions, canary, audit) are
inserted as the services would leave them, so the dashboard can be tested without a GPU worker.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy.orm import Session

from controlplane.accounts.service import Principal, create_account, issue_key
from controlplane.audit.service import record_change
from controlplane.config import Settings
from controlplane.db.models import (
    Account,
    Canary,
    DrafterState,
    DrafterVersion,
    DriftEvent,
    DriftMonitorState,
    DriftState,
    Job,
    JobKind,
    JobState,
    Role,
)
from controlplane.deployments.lookup import resource_name
from controlplane.deployments.service import create_deployment
from controlplane.deployments.spec import SpeculationRequest
from controlplane.drift import policy as drift_policy
from controlplane.drift.observation import RequestObservation
from controlplane.drift.service import DetectorPair
from controlplane.ingest.record import AcceptanceRecord
from controlplane.ingest.service import store_records
from controlplane.models.service import ModelSource, register_model

K = 4
HISTORY_MINUTES = 360
# Minutes before "now" at which each step of the loop happened.
SHIFT_AT = 180
DRIFT_AT = 170
REALIGN_START, REALIGN_END = 168, 100
CANARY_START, CANARY_END = 98, 45
RUNNING_JOB_START = 4
# Per-token acceptance α of each drafter on each workload (the hit rate follows from α and k).
ALPHA_GENERIC_BEFORE, ALPHA_GENERIC_AFTER, ALPHA_REALIGNED = 0.82, 0.45, 0.84


@dataclass(frozen=True, slots=True)
class SeededHistory:
    account: str
    deployment: str
    idle_deployment: str
    admin_key: str
    viewer_key: str
    ingest_key: str
    running_job_id: int
    queued_job_id: int
    drift_event_id: int
    canary_id: int
    records: int


def _record(
    rng: random.Random, n: int, at: datetime, arm: str, version: int | None, alpha: float
) -> AcceptanceRecord:
    steps = rng.randint(8, 16)
    if arm == "baseline":  # no speculation: one token per target step, nothing drafted
        generated = steps
        return AcceptanceRecord(
            request_id=f"r{n}",
            drafted_tokens=0,
            accepted_tokens=0,
            verify_steps=steps,
            generated_tokens=generated,
            accepted_per_position=[],
            k=None,
            ttft_ms=rng.uniform(30, 50),
            inter_token_ms=rng.uniform(18, 22),
            total_ms=generated * 20.0,
            arm=arm,
            created_at=at,
        )
    per_position = [0] * K
    accepted = 0
    for _ in range(steps):
        run = 0
        while run < K and rng.random() < alpha:
            run += 1
        for position in range(run):
            per_position[position] += 1
        accepted += run
    generated = accepted + steps
    inter_token = 24.0 / (1 + accepted / steps) + rng.uniform(-0.5, 0.5)
    return AcceptanceRecord(
        request_id=f"r{n}",
        drafted_tokens=steps * K,
        accepted_tokens=accepted,
        verify_steps=steps,
        generated_tokens=generated,
        accepted_per_position=per_position,
        k=K,
        ttft_ms=rng.uniform(30, 50),
        inter_token_ms=inter_token,
        total_ms=inter_token * generated,
        arm=arm,
        drafter_version=version,
        created_at=at,
    )


def _ci(mean: float, low: float, high: float) -> dict[str, float | int]:
    return {"n": 50, "mean": mean, "ci_low": low, "ci_high": high}


def _traffic(now: datetime, seed: int) -> list[AcceptanceRecord]:
    """Four requests a minute; five during the canary (incumbent, candidate and no speculation)."""
    rng = random.Random(seed)
    records: list[AcceptanceRecord] = []
    for minutes_ago in range(HISTORY_MINUTES, 0, -1):
        minute = now - timedelta(minutes=minutes_ago)
        if minutes_ago > SHIFT_AT:
            plan = [("live", 1, ALPHA_GENERIC_BEFORE)] * 4
        elif minutes_ago > CANARY_START:
            plan = [("live", 1, ALPHA_GENERIC_AFTER)] * 4
        elif minutes_ago > CANARY_END:
            plan = [("live", 1, ALPHA_GENERIC_AFTER)] * 3 + [
                ("canary:2", 2, ALPHA_REALIGNED),
                ("baseline", None, 0.0),
            ]
        else:
            plan = [("live", 2, ALPHA_REALIGNED)] * 4
        for i, (arm, version, alpha) in enumerate(plan):
            at = minute + timedelta(seconds=5 + 11 * i)
            record = _record(rng, len(records), at, arm, version, alpha)
            # Mixed traffic, as a client that names its request kinds sends it.
            record.category = SEED_CATEGORIES[(minutes_ago + i) % len(SEED_CATEGORIES)]
            records.append(record)
    return records


SEED_CATEGORIES = ("prose", "structured", None)


def _detector_state(seed: int, settings: Settings) -> tuple[dict[str, object], int]:
    """A detector re-baselined on the promoted drafter and fed recent traffic: no alarm."""
    rng = random.Random(seed)
    policy = drift_policy.resolve({}, settings)
    pair = DetectorPair.new(policy, n_positions=K)
    fed = pair.main.reference_size + 400
    for n in range(fed):
        record = _record(rng, n, datetime.min, "live", 2, ALPHA_REALIGNED)
        pair.update(
            RequestObservation.from_counts(
                k=K,
                verify_steps=record.verify_steps,
                accepted_per_position=record.accepted_per_position,
                drafted_tokens=record.drafted_tokens,
                accepted_tokens=record.accepted_tokens,
            )
        )
    return pair.to_state(), fed


def seed_loop_history(
    session: Session, *, account_name: str, secret: str, now: datetime, seed: int = 7
) -> SeededHistory:
    """Create the account, its keys, and the drift → realign → canary → promotion history."""
    now = now.replace(second=0, microsecond=0)

    def ago(minutes: int) -> datetime:
        return now - timedelta(minutes=minutes)

    account, admin = create_account(session=session, name=account_name, secret=secret)
    owner = session.get_one(Account, account.id)
    viewer = issue_key(session=session, account=owner, name="viewer", role=Role.viewer, secret=secret)
    ingest = issue_key(session=session, account=owner, name="ingest", role=Role.ingest, secret=secret)
    principal = Principal(admin.key.id, "admin", Role.admin, account.id, account_name)
    # The account's own names for the bundled folders (deployments name registered models only).
    for model_name, folder, drafts_for in (
        ("llama-3-8b-instruct", "reference/target", []),
        ("drafter-160m", "reference/generic-drafter", ["llama-3-8b-instruct"]),
    ):
        register_model(
            session=session,
            account_id=account.id,
            name=model_name,
            source=ModelSource(path=folder),
            settings=Settings(),
            drafter_for=drafts_for,
        )
    deployment = create_deployment(
        session=session,
        principal=principal,
        target_model="llama-3-8b-instruct",
        speculation=SpeculationRequest(draft_model="drafter-160m", draft_token_count=K),
        name="chat",
        display_name="Support chat",
    )
    idle = create_deployment(
        session=session,
        principal=principal,
        target_model="llama-3-8b-instruct",
        speculation=SpeculationRequest(ngram_speculation_length=3, draft_token_count=K),
        name="docs",
    )
    session.flush()
    resource = resource_name(account_name, deployment.name)

    generic = DrafterVersion(
        deployment_id=deployment.id,
        version=1,
        artifact_path="var/artifacts/chat/v1",
        artifact_sha256="1" * 64,
        state=DrafterState.retired,
        created_at=ago(HISTORY_MINUTES + 60),
        activated_at=ago(HISTORY_MINUTES + 60),
    )
    session.add(generic)
    event = DriftEvent(
        deployment_id=deployment.id,
        detected_at=ago(DRIFT_AT),
        state=DriftState.resolved,
        detector="mixture_sr",
        baseline_rate=0.8,
        current_rate=0.46,
        drop=0.34,
        position_most_affected=0,
        statistic=14.2,
        threshold=10.8,
        records_examined=40,
        evidence={
            "baseline_per_position": [0.82, 0.81, 0.82, 0.8],
            "estimate_per_position": [0.46, 0.45, 0.44, 0.45],
        },
        resolved_at=ago(CANARY_END),
    )
    session.add(event)
    session.flush()
    realign = Job(
        deployment_id=deployment.id,
        kind=JobKind.realign,
        state=JobState.succeeded,
        drift_event_id=event.id,
        requested_by="system",
        attempts=1,
        progress=1.0,
        progress_message="registered drafter v2",
        created_at=ago(DRIFT_AT),
        started_at=ago(REALIGN_START),
        finished_at=ago(REALIGN_END),
    )
    session.add(realign)
    session.flush()
    realigned = DrafterVersion(
        deployment_id=deployment.id,
        version=2,
        parent_version_id=generic.id,
        training_job_id=realign.id,
        artifact_path="var/artifacts/chat/v2",
        artifact_sha256="2" * 64,
        state=DrafterState.active,
        created_at=ago(REALIGN_END),
        activated_at=ago(CANARY_END),
    )
    session.add(realigned)
    canary_job = Job(
        deployment_id=deployment.id,
        kind=JobKind.canary,
        state=JobState.succeeded,
        requested_by="system",
        attempts=1,
        progress=1.0,
        progress_message="decided: promote",
        created_at=ago(CANARY_START + 1),
        started_at=ago(CANARY_START),
        finished_at=ago(CANARY_END),
    )
    session.add(canary_job)
    session.flush()
    canary = Canary(
        deployment_id=deployment.id,
        candidate_version_id=realigned.id,
        incumbent_version_id=generic.id,
        job_id=canary_job.id,
        phase="decided",
        routing_weights={"live": 0.6, "canary:2": 0.2, "baseline": 0.2},
        arms={
            "candidate_version": 2,
            "incumbent_version": 1,
            "k": K,
            # The shape controlplane.canary.policy stores: per arm, per metric, mean and interval.
            "decision_figures": {
                "arms": {
                    "candidate": {"n": 53, "metrics": {"tokens_per_step": _ci(3.8, 3.6, 4.0)}},
                    "incumbent": {"n": 159, "metrics": {"tokens_per_step": _ci(2.2, 2.1, 2.3)}},
                    "baseline": {"n": 53, "metrics": {"tokens_per_step": _ci(1.0, 1.0, 1.0)}},
                },
                "total_requests": 265,
            },
        },
        decision="promote",
        reason="candidate beats the incumbent on tokens per step and no speculation on latency per token",
        started_at=ago(CANARY_START),
        decided_at=ago(CANARY_END),
    )
    session.add(canary)
    session.flush()
    for action, minutes, after in (
        ("canary.start", CANARY_START, {"candidate_version": 2, "incumbent_version": 1}),
        ("drafter.promote", CANARY_END, {"active_version": 2, "canary_id": canary.id}),
    ):
        entry = record_change(
            session=session,
            account_id=account.id,
            actor="system",
            action=action,
            resource=f"{resource}/drafters/2",
            before={"active_version": 1} if action == "drafter.promote" else None,
            after=after,
        )
        entry.created_at = ago(minutes)
    running = Job(
        deployment_id=deployment.id,
        kind=JobKind.realign,
        state=JobState.running,
        requested_by=principal.actor,
        attempts=1,
        progress=0.2,
        progress_message="distilling: step 80 of 400",
        created_at=ago(RUNNING_JOB_START + 1),
        started_at=ago(RUNNING_JOB_START),
    )
    queued = Job(
        deployment_id=idle.id,
        kind=JobKind.realign,
        state=JobState.queued,
        requested_by=principal.actor,
        progress=0.0,
        progress_message="queued",
        created_at=ago(1),
    )
    session.add_all([running, queued])
    records = _traffic(now, seed)
    for offset in range(0, len(records), 1000):
        store_records(session=session, deployment_id=deployment.id, records=records[offset : offset + 1000])
    state, fed = _detector_state(seed, Settings(environment="test", secret_key=secret))
    session.add(DriftMonitorState(deployment_id=deployment.id, detector_state=state, records_examined=fed))
    session.flush()
    return SeededHistory(
        account=account_name,
        deployment=deployment.name,
        idle_deployment=idle.name,
        admin_key=admin.secret,
        viewer_key=viewer.secret,
        ingest_key=ingest.secret,
        running_job_id=running.id,
        queued_job_id=queued.id,
        drift_event_id=event.id,
        canary_id=canary.id,
        records=len(records),
    )
