"""The actuator registry, pure: each kind is registered once under its own name, in the order the
refusal lists them; an unknown kind is refused with the message the API has always given; every
kind module's ``KIND`` is registered; and what the shared code asks of each kind (fields, whether
a canary waits for its pool, how long an attempt may take) comes out as each kind says."""

from __future__ import annotations

import importlib
import pkgutil
import sys
from typing import Any

import pytest

from controlplane.config import Settings
from controlplane.db.models import Deployment
from controlplane.errors import ValidationProblem
from controlplane.fleet import actuators
from controlplane.fleet.actuators import (
    ACTUATOR_KINDS,
    ACTUATORS,
    KINDS,
    actuator_kind,
    validate_actuator,
    waits_for_pool,
)

UNKNOWN_KIND = "kind: must be one of reference, webhook, command"


def _settings(**values: Any) -> Settings:
    return Settings(environment="test", **values)


def test_the_registry_holds_each_kind_once_under_its_own_name() -> None:
    names = [kind.name for kind in KINDS]
    assert names == ["reference", "webhook", "command"]
    assert len(set(names)) == len(names) == len(ACTUATOR_KINDS)
    assert all(ACTUATOR_KINDS[kind.name] is kind for kind in KINDS)
    assert ACTUATORS == ("reference", "webhook", "command")


def test_every_kind_module_is_registered() -> None:
    # A module that defines a KIND but was left out of the registry would never be offered.
    defined = []
    for info in pkgutil.iter_modules(actuators.__path__):
        module = importlib.import_module(f"{actuators.__name__}.{info.name}")
        if hasattr(module, "KIND"):
            defined.append(module.KIND)
    assert sorted(kind.name for kind in defined) == sorted(ACTUATORS)
    assert all(any(kind is registered for registered in KINDS) for kind in defined)


@pytest.mark.parametrize("name", ["nope", "Webhook", "", None, 3, ["webhook"], {"kind": "webhook"}])
def test_an_unknown_kind_is_refused_with_the_message_it_always_had(name: object) -> None:
    with pytest.raises(ValidationProblem) as refused:
        actuator_kind(name)
    assert str(refused.value) == UNKNOWN_KIND
    assert refused.value.details == [
        {"field": "kind", "message": "must be one of reference, webhook, command"}
    ]
    with pytest.raises(ValidationProblem, match=f"^{UNKNOWN_KIND}$"):
        validate_actuator({"kind": name, "url": "http://fleet/hook"}, _settings())


def test_a_field_of_another_kind_is_refused_by_name() -> None:
    settings = _settings(actuator_commands={"roll": [sys.executable, "-c", "pass"]})
    with pytest.raises(ValidationProblem, match="^url: not a field of a command actuator$"):
        validate_actuator({"kind": "command", "command": "roll", "url": "http://fleet/hook"}, settings)
    with pytest.raises(ValidationProblem, match="^ready_timeout_s: not a field of a reference actuator$"):
        validate_actuator({"kind": "reference", "ready_timeout_s": 5}, settings)
    assert validate_actuator({"kind": "command", "command": "roll"}, settings) == {
        "kind": "command",
        "command": "roll",
        "ready_timeout_s": 600,
    }


def test_a_canary_waits_for_its_pool_unless_the_servers_follow_the_serving_config() -> None:
    def deployment(actuator: str | None) -> Deployment:
        return Deployment(actuator=actuator, actuator_config={})

    assert [waits_for_pool(deployment(name)) for name in ACTUATORS] == [False, True, True]
    assert waits_for_pool(deployment(None)) is False  # never set: the reference actuator
    # A stored kind no longer registered still gets its events, which then fail with a reason.
    assert waits_for_pool(deployment("retired-kind")) is True


def test_only_the_webhook_draws_a_secret_when_set() -> None:
    for kind in KINDS:
        config = kind.to_store({"kind": kind.name})
        assert ("secret_nonce" in config) is (kind.name == "webhook")
    first, second = (ACTUATOR_KINDS["webhook"].to_store({"kind": "webhook"}) for _ in range(2))
    assert first["secret_nonce"] != second["secret_nonce"]  # setting it again rotates the secret


def test_each_kind_says_how_long_one_attempt_may_take() -> None:
    settings = _settings(actuator_command_timeout_s=45.0)
    timeouts = {kind.name: kind.attempt_timeout_s(settings) for kind in KINDS}
    assert timeouts == {"reference": 0.0, "webhook": actuators.WEBHOOK_TIMEOUT_S, "command": 45.0}
