"""How a deployment's decisions reach its serving fleet, and every event handed over.

A deployment's actuator is one of the kinds in the registry (``registry.KINDS``), one module each:

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

The package: ``base`` (the ``ActuatorKind`` protocol, ``Attempt``, ``Outcome``), one module per
kind, ``registry`` (the kinds, looked up by name), ``configuration`` (validating, setting and
showing a deployment's actuator), ``deliveries`` (the rows, the outbox, reads and the admin's
retry) and ``sending`` (claim, send, record). Every name importers use is re-exported here.
"""

from __future__ import annotations

from controlplane.fleet.actuators.base import (
    DEFAULT_READY_TIMEOUT_S,
    ERROR_TAIL_CHARS,
    MAX_READY_TIMEOUT_S,
    ActuatorKind,
    Attempt,
    Outcome,
)
from controlplane.fleet.actuators.command import ACTUATOR_COMMAND, CommandAttempt
from controlplane.fleet.actuators.configuration import (
    actuator_view,
    ready_timeout_s,
    set_actuator,
    validate_actuator,
    waits_for_pool,
)
from controlplane.fleet.actuators.deliveries import (
    STATE_DELIVERED,
    STATE_FAILED,
    STATE_PENDING,
    delivery_summary,
    due_deliveries,
    get_delivery,
    list_deliveries,
    ready_callback_url,
    record_event,
    retry_delivery,
    take_outbox,
)
from controlplane.fleet.actuators.reference import ACTUATOR_REFERENCE
from controlplane.fleet.actuators.registry import (
    ACTUATOR_KINDS,
    ACTUATORS,
    DEFAULT_ACTUATOR,
    KINDS,
    actuator_kind,
)
from controlplane.fleet.actuators.sending import (
    CLAIM_LEASE_MARGIN_S,
    claim_delivery,
    deliver,
    perform,
    record_outcome,
)
from controlplane.fleet.actuators.webhook import (
    ACTUATOR_WEBHOOK,
    WEBHOOK_TIMEOUT_S,
    WebhookAttempt,
    webhook_secret,
)

__all__ = [
    "ACTUATORS",
    "ACTUATOR_COMMAND",
    "ACTUATOR_KINDS",
    "ACTUATOR_REFERENCE",
    "ACTUATOR_WEBHOOK",
    "CLAIM_LEASE_MARGIN_S",
    "DEFAULT_ACTUATOR",
    "DEFAULT_READY_TIMEOUT_S",
    "ERROR_TAIL_CHARS",
    "KINDS",
    "MAX_READY_TIMEOUT_S",
    "STATE_DELIVERED",
    "STATE_FAILED",
    "STATE_PENDING",
    "WEBHOOK_TIMEOUT_S",
    "ActuatorKind",
    "Attempt",
    "CommandAttempt",
    "Outcome",
    "WebhookAttempt",
    "actuator_kind",
    "actuator_view",
    "claim_delivery",
    "deliver",
    "delivery_summary",
    "due_deliveries",
    "get_delivery",
    "list_deliveries",
    "perform",
    "ready_callback_url",
    "ready_timeout_s",
    "record_event",
    "record_outcome",
    "retry_delivery",
    "set_actuator",
    "take_outbox",
    "validate_actuator",
    "waits_for_pool",
    "webhook_secret",
]
