"""How a deployment's decisions reach its serving fleet, and every event handed over.

A deployment's actuator is one of:

- ``reference``: the servers follow ``serving-config`` themselves; nothing is delivered.
- ``webhook``: each event is POSTed as signed JSON (``controlplane.fleet.payloads`` documents
  the payload, the headers and the signature) to the configured URL. The signing secret is
  derived from ``Settings.secret_key`` and a nonce stored with the actuator, so the database
  never holds it; it is shown once, in the reply that set the webhook (setting it again rotates it).
- ``command``: one of the operator-configured programs (``Settings.actuator_commands``) runs
  with the event's JSON on stdin; exit 0 means delivered.

Events (``canary-start``, ``promotion``, ``rollback``) are rows of ``actuator_deliveries`` written
in the decision's own transaction (outbox style): a decision never commits without its event,
nor an event without its decision. After the commit, ``ACTUATOR_DELIVER`` delivers it (callers
take the messages with ``take_outbox``); the beat's ``ACTUATOR_RESEND_DUE`` sends every pending
delivery whose time has come, so a lost message costs a few seconds, never the event. A failed
attempt is retried on ``payloads.backoff``'s schedule until ``payloads.MAX_ATTEMPTS``, then the
delivery is ``failed`` (an admin may retry it).
"""

from __future__ import annotations

import secrets
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import httpx
from sqlalchemy import select
from sqlalchemy.orm import Session

from controlplane.accounts.service import Principal
from controlplane.audit.service import record_change
from controlplane.config import Settings, get_settings
from controlplane.db.models import Account, ActuatorDelivery, Canary, Deployment, DrafterVersion
from controlplane.deployments.lookup import resource_name
from controlplane.deployments.spec import DEFAULT_DRAFT_TOKEN_COUNT, speculation_of
from controlplane.errors import NotFoundError, ValidationProblem
from controlplane.fleet import payloads
from controlplane.fleet.backends import check_http_url
from controlplane.messaging import ACTUATOR_DELIVER, TaskMessage
from controlplane.models.location import drafter_kind_of, location_of_version
from controlplane.timestamps import as_utc, utcnow

ACTUATOR_REFERENCE, ACTUATOR_WEBHOOK, ACTUATOR_COMMAND = "reference", "webhook", "command"
ACTUATORS = (ACTUATOR_REFERENCE, ACTUATOR_WEBHOOK, ACTUATOR_COMMAND)
STATE_PENDING, STATE_DELIVERED, STATE_FAILED = "pending", "delivered", "failed"

DEFAULT_READY_TIMEOUT_S = 600
MAX_READY_TIMEOUT_S = 24 * 3600
WEBHOOK_TIMEOUT_S = 10.0
# A claimed delivery is not sent again for this long beyond its own timeout: an attempt whose
# worker died is picked up by the beat once the lease runs out.
CLAIM_LEASE_MARGIN_S = 30.0
ERROR_TAIL_CHARS = 2000
_OUTBOX = "actuator_outbox"


# --- configuration --------------------------------------------------------------------------


def _problem(field: str, message: str) -> ValidationProblem:
    return ValidationProblem(f"{field}: {message}", details=[{"field": field, "message": message}])


def _ready_timeout(value: Any) -> int:
    if value is None:
        return DEFAULT_READY_TIMEOUT_S
    if isinstance(value, bool) or not isinstance(value, int | float) or not 1 <= value <= MAX_READY_TIMEOUT_S:
        raise _problem("ready_timeout_s", f"must be a number of seconds from 1 to {MAX_READY_TIMEOUT_S}")
    return int(value) if float(value).is_integer() else max(1, int(value))


def validate_actuator(fields: dict[str, Any], settings: Settings) -> dict[str, Any]:
    """The config to store for ``fields`` (without a secret); a 422 naming the field otherwise."""
    kind = fields.get("kind")
    if kind not in ACTUATORS:
        raise _problem("kind", f"must be one of {', '.join(ACTUATORS)}")
    allowed = {
        ACTUATOR_REFERENCE: {"kind"},
        ACTUATOR_WEBHOOK: {"kind", "url", "ready_timeout_s"},
        ACTUATOR_COMMAND: {"kind", "command", "ready_timeout_s"},
    }[kind]
    unknown = sorted(set(fields) - allowed)
    if unknown:
        raise _problem(unknown[0], f"not a field of a {kind} actuator")
    if kind == ACTUATOR_REFERENCE:
        return {"kind": kind}
    timeout = _ready_timeout(fields.get("ready_timeout_s"))
    if kind == ACTUATOR_WEBHOOK:
        return {"kind": kind, "url": check_http_url(fields.get("url"), "url"), "ready_timeout_s": timeout}
    # Only a name the operator configured: the API never takes a command line, since an API key
    # must not be able to run a program of its choosing on the control plane's hosts.
    name = fields.get("command")
    if not isinstance(name, str) or name not in settings.actuator_commands:
        configured = ", ".join(sorted(settings.actuator_commands)) or "none are configured"
        raise _problem("command", f"must name a command the operator configured ({configured})")
    return {"kind": kind, "command": name, "ready_timeout_s": timeout}


def actuator_view(deployment: Deployment) -> dict[str, Any]:
    """The actuator as the API shows it: never the secret (nor what derives it)."""
    config = deployment.actuator_config or {}
    return {
        "kind": deployment.actuator or ACTUATOR_REFERENCE,
        "url": config.get("url"),
        "command": config.get("command"),
        "ready_timeout_s": config.get("ready_timeout_s"),
        "signing_secret": None,
    }


def webhook_secret(deployment: Deployment, settings: Settings) -> str | None:
    """The deployment's current webhook signing secret (None unless its actuator is a webhook)."""
    nonce = (deployment.actuator_config or {}).get("secret_nonce")
    if deployment.actuator != ACTUATOR_WEBHOOK or not isinstance(nonce, str):
        return None
    return payloads.derive_secret(settings.secret_key, deployment.id, nonce)


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
    before = actuator_view(deployment)
    if config["kind"] == ACTUATOR_WEBHOOK:
        config["secret_nonce"] = secrets.token_hex(16)
    deployment.actuator = config["kind"]
    deployment.actuator_config = config
    record_change(
        session=session,
        account_id=principal.account_id,
        actor=principal.actor,
        action="actuator.update",
        resource=f"{resource_name(principal.account_name, deployment.name)}/actuator",
        before=before,
        after=actuator_view(deployment),
    )
    return {**actuator_view(deployment), "signing_secret": webhook_secret(deployment, settings)}


def ready_timeout_s(deployment: Deployment) -> int:
    return int((deployment.actuator_config or {}).get("ready_timeout_s") or DEFAULT_READY_TIMEOUT_S)


def waits_for_pool(deployment: Deployment) -> bool:
    """Whether a canary of this deployment waits for its candidate pool before taking traffic:
    with the reference actuator the servers follow the serving config and nothing waits."""
    return (deployment.actuator or ACTUATOR_REFERENCE) != ACTUATOR_REFERENCE


# --- events ---------------------------------------------------------------------------------


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
    record_change(
        session=session,
        account_id=principal.account_id,
        actor=principal.actor,
        action="delivery.retry",
        resource=f"{resource_name(principal.account_name, deployment.name)}/deliveries/{delivery.id}",
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


# --- delivering -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Attempt:
    """One claimed attempt: what to send and where, read in a transaction and run outside it."""

    delivery_id: int
    event: str
    body: bytes
    url: str | None = None
    secret: str | None = None
    argv: list[str] | None = None


@dataclass(frozen=True, slots=True)
class Outcome:
    delivered: bool
    status: int | None
    error: str | None


def claim_delivery(
    *, session: Session, delivery_id: int, settings: Settings, now: datetime | None = None
) -> Attempt | None:
    """Take the delivery for one attempt if it is pending and due (None otherwise): its next
    attempt moves past this one's timeout, so a concurrent relay does not send it twice."""
    now = now or utcnow()
    delivery = session.get(ActuatorDelivery, delivery_id, with_for_update=True)
    if delivery is None or delivery.state != STATE_PENDING:
        return None
    if delivery.next_attempt_at is not None and as_utc(delivery.next_attempt_at) > now:
        return None
    deployment = session.get_one(Deployment, delivery.deployment_id)
    config = deployment.actuator_config or {}
    body = payloads.encode(delivery.payload)
    attempt: Attempt | None = None
    if deployment.actuator != delivery.actuator:
        problem = f"the deployment's actuator is now {deployment.actuator}, not {delivery.actuator}"
    elif delivery.actuator == ACTUATOR_WEBHOOK and webhook_secret(deployment, settings):
        attempt = Attempt(
            delivery.id,
            delivery.event,
            body,
            url=config.get("url"),
            secret=webhook_secret(deployment, settings),
        )
        problem = ""
    elif delivery.actuator == ACTUATOR_COMMAND and config.get("command") in settings.actuator_commands:
        argv = list(settings.actuator_commands[config["command"]])
        attempt = Attempt(delivery.id, delivery.event, body, argv=argv)
        problem = ""
    else:
        problem = f"the {delivery.actuator} actuator is not configured (command not in actuator_commands?)"
    if attempt is None:
        delivery.state = STATE_FAILED
        delivery.last_error = problem
        delivery.next_attempt_at = None
        return None
    lease = max(WEBHOOK_TIMEOUT_S, settings.actuator_command_timeout_s) + CLAIM_LEASE_MARGIN_S
    delivery.next_attempt_at = now + timedelta(seconds=lease)
    return attempt


def _tail(text: str) -> str:
    return text[-ERROR_TAIL_CHARS:]


def perform(
    attempt: Attempt, *, command_timeout_s: float, webhook_timeout_s: float = WEBHOOK_TIMEOUT_S
) -> Outcome:
    """Run one attempt (no database): POST the signed body, or run the command with it on stdin."""
    if attempt.argv is not None:
        try:
            done = subprocess.run(  # noqa: S603 - argv comes from the operator's settings only
                attempt.argv, input=attempt.body, capture_output=True, timeout=command_timeout_s, check=False
            )
        except subprocess.TimeoutExpired:
            return Outcome(False, None, f"command timed out after {command_timeout_s:g} s")
        except OSError as exc:
            return Outcome(False, None, f"command could not run: {exc}")
        stderr = _tail(done.stderr.decode(errors="replace")) or None
        if done.returncode == 0:
            return Outcome(True, 0, stderr)
        return Outcome(False, done.returncode, stderr or f"command exited {done.returncode}")
    assert attempt.url is not None and attempt.secret is not None
    headers = payloads.signed_headers(attempt.secret, attempt.event, attempt.delivery_id, attempt.body)
    try:
        response = httpx.post(attempt.url, content=attempt.body, headers=headers, timeout=webhook_timeout_s)
    except httpx.HTTPError as exc:
        return Outcome(False, None, f"{type(exc).__name__}: {exc}")
    if 200 <= response.status_code < 300:
        return Outcome(True, response.status_code, None)
    return Outcome(False, response.status_code, _tail(f"HTTP {response.status_code}: {response.text}"))


def record_outcome(
    *, session: Session, delivery_id: int, outcome: Outcome, now: datetime | None = None
) -> str:
    """Count the attempt; delivered, retried later (backoff), or failed for good. Returns the state."""
    now = now or utcnow()
    delivery = session.get_one(ActuatorDelivery, delivery_id, with_for_update=True)
    delivery.attempts += 1
    delivery.last_status = outcome.status
    delivery.last_error = outcome.error
    if outcome.delivered:
        delivery.state = STATE_DELIVERED
        delivery.delivered_at = now
        delivery.next_attempt_at = None
        return delivery.state
    delay = payloads.backoff(delivery.attempts)
    if delay is None:
        delivery.state = STATE_FAILED
        delivery.next_attempt_at = None
    else:
        delivery.next_attempt_at = now + delay
    return delivery.state


def deliver(
    *,
    new_session: Callable[[], Session],
    delivery_id: int,
    settings: Settings,
    now: datetime | None = None,
) -> dict[str, Any]:
    """One attempt at a delivery, if it is due: claim (a transaction), send (none held), record
    (a transaction). What the ``ACTUATOR_DELIVER`` task runs."""
    with new_session() as session:
        attempt = claim_delivery(session=session, delivery_id=delivery_id, settings=settings, now=now)
        session.commit()
    if attempt is None:
        return {"delivery_id": delivery_id, "skipped": "not pending or not due"}
    outcome = perform(attempt, command_timeout_s=settings.actuator_command_timeout_s)
    with new_session() as session:
        state = record_outcome(session=session, delivery_id=delivery_id, outcome=outcome, now=now)
        session.commit()
    return {"delivery_id": delivery_id, "state": state, "status": outcome.status}
