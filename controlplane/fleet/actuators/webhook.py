"""The ``webhook`` actuator: each event is POSTed as signed JSON (``controlplane.fleet.payloads``
documents the payload, the headers and the signature) to the configured URL.

This module owns that kind's config (``url``, ``ready_timeout_s``), its signing secret and its
attempt. The secret is derived from ``Settings.secret_key`` and a nonce stored with the actuator,
so the database never holds it; it is shown once, in the reply that set the webhook (setting it
again draws a new nonce, which rotates it).
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import httpx

from controlplane.config import Settings
from controlplane.db.models import ActuatorDelivery, Deployment
from controlplane.fleet import payloads
from controlplane.fleet.actuators.base import Attempt, DeliveringActuator, Outcome, error_tail
from controlplane.fleet.backends import check_http_url

ACTUATOR_WEBHOOK: Final = "webhook"
WEBHOOK_TIMEOUT_S = 10.0


def webhook_secret(deployment: Deployment, settings: Settings) -> str | None:
    """The deployment's current webhook signing secret (None unless its actuator is a webhook)."""
    nonce = (deployment.actuator_config or {}).get("secret_nonce")
    if deployment.actuator != ACTUATOR_WEBHOOK or not isinstance(nonce, str):
        return None
    return payloads.derive_secret(settings.secret_key, deployment.id, nonce)


@dataclass(frozen=True, slots=True)
class WebhookAttempt(Attempt):
    """POST the signed body to ``url``."""

    url: str | None
    secret: str
    timeout_s: float = WEBHOOK_TIMEOUT_S

    def send(self) -> Outcome:
        assert self.url is not None and self.secret is not None
        headers = payloads.signed_headers(self.secret, self.event, self.delivery_id, self.body)
        try:
            response = httpx.post(self.url, content=self.body, headers=headers, timeout=self.timeout_s)
        except httpx.HTTPError as exc:
            return Outcome(False, None, f"{type(exc).__name__}: {exc}")
        if 200 <= response.status_code < 300:
            return Outcome(True, response.status_code, None)
        status = response.status_code
        return Outcome(False, status, error_tail(f"HTTP {status}: {response.text}"))


class WebhookActuator(DeliveringActuator):
    name = ACTUATOR_WEBHOOK
    fields = frozenset({"kind", "url", "ready_timeout_s"})

    def validate_target(self, fields: Mapping[str, Any], settings: Settings) -> dict[str, Any]:
        return {"url": check_http_url(fields.get("url"), "url")}

    def to_store(self, config: dict[str, Any]) -> dict[str, Any]:
        return {**config, "secret_nonce": secrets.token_hex(16)}

    def signing_secret(self, deployment: Deployment, settings: Settings) -> str | None:
        return webhook_secret(deployment, settings)

    def attempt_timeout_s(self, settings: Settings) -> float:
        return WEBHOOK_TIMEOUT_S

    def claim(
        self, *, delivery: ActuatorDelivery, deployment: Deployment, body: bytes, settings: Settings
    ) -> Attempt | None:
        secret = webhook_secret(deployment, settings)
        if not secret:
            return None
        url = (deployment.actuator_config or {}).get("url")
        return WebhookAttempt(delivery.id, delivery.event, body, url=url, secret=secret)


KIND: Final = WebhookActuator()
