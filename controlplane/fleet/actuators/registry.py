"""The registry of actuator kinds: the one place the shared code (configuration, deliveries,
sending) looks a kind up. A new kind is one module defining its ``KIND`` and one line in
``KINDS``; its position there is its position in the refusal that lists the kinds.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

from controlplane.fleet.actuators import command, reference, webhook
from controlplane.fleet.actuators.base import ActuatorKind, problem

KINDS: Final[tuple[ActuatorKind, ...]] = (
    reference.KIND,
    webhook.KIND,
    command.KIND,
)
ACTUATOR_KINDS: Final[Mapping[str, ActuatorKind]] = MappingProxyType({kind.name: kind for kind in KINDS})
ACTUATORS: Final = tuple(ACTUATOR_KINDS)
# A deployment that never set an actuator has this one.
DEFAULT_ACTUATOR: Final = reference.ACTUATOR_REFERENCE


def actuator_kind(name: object) -> ActuatorKind:
    """The registered kind called ``name``; a 422 naming the field ``kind`` otherwise."""
    if not isinstance(name, str) or name not in ACTUATOR_KINDS:
        raise problem("kind", f"must be one of {', '.join(ACTUATORS)}")
    return ACTUATOR_KINDS[name]
