"""The events handed to actuators, as rows of ``actuator_deliveries``: writing one in the
decision's own transaction (outbox style: a decision never commits without its event, nor an
event without its decision), the ``ACTUATOR_DELIVER`` messages to send once it has committed,
the reads the API lists, the admin's retry, and which pending deliveries are due again.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from controlplane.accounts.service import Principal
from controlplane.config import Settings, get_settings
from controlplane.db.models import Account, ActuatorDelivery, Canary, Deployment, DrafterVersion
from controlplane.deployments.lookup import resource_name
from controlplane.deployments.spec import DEFAULT_DRAFT_TOKEN_COUNT, speculation_of
from controlplane.errors import NotFoundError
from controlplane.fleet import payloads
from controlplane.fleet.actuators.configuration import record_actuator_change, waits_for_pool
from controlplane.messaging import ACTUATOR_DELIVER, TaskMessage
from controlplane.models.location import drafter_kind_of, location_of_version
from controlplane.timestamps import as_utc, utcnow

STATE_PENDING, STATE_DELIVERED, STATE_FAILED = "pending", "delivered", "failed"
_OUTBOX = "actuator_outbox"


def ready_callback_url(settings: Settings, account: str, deployment: str, canary_id: int) -> str:
    base = settings.api_url.rstrip("/")
    return f"{base}/v1/accounts/{account}/deployments/{deployment}/canaries/{canary_id}/ready"


def record_event(
    *,
    session: Session,
    deployment: Deployment,
    event: str,
    canary: Canary | None,
    version: DrafterVersion | None,
    fallback_uri: str | None = None,
    k: int | None = None,
    settings: Settings | None = None,
) -> ActuatorDelivery | None:
    """Write the event's delivery row in the caller's transaction (None with the reference
    actuator). ``version`` is the drafter the event is about; without one, ``fallback_uri`` names
    the registered drafter that serves instead (if any). After the caller commits,
    ``take_outbox(session)`` gives the messages that deliver it."""
    if not waits_for_pool(deployment):
        return None
    settings = settings or get_settings()
    account = session.get_one(Account, deployment.account_id)
    if k is None:
        k = speculation_of(deployment).effective_draft_token_count or DEFAULT_DRAFT_TOKEN_COUNT
    location = location_of_version(version) if version is not None else None
    delivery = ActuatorDelivery(
        deployment_id=deployment.id,
        canary_id=canary.id if canary is not None else None,
        event=event,
        actuator=deployment.actuator,
        payload={},
        state=STATE_PENDING,
        attempts=0,
        created_at=utcnow(),
        next_attempt_at=utcnow(),
    )
    session.add(delivery)
    session.flush()
    delivery.payload = payloads.build_payload(
        event=event,
        delivery_id=delivery.id,
        deployment=resource_name(account.name, deployment.name),
        account=account.name,
        canary_id=canary.id if canary is not None else None,
        drafter_version=version.version if version is not None else None,
        artifact_uri=location.uri if location is not None else fallback_uri,
        manifest_sha256=location.manifest_sha256 if location is not None else None,
        k=int(k),
        drafter_kind=drafter_kind_of(version) if version is not None else None,
        ready_callback_url=ready_callback_url(settings, account.name, deployment.name, canary.id)
        if event == payloads.EVENT_CANARY_START and canary is not None
        else None,
        created_at=as_utc(delivery.created_at).isoformat(),
    )
    session.info.setdefault(_OUTBOX, []).append(delivery.id)
    return delivery


def take_outbox(session: Session) -> list[TaskMessage]:
    """The ``ACTUATOR_DELIVER`` messages for the deliveries this session wrote; send them once the
    transaction has committed (a message sent earlier could find no row)."""
    ids: list[int] = session.info.pop(_OUTBOX, [])
    return [TaskMessage(ACTUATOR_DELIVER, (delivery_id,)) for delivery_id in ids]


# --- reads and the admin's retry -------------------------------------------------------------


def delivery_summary(delivery: ActuatorDelivery) -> dict[str, Any]:
    def iso(value: datetime | None) -> str | None:
        return as_utc(value).isoformat() if value is not None else None

    return {
        "id": delivery.id,
        "event": delivery.event,
        "actuator": delivery.actuator,
        "canary_id": delivery.canary_id,
        "state": delivery.state,
        "attempts": delivery.attempts,
        "last_status": delivery.last_status,
        "last_error": delivery.last_error,
        "payload": delivery.payload,
        "created_at": iso(delivery.created_at),
        "next_attempt_at": iso(delivery.next_attempt_at),
        "delivered_at": iso(delivery.delivered_at),
    }


def list_deliveries(*, session: Session, deployment_id: int, limit: int = 50) -> list[ActuatorDelivery]:
    return list(
        session.scalars(
            select(ActuatorDelivery)
            .where(ActuatorDelivery.deployment_id == deployment_id)
            .order_by(ActuatorDelivery.id.desc())
            .limit(limit)
        )
    )


def get_delivery(*, session: Session, deployment_id: int, delivery_id: int) -> ActuatorDelivery:
    delivery = session.get(ActuatorDelivery, delivery_id)
    if delivery is None or delivery.deployment_id != deployment_id:
        raise NotFoundError(f"delivery {delivery_id} not found")
    return delivery


def retry_delivery(
    *, session: Session, principal: Principal, deployment: Deployment, delivery_id: int
) -> ActuatorDelivery:
    """Send a delivery again now, with a fresh attempt budget (audited)."""
    delivery = get_delivery(session=session, deployment_id=deployment.id, delivery_id=delivery_id)
    before = {"state": delivery.state, "attempts": delivery.attempts}
    delivery.state = STATE_PENDING
    delivery.attempts = 0
    delivery.next_attempt_at = utcnow()
    session.info.setdefault(_OUTBOX, []).append(delivery.id)
    record_actuator_change(
        session=session,
        principal=principal,
        deployment=deployment,
        action="delivery.retry",
        under=f"deliveries/{delivery.id}",
        before=before,
        after={"state": delivery.state, "attempts": 0},
    )
    return delivery


def due_deliveries(*, session: Session, now: datetime | None = None, limit: int = 200) -> list[int]:
    """Pending deliveries whose next attempt is due: what the beat sends again."""
    rows = session.scalars(
        select(ActuatorDelivery.id)
        .where(ActuatorDelivery.state == STATE_PENDING, ActuatorDelivery.next_attempt_at <= (now or utcnow()))
        .order_by(ActuatorDelivery.next_attempt_at)
        .limit(limit)
    )
    return [int(i) for i in rows]
