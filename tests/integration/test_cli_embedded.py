"""The embedded default as a user meets it: a real API process on SQLite with no services, the
first start printing an admin key once, and the firectl-like CLI talking to it over HTTP."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

CLI = [sys.executable, "-m", "controlplane"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[dict[str, str], subprocess.Popen[str]]]:
    port = _free_port()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("CONTROLPLANE_")},
        "CONTROLPLANE_API_PORT": str(port),
        "CONTROLPLANE_API_URL": f"http://127.0.0.1:{port}",
    }
    process = subprocess.Popen(
        [*CLI, "serve"], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.2)
    else:
        process.kill()
        raise AssertionError(f"server did not start: {process.communicate()}")
    env["CWD"] = str(tmp_path)
    yield env, process
    process.terminate()
    process.wait(timeout=20)


def _cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], cwd=env["CWD"], env=env, capture_output=True, text=True, timeout=60)


def test_first_start_prints_a_key_once_and_the_cli_manages_deployments(
    server: tuple[dict[str, str], subprocess.Popen[str]],
) -> None:
    env, process = server
    key_file = Path(env["CWD"]) / "var" / "admin.key"
    key = key_file.read_text().strip()
    assert key.startswith("sk_") and oct(key_file.stat().st_mode & 0o777) == "0o600"
    # init registered the bundled pair; the account registers its own names for the same folders.
    assert "reference-target\tplatform\tllama" in _cli(env, "model", "list").stdout
    unknown = _cli(env, "deployment", "create", "llama-8b", "--deployment-id", "chat")
    assert unknown.returncode == 1 and "422" in unknown.stderr and "model register llama-8b" in unknown.stderr
    registered = _cli(env, "model", "register", "llama-8b", "--path", "reference/target")
    assert registered.returncode == 0, registered.stderr
    assert json.loads(registered.stdout)["family"] == "llama"
    drafter = _cli(
        env,
        "model",
        "register",
        "drafter-a",
        "--path",
        "reference/generic-drafter",
        "--drafter-for",
        "llama-8b",
    )
    assert drafter.returncode == 0, drafter.stderr
    outside = _cli(env, "model", "register", "stolen", "--path", "/etc")
    assert outside.returncode == 1 and "model root" in outside.stderr
    created = _cli(
        env,
        "deployment",
        "create",
        "llama-8b",
        "--deployment-id",
        "chat",
        "--draft-model",
        "drafter-a",
        "--draft-token-count",
        "5",
    )
    assert created.returncode == 0, created.stderr
    assert json.loads(created.stdout)["speculation_mode"] == "draft_model"
    clash = _cli(
        env,
        "deployment",
        "create",
        "llama-8b",
        "--draft-model",
        "drafter-a",
        "--ngram-speculation-length",
        "3",
        "--draft-token-count",
        "4",
    )
    assert clash.returncode == 1 and "mutually exclusive" in clash.stderr
    updated = _cli(env, "deployment", "update", "chat", "--draft-token-count", "3")
    assert json.loads(updated.stdout)["draft_token_count"] == 3
    assert "accounts/default/deployments/chat" in _cli(env, "deployment", "list").stdout
    assert json.loads(_cli(env, "deployment", "get", "chat").stdout)["draft_model"] == "drafter-a"
    # Drafter and canary verbs: nothing to show yet, and a refused action says why.
    assert "no drafter versions" in _cli(env, "drafter", "list", "chat").stderr
    assert "no canaries" in _cli(env, "canary", "list", "chat").stderr
    nothing = _cli(env, "drafter", "rollback", "chat", "--reason", "test")
    assert nothing.returncode == 1 and "409" in nothing.stderr and "nothing to roll back" in nothing.stderr
    unknown = _cli(env, "drafter", "promote", "chat", "7")
    assert unknown.returncode == 1 and "404" in unknown.stderr
    assert _cli(env, "deployment", "delete", "chat").returncode == 0
    missing = _cli(env, "deployment", "get", "chat")
    assert missing.returncode == 1 and "404" in missing.stderr
    process.terminate()
    _, stderr = process.communicate(timeout=20)
    assert key in stderr  # printed on first start...
    again = subprocess.run(
        [*CLI, "init"], cwd=env["CWD"], env=env, capture_output=True, text=True, timeout=60
    )
    assert again.returncode == 1 and "already exists" in again.stderr  # ...and never again


def test_production_refuses_default_secrets(tmp_path: Path) -> None:
    env = {**os.environ, "CONTROLPLANE_ENVIRONMENT": "production"}
    env.pop("CONTROLPLANE_SECRET_KEY", None)
    result = subprocess.run(
        [*CLI, "serve"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode != 0 and "CONTROLPLANE_SECRET_KEY" in result.stderr
