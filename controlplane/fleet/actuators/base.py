"""What every actuator kind provides, and what one delivery attempt is.

This module owns ``ActuatorKind``, the protocol one kind implements: its name, the API fields its
config takes, whether its events are delivered at all, the validation of those fields into the
config to store, what it draws anew each time it is set, its signing secret, how long one attempt
may take, and the claim of one attempt from a delivery row. It also owns ``Attempt`` (one claimed
attempt, read in a transaction and sent outside it, by the kind's own ``send``), ``Outcome``, and
what the kinds share: ``DeliveringActuator`` (the base of the kinds that deliver), the 422
naming a field, the candidate pool's ready timeout, the error tail.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from controlplane.config import Settings
from controlplane.db.models import ActuatorDelivery, Deployment
from controlplane.errors import ValidationProblem

DEFAULT_READY_TIMEOUT_S = 600
MAX_READY_TIMEOUT_S = 24 * 3600
ERROR_TAIL_CHARS = 2000


@dataclass(frozen=True, slots=True)
class Outcome:
    delivered: bool
    status: int | None
    error: str | None


@dataclass(frozen=True, slots=True)
class Attempt(ABC):
    """One claimed attempt: what to send, read in a transaction; ``send`` runs it outside one
    (no database)."""

    delivery_id: int
    event: str
    body: bytes

    @abstractmethod
    def send(self) -> Outcome:
        """Hand the event over once; a failure is an ``Outcome``, never an exception."""


class ActuatorKind(Protocol):
    """One way a deployment's events reach its fleet; the registry holds one of each."""

    name: str
    # The API fields a config of this kind takes ("kind" among them); any other is refused.
    fields: frozenset[str]
    # Whether events are delivered at all; a canary waits for its candidate pool only if they are.
    delivers: bool

    def validate(self, fields: Mapping[str, Any], settings: Settings) -> dict[str, Any]:
        """The config to store for ``fields`` (already known to be this kind's), without any
        secret; a 422 naming the field otherwise."""
        ...

    def to_store(self, config: dict[str, Any]) -> dict[str, Any]:
        """The validated ``config`` plus what this kind draws anew each time it is set."""
        ...

    def signing_secret(self, deployment: Deployment, settings: Settings) -> str | None:
        """The secret the deployment's receivers verify events with (None if this kind signs none)."""
        ...

    def attempt_timeout_s(self, settings: Settings) -> float:
        """The longest one attempt of this kind may take."""
        ...

    def claim(
        self, *, delivery: ActuatorDelivery, deployment: Deployment, body: bytes, settings: Settings
    ) -> Attempt | None:
        """The attempt that sends ``body`` for ``delivery`` (None: this kind is not configured to)."""
        ...


class DeliveringActuator(ABC):
    """What the kinds that deliver events share: a config of the kind's own target fields and the
    candidate pool's ready timeout, checked first; no secret drawn or signed with unless the kind
    says otherwise."""

    name: str
    fields: frozenset[str]
    delivers = True

    def validate(self, fields: Mapping[str, Any], settings: Settings) -> dict[str, Any]:
        timeout = ready_timeout(fields.get("ready_timeout_s"))
        return {"kind": self.name, **self.validate_target(fields, settings), "ready_timeout_s": timeout}

    @abstractmethod
    def validate_target(self, fields: Mapping[str, Any], settings: Settings) -> dict[str, Any]:
        """The config's fields that say where events go; a 422 naming the field otherwise."""

    def to_store(self, config: dict[str, Any]) -> dict[str, Any]:
        return config

    def signing_secret(self, deployment: Deployment, settings: Settings) -> str | None:
        return None


def problem(field: str, message: str) -> ValidationProblem:
    """A 422 naming ``field``."""
    return ValidationProblem(f"{field}: {message}", details=[{"field": field, "message": message}])


def ready_timeout(value: Any) -> int:
    """How long a canary waits for its candidate pool, in whole seconds (the default if unset)."""
    if value is None:
        return DEFAULT_READY_TIMEOUT_S
    if isinstance(value, bool) or not isinstance(value, int | float) or not 1 <= value <= MAX_READY_TIMEOUT_S:
        raise problem("ready_timeout_s", f"must be a number of seconds from 1 to {MAX_READY_TIMEOUT_S}")
    return int(value) if float(value).is_integer() else max(1, int(value))


def error_tail(text: str) -> str:
    """The end of ``text``, where a failure's reason usually is, short enough to store."""
    return text[-ERROR_TAIL_CHARS:]
