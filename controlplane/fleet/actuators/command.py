"""The ``command`` actuator: one of the operator-configured programs (``Settings.actuator_commands``)
runs with the event's JSON on stdin; exit 0 means delivered.

This module owns that kind's config (``command``, the name of a configured program, and
``ready_timeout_s``) and its attempt.
"""

from __future__ import annotations

import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from controlplane.config import Settings
from controlplane.db.models import ActuatorDelivery, Deployment
from controlplane.fleet.actuators.base import Attempt, DeliveringActuator, Outcome, error_tail, problem

ACTUATOR_COMMAND: Final = "command"


@dataclass(frozen=True, slots=True)
class CommandAttempt(Attempt):
    """Run ``argv`` with the body on stdin, for at most ``timeout_s``."""

    argv: list[str]
    timeout_s: float

    def send(self) -> Outcome:
        try:
            done = subprocess.run(  # noqa: S603 - argv comes from the operator's settings only
                self.argv, input=self.body, capture_output=True, timeout=self.timeout_s, check=False
            )
        except subprocess.TimeoutExpired:
            return Outcome(False, None, f"command timed out after {self.timeout_s:g} s")
        except OSError as exc:
            return Outcome(False, None, f"command could not run: {exc}")
        stderr = error_tail(done.stderr.decode(errors="replace")) or None
        if done.returncode == 0:
            return Outcome(True, 0, stderr)
        return Outcome(False, done.returncode, stderr or f"command exited {done.returncode}")


class CommandActuator(DeliveringActuator):
    name = ACTUATOR_COMMAND
    fields = frozenset({"kind", "command", "ready_timeout_s"})

    def validate_target(self, fields: Mapping[str, Any], settings: Settings) -> dict[str, Any]:
        # Only a name the operator configured: the API never takes a command line, since an API key
        # must not be able to run a program of its choosing on the control plane's hosts.
        name = fields.get("command")
        if not isinstance(name, str) or name not in settings.actuator_commands:
            configured = ", ".join(sorted(settings.actuator_commands)) or "none are configured"
            raise problem("command", f"must name a command the operator configured ({configured})")
        return {"command": name}

    def attempt_timeout_s(self, settings: Settings) -> float:
        return settings.actuator_command_timeout_s

    def claim(
        self, *, delivery: ActuatorDelivery, deployment: Deployment, body: bytes, settings: Settings
    ) -> Attempt | None:
        config = deployment.actuator_config or {}
        if config.get("command") not in settings.actuator_commands:
            return None
        argv = list(settings.actuator_commands[config["command"]])
        return CommandAttempt(
            delivery.id, delivery.event, body, argv=argv, timeout_s=settings.actuator_command_timeout_s
        )


KIND: Final = CommandActuator()
