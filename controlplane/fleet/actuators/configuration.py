"""A deployment's actuator as configured: validating and setting it (audited), the view the API
shows, and what the canary reads from it (its ready timeout, whether it waits for its pool).
Everything kind-specific is asked of the kind the registry holds.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session

from controlplane.accounts.service import Principal
from controlplane.audit.service import record_change
from controlplane.config import Settings
from controlplane.db.models import Deployment
from controlplane.deployments.lookup import resource_name
from controlplane.fleet.actuators.base import DEFAULT_READY_TIMEOUT_S, problem
from controlplane.fleet.actuators.registry import ACTUATOR_KINDS, DEFAULT_ACTUATOR, actuator_kind


def validate_actuator(fields: dict[str, Any], settings: Settings) -> dict[str, Any]:
    """The config to store for ``fields`` (without a secret); a 422 naming the field otherwise."""
    kind = actuator_kind(fields.get("kind"))
    unknown = sorted(set(fields) - kind.fields)
    if unknown:
        raise problem(unknown[0], f"not a field of a {kind.name} actuator")
    return kind.validate(fields, settings)


def actuator_view(deployment: Deployment) -> dict[str, Any]:
    """The actuator as the API shows it: never the secret (nor what derives it)."""
    config = deployment.actuator_config or {}
    return {
        "kind": deployment.actuator or DEFAULT_ACTUATOR,
        "url": config.get("url"),
        "command": config.get("command"),
        "ready_timeout_s": config.get("ready_timeout_s"),
        "signing_secret": None,
    }


def set_actuator(
    *,
    session: Session,
    principal: Principal,
    deployment: Deployment,
    fields: dict[str, Any],
    settings: Settings,
) -> dict[str, Any]:
    """Replace the deployment's actuator (audited). The reply carries a webhook's new signing
    secret: the only time it is shown."""
    config = validate_actuator(fields, settings)
    kind = ACTUATOR_KINDS[config["kind"]]
    before = actuator_view(deployment)
    config = kind.to_store(config)
    deployment.actuator = config["kind"]
    deployment.actuator_config = config
    record_actuator_change(
        session=session,
        principal=principal,
        deployment=deployment,
        action="actuator.update",
        under="actuator",
        before=before,
        after=actuator_view(deployment),
    )
    return {**actuator_view(deployment), "signing_secret": kind.signing_secret(deployment, settings)}


def record_actuator_change(
    *,
    session: Session,
    principal: Principal,
    deployment: Deployment,
    action: str,
    under: str,
    before: dict[str, Any],
    after: dict[str, Any],
) -> None:
    """Audit a change to the deployment's actuator or its deliveries, ``under`` the deployment's
    resource name, by ``principal``."""
    record_change(
        session=session,
        account_id=principal.account_id,
        actor=principal.actor,
        action=action,
        resource=f"{resource_name(principal.account_name, deployment.name)}/{under}",
        before=before,
        after=after,
    )


def ready_timeout_s(deployment: Deployment) -> int:
    return int((deployment.actuator_config or {}).get("ready_timeout_s") or DEFAULT_READY_TIMEOUT_S)


def waits_for_pool(deployment: Deployment) -> bool:
    """Whether a canary of this deployment waits for its candidate pool before taking traffic:
    with the reference actuator the servers follow the serving config and nothing waits."""
    kind = ACTUATOR_KINDS.get(deployment.actuator or DEFAULT_ACTUATOR)
    # A stored kind this build does not know still gets its events written: claiming one then
    # fails it with a reason the admin sees, where skipping it would drop it unseen.
    return kind is None or kind.delivers
