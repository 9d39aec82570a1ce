"""The ``reference`` actuator: the servers follow ``serving-config`` themselves, so nothing is
delivered and a canary never waits for its pool. It owns that kind's name and config (the kind
alone)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from controlplane.config import Settings
from controlplane.db.models import ActuatorDelivery, Deployment
from controlplane.fleet.actuators.base import Attempt

ACTUATOR_REFERENCE: Final = "reference"


class ReferenceActuator:
    name = ACTUATOR_REFERENCE
    fields = frozenset({"kind"})
    delivers = False

    def validate(self, fields: Mapping[str, Any], settings: Settings) -> dict[str, Any]:
        return {"kind": self.name}

    def to_store(self, config: dict[str, Any]) -> dict[str, Any]:
        return config

    def signing_secret(self, deployment: Deployment, settings: Settings) -> str | None:
        return None

    def attempt_timeout_s(self, settings: Settings) -> float:
        return 0.0

    def claim(
        self, *, delivery: ActuatorDelivery, deployment: Deployment, body: bytes, settings: Settings
    ) -> Attempt | None:
        # No event is written for this kind; a row claiming it anyway fails as not configured.
        return None


KIND: Final = ReferenceActuator()
