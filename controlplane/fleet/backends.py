"""A deployment's serving backends: the engine endpoints of each pool (``incumbent``, ``candidate``,
``baseline``) that the router sends each arm's traffic to, with the drafter version each serves
and the URL that says it is ready. Admin changes are audited; the serving config lists them.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlparse

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from controlplane.accounts.service import Principal
from controlplane.audit.service import record_change
from controlplane.db.models import Deployment, ServingBackend
from controlplane.deployments.lookup import resource_name
from controlplane.errors import ConflictError, NotFoundError, ValidationProblem

POOL_INCUMBENT, POOL_CANDIDATE, POOL_BASELINE = "incumbent", "candidate", "baseline"
POOLS = (POOL_INCUMBENT, POOL_CANDIDATE, POOL_BASELINE)
NAME_PATTERN = re.compile(r"^[a-z0-9-]{1,100}$")
MAX_URL_LENGTH = 500


def check_http_url(value: Any, field: str, *, https_only: bool = False) -> str:
    """``value`` as an absolute http(s) URL with a host, else a 422 naming ``field``."""
    schemes = ("https",) if https_only else ("http", "https")
    if not isinstance(value, str) or len(value) > MAX_URL_LENGTH:
        raise ValidationProblem(
            f"{field} must be a URL of at most {MAX_URL_LENGTH} characters",
            details=[{"field": field, "message": "not a URL"}],
        )
    parsed = urlparse(value)
    if parsed.scheme not in schemes or not parsed.hostname:
        wanted = " or ".join(f"{s}://" for s in schemes)
        raise ValidationProblem(
            f"{field} must be an absolute {wanted} URL, got {value!r}",
            details=[{"field": field, "message": f"needs {wanted} and a host"}],
        )
    return value


def backend_summary(backend: ServingBackend) -> dict[str, Any]:
    return {
        "name": backend.name,
        "pool": backend.pool,
        "url": backend.url,
        "drafter_version": backend.drafter_version,
        "readiness_url": backend.readiness_url,
    }


def list_backends(*, session: Session, deployment_id: int, pool: str | None = None) -> list[ServingBackend]:
    """The deployment's backends by name (one pool's only, with ``pool``)."""
    query = select(ServingBackend).where(ServingBackend.deployment_id == deployment_id)
    if pool is not None:
        query = query.where(ServingBackend.pool == pool)
    return list(session.scalars(query.order_by(ServingBackend.name)))


def _validated(fields: dict[str, Any]) -> dict[str, Any]:
    name = fields.get("name")
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise ValidationProblem(
            "name must be 1-100 characters of a-z, 0-9 and '-'",
            details=[{"field": "name", "message": "does not match [a-z0-9-]{1,100}"}],
        )
    pool = fields.get("pool")
    if pool not in POOLS:
        raise ValidationProblem(
            f"pool must be one of {', '.join(POOLS)}", details=[{"field": "pool", "message": "unknown pool"}]
        )
    version = fields.get("drafter_version")
    if version is not None and (isinstance(version, bool) or not isinstance(version, int) or version < 1):
        raise ValidationProblem(
            "drafter_version must be a positive integer or null",
            details=[{"field": "drafter_version", "message": "not a version number"}],
        )
    readiness = fields.get("readiness_url")
    return {
        "name": name,
        "pool": pool,
        "url": check_http_url(fields.get("url"), "url"),
        "drafter_version": version,
        "readiness_url": check_http_url(readiness, "readiness_url") if readiness is not None else None,
    }


def add_backend(
    *, session: Session, principal: Principal, deployment: Deployment, fields: dict[str, Any]
) -> ServingBackend:
    """Declare a backend (audited); a name the deployment already uses is a 409."""
    valid = _validated(fields)
    existing = session.scalar(
        select(ServingBackend.id).where(
            ServingBackend.deployment_id == deployment.id, ServingBackend.name == valid["name"]
        )
    )
    if existing is not None:
        raise ConflictError(f"backend {valid['name']!r} already exists")
    backend = ServingBackend(deployment_id=deployment.id, **valid)
    try:
        with session.begin_nested():  # a concurrent twin loses on the unique constraint
            session.add(backend)
    except IntegrityError as exc:
        raise ConflictError(f"backend {valid['name']!r} already exists") from exc
    record_change(
        session=session,
        account_id=principal.account_id,
        actor=principal.actor,
        action="backend.create",
        resource=f"{resource_name(principal.account_name, deployment.name)}/backends/{backend.name}",
        before=None,
        after=backend_summary(backend),
    )
    return backend


def delete_backend(*, session: Session, principal: Principal, deployment: Deployment, name: str) -> None:
    backend = session.scalar(
        select(ServingBackend).where(
            ServingBackend.deployment_id == deployment.id, ServingBackend.name == name
        )
    )
    if backend is None:
        raise NotFoundError(f"backend {name!r} not found")
    before = backend_summary(backend)
    session.delete(backend)
    record_change(
        session=session,
        account_id=principal.account_id,
        actor=principal.actor,
        action="backend.delete",
        resource=f"{resource_name(principal.account_name, deployment.name)}/backends/{name}",
        before=before,
        after=None,
    )
