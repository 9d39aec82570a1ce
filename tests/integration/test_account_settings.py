"""An account's own settings through the HTTP API on real databases: admins change how long the
account's acceptance data is kept (audited, bounded), viewers read it, and no account sees or
changes another's."""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient

from controlplane.db.models import Role
from tests.conftest import Tenant


def _settings(client: TestClient, tenant: Tenant, role: Role = Role.admin) -> dict[str, Any]:
    response = client.get(f"/v1/accounts/{tenant.name}/settings", headers=tenant.headers(role))
    assert response.status_code == 200, response.text
    data: dict[str, Any] = response.json()
    return data


def test_an_admin_changes_the_retention_and_the_change_is_audited(
    client: TestClient, tenants: tuple[Tenant, Tenant]
) -> None:
    acme, globex = tenants
    assert _settings(client, acme) == {"account": "acme", "acceptance_retention_days": 14}
    url = f"/v1/accounts/{acme.name}/settings"
    changed = client.patch(url, json={"acceptance_retention_days": 90}, headers=acme.headers(Role.admin))
    assert changed.status_code == 200, changed.text
    assert changed.json() == {"account": "acme", "acceptance_retention_days": 90}
    assert _settings(client, acme, Role.viewer)["acceptance_retention_days"] == 90
    assert _settings(client, globex)["acceptance_retention_days"] == 14

    # An empty change changes nothing and writes no audit row.
    assert (
        client.patch(url, json={}, headers=acme.headers(Role.admin)).json()["acceptance_retention_days"] == 90
    )
    audit = client.get(f"/v1/accounts/{acme.name}/audit", headers=acme.headers(Role.admin)).json()
    entries = [e for e in audit["entries"] if e["action"] == "account_settings.update"]
    assert len(entries) == 1
    assert entries[0]["resource"] == "accounts/acme"
    assert entries[0]["before"]["acceptance_retention_days"] == 14
    assert entries[0]["after"]["acceptance_retention_days"] == 90


def test_out_of_range_or_unknown_settings_are_refused_and_change_nothing(
    client: TestClient, tenants: tuple[Tenant, Tenant]
) -> None:
    acme, _ = tenants
    url = f"/v1/accounts/{acme.name}/settings"
    for body in (
        {"acceptance_retention_days": 0},
        {"acceptance_retention_days": 3651},
        {"acceptance_retention_days": -5},
        {"acceptance_retention_days": "forever"},
        {"acceptance_retention_days": 2**63},
        {"trace_retention_days": 5},
    ):
        response = client.patch(url, json=body, headers=acme.headers(Role.admin))
        assert response.status_code == 422, (body, response.text)
        assert response.json()["error"]["code"] == "ValidationProblem"
    for days in (1, 3650):
        response = client.patch(
            url, json={"acceptance_retention_days": days}, headers=acme.headers(Role.admin)
        )
        assert response.json()["acceptance_retention_days"] == days
    assert _settings(client, acme)["acceptance_retention_days"] == 3650


def test_no_account_sees_or_changes_anothers_settings(
    client: TestClient, tenants: tuple[Tenant, Tenant]
) -> None:
    acme, globex = tenants
    url = f"/v1/accounts/{acme.name}/settings"
    for role in Role:
        assert client.get(url, headers=globex.headers(role)).status_code == 404
        patched = client.patch(url, json={"acceptance_retention_days": 1}, headers=globex.headers(role))
        assert patched.status_code == 404
    for role in (Role.viewer, Role.ingest, Role.serving):
        patched = client.patch(url, json={"acceptance_retention_days": 1}, headers=acme.headers(role))
        assert patched.status_code == 403
    assert _settings(client, acme)["acceptance_retention_days"] == 14
