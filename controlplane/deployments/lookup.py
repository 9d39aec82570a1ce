"""Finding a deployment: its resource name, its row by name within an account, and its row locked
for a state change. Every lifecycle service builds on these; they import nothing but the models."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from controlplane.db.models import Account, Deployment
from controlplane.errors import NotFoundError


def resource_name(account_name: str, deployment_name: str) -> str:
    return f"accounts/{account_name}/deployments/{deployment_name}"


def resource_of(session: Session, deployment: Deployment) -> str:
    """The deployment's resource name, for audit entries written by the automation."""
    account = session.get_one(Account, deployment.account_id)
    return resource_name(account.name, deployment.name)


def get_deployment(*, session: Session, account_id: int, name: str) -> Deployment:
    """A live deployment of the account; another account's deployment is simply not found."""
    deployment = session.scalar(
        select(Deployment).where(
            Deployment.account_id == account_id, Deployment.name == name, Deployment.deleted_at.is_(None)
        )
    )
    if deployment is None:
        raise NotFoundError(f"deployment {name!r} not found")
    return deployment


def resolve_deployment_id(*, session: Session, account_id: int, name: str) -> int:
    """The id of a live deployment of the account (a lean lookup for the ingest hot path)."""
    deployment_id = session.scalar(
        select(Deployment.id).where(
            Deployment.account_id == account_id, Deployment.name == name, Deployment.deleted_at.is_(None)
        )
    )
    if deployment_id is None:
        raise NotFoundError(f"deployment {name!r} not found")
    return deployment_id


def lock_deployment(*, session: Session, deployment_id: int) -> Deployment:
    """The live deployment row, locked (``SELECT ... FOR UPDATE`` on PostgreSQL; SQLite serialises
    writers): every change to its drafter versions, canaries or drift events takes this first."""
    deployment = session.scalar(select(Deployment).where(Deployment.id == deployment_id).with_for_update())
    if deployment is None or deployment.deleted_at is not None:
        raise NotFoundError(f"deployment {deployment_id} not found")
    return deployment
