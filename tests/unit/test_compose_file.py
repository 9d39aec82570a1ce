"""docker-compose.yml cannot run here (no Docker engine); check its shape and that every command
it names exists in this package."""

from __future__ import annotations

import shlex
from pathlib import Path

import yaml
from typer.main import get_command

from controlplane.cli import app

COMPOSE = Path(__file__).resolve().parents[2] / "docker-compose.yml"


def _cli_commands() -> set[str]:
    root = get_command(app)
    names = set()
    for name, command in root.commands.items():  # type: ignore[attr-defined]
        names.add(name)
        for sub in getattr(command, "commands", {}):
            names.add(f"{name} {sub}")
    return names


def test_compose_services_have_healthchecks_and_no_secret_defaults() -> None:
    spec = yaml.safe_load(COMPOSE.read_text())
    services = spec["services"]
    assert {"postgres", "redis", "api"} <= set(services)
    for name in ("postgres", "redis", "api"):
        assert "healthcheck" in services[name], name
    assert services["api"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    text = COMPOSE.read_text()
    # Secrets come from .env and fail loudly when missing (${VAR:?message}).
    assert "${POSTGRES_PASSWORD:?" in text and "${CONTROLPLANE_SECRET_KEY:?" in text


def test_every_controlplane_command_in_compose_exists() -> None:
    spec = yaml.safe_load(COMPOSE.read_text())
    known = _cli_commands()
    used = []
    for service in spec["services"].values():
        command = service.get("command")
        if not command:
            continue
        line = " ".join(command) if isinstance(command, list) else command
        for part in line.split("&&"):
            words = shlex.split(part.replace("sh -c", ""))
            if "controlplane" in words:
                rest = words[words.index("controlplane") + 1 :]
                used.append(rest[0] if rest[0] in known else " ".join(rest[:2]))
    assert used, "compose names no controlplane command"
    assert set(used) <= known, set(used) - known
