"""What happens to a realigned drafter once its job succeeded: the hook the canary plugs into.

``on_realign_succeeded`` is called exactly once per realign job, by the worker, inside the
transaction that registers the new ``drafter_versions`` row and marks the job succeeded; so
whatever it writes commits with them, or not at all (a redelivered task finds the version
already registered and does not call it again).

It records the candidate in the audit log and, on a deployment with ``auto_realign``, opens its
canary (``controlplane.canary.service.start_canary``) and returns the shadow-replay message, which
the caller sends only after the commit (outbox style: a message never names a row that is not
yet visible). Without ``auto_realign`` the version stays a ``candidate`` for a person to judge.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.orm import Session

from controlplane.audit.service import record_change
from controlplane.db.models import Account, Deployment, DrafterVersion, Job
from controlplane.deployments.service import resource_name


@dataclass(frozen=True, slots=True)
class TaskMessage:
    """A Celery task to send, by name, once the transaction that asked for it has committed."""

    task: str
    args: tuple[Any, ...] = ()
    queue: str = "default"
    kwargs: dict[str, Any] = field(default_factory=dict)


def drafter_version_resource(session: Session, version: DrafterVersion) -> str:
    deployment = session.get_one(Deployment, version.deployment_id)
    account = session.get_one(Account, deployment.account_id)
    return f"{resource_name(account.name, deployment.name)}/drafter-versions/{version.version}"


def on_realign_succeeded(session: Session, job: Job, version: DrafterVersion) -> list[TaskMessage]:
    """Hand a realign job's new candidate on; returns the messages to send after the commit."""
    deployment = session.get_one(Deployment, job.deployment_id)
    record_change(
        session=session,
        account_id=deployment.account_id,
        actor=f"job:{job.id}",
        action="drafter_version.candidate",
        resource=drafter_version_resource(session, version),
        before=None,
        after={
            "state": version.state.value,
            "job_id": job.id,
            "drift_event_id": job.drift_event_id,
            "parent_version_id": version.parent_version_id,
            "target_model": version.target_model,
            "artifact_sha256": version.artifact_sha256,
        },
    )
    if deployment.auto_realign:
        # No human in the loop: the candidate goes straight to its canary (shadow replay first).
        from controlplane.canary.queue import GPU_QUEUE, SHADOW_REPLAY_TASK
        from controlplane.canary.service import start_canary

        _canary, canary_job = start_canary(
            session=session, version=version, actor=f"job:{job.id}", reason=f"realign job {job.id} succeeded"
        )
        return [TaskMessage(SHADOW_REPLAY_TASK, (canary_job.id,), queue=GPU_QUEUE)]
    return []
