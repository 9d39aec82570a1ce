"""The whole loop run in process on SQLite: a test's own copy of the migrated template database,
the Settings that put every file the loop writes under the test's folder, and the two steps such
tests take again and again (post native records for ``acme``'s ``svc``; evaluate its canary).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient

from controlplane.canary.evaluate import evaluate_deployment
from controlplane.config import Settings
from tests.conftest import TEST_SECRET

SVC = "/v1/accounts/acme/deployments/svc"


def in_process_settings(template: Path, tmp_path: Path, db_name: str, **overrides: Any) -> Settings:
    """Settings over a fresh copy of ``template`` at ``tmp_path / db_name``, with artifacts, their
    cache and the var folder under ``tmp_path`` too; ``overrides`` add to or replace any field."""
    path = tmp_path / db_name
    shutil.copy(template, path)
    fields: dict[str, Any] = {
        "database_url": f"sqlite:///{path}",
        "environment": "test",
        "secret_key": TEST_SECRET,
        "artifact_dir": tmp_path / "art",
        "artifact_cache_dir": tmp_path / "cache",
        "var_dir": tmp_path / "var",
    }
    return Settings(**(fields | overrides))


def post_native(client: TestClient, headers: dict[str, str], records: list[dict[str, Any]]) -> None:
    """Ingest native ``records`` into ``svc``; anything but a 200 fails the test."""
    reply = client.post(f"{SVC}/acceptance", json={"format": "native", "records": records}, headers=headers)
    assert reply.status_code == 200, reply.text


def evaluate_canary(sessions: Any, settings: Settings, deployment_id: int) -> dict[str, Any]:
    """One committed evaluation of the deployment's canary, which must have one."""
    with sessions() as session:
        outcome = evaluate_deployment(session=session, deployment_id=deployment_id, settings=settings)
        session.commit()
    assert outcome is not None
    return outcome
