"""Deployments through the HTTP API on real databases: firectl rules, audit, locking, health."""

from __future__ import annotations

from fastapi.testclient import TestClient

from controlplane.db.models import Role
from tests.conftest import Tenant


def _create(client: TestClient, tenant: Tenant, body: dict[str, object]) -> dict[str, object]:
    url = f"/v1/accounts/{tenant.name}/deployments"
    response = client.post(url, json=body, headers=tenant.headers(Role.admin))
    assert response.status_code == 201, response.text
    data: dict[str, object] = response.json()
    return data


def test_create_modes_follow_firectl(client: TestClient, tenants: tuple[Tenant, Tenant]) -> None:
    acme, _ = tenants
    inherit = _create(client, acme, {"target_model": "reference-target", "deployment_id": "inherit"})
    assert inherit["speculation_mode"] == "default"
    assert inherit["name"] == "accounts/acme/deployments/inherit"
    assert inherit["effective_draft_token_count"] == 4
    drafted = _create(
        client,
        acme,
        {
            "target_model": "reference-target",
            "deployment_id": "drafted",
            "draft_model": "reference-drafter",
            "draft_token_count": 5,
        },
    )
    assert (drafted["speculation_mode"], drafted["draft_token_count"]) == ("draft_model", 5)
    ngram = _create(
        client,
        acme,
        {
            "target_model": "reference-target",
            "deployment_id": "ngram",
            "ngram_speculation_length": 3,
            "draft_token_count": 4,
        },
    )
    assert (ngram["speculation_mode"], ngram["ngram_speculation_length"]) == ("ngram", 3)
    off = _create(
        client,
        acme,
        {"target_model": "reference-target", "deployment_id": "off", "disable_speculative_decoding": True},
    )
    assert (off["speculation_mode"], off["effective_draft_token_count"]) == ("disabled", 0)


def test_invalid_combinations_are_rejected_and_store_nothing(
    client: TestClient, tenants: tuple[Tenant, Tenant]
) -> None:
    acme, _ = tenants
    url = f"/v1/accounts/{acme.name}/deployments"
    headers = acme.headers(Role.admin)
    bad_bodies = [
        {
            "target_model": "reference-target",
            "draft_model": "reference-drafter",
            "ngram_speculation_length": 3,
            "draft_token_count": 4,
        },
        {"target_model": "reference-target", "draft_model": "reference-drafter"},
        {"target_model": "reference-target", "ngram_speculation_length": 3},
        {"target_model": "reference-target", "disable_speculative_decoding": True, "draft_token_count": 3},
        {"target_model": "reference-target", "draft_model": "reference-drafter", "draft_token_count": 99},
        {"target_model": "reference-target", "deployment_id": "Not A Name"},
        {"target_model": ""},
        {"target_model": "reference-target", "unknown_flag": 1},
    ]
    for body in bad_bodies:
        response = client.post(url, json=body, headers=headers)
        assert response.status_code == 422, (body, response.text)
        assert response.json()["error"]["message"]
    assert client.get(url, headers=headers).json()["deployments"] == []


def test_update_changes_drafter_and_count_and_is_audited(
    client: TestClient, tenants: tuple[Tenant, Tenant]
) -> None:
    acme, _ = tenants
    _create(client, acme, {"target_model": "reference-target", "deployment_id": "web"})
    url = f"/v1/accounts/{acme.name}/deployments/web"
    headers = acme.headers(Role.admin)
    response = client.patch(
        url, json={"draft_model": "reference-drafter", "draft_token_count": 6}, headers=headers
    )
    assert response.status_code == 200, response.text
    assert (response.json()["draft_model"], response.json()["draft_token_count"]) == ("reference-drafter", 6)
    response = client.patch(url, json={"draft_token_count": 3}, headers=headers)
    assert response.json()["draft_token_count"] == 3 and response.json()["draft_model"] == "reference-drafter"
    response = client.patch(url, json={"ngram_speculation_length": 2}, headers=headers)
    assert response.json()["speculation_mode"] == "ngram" and response.json()["draft_model"] is None
    stale = client.patch(url, json={"draft_token_count": 5, "row_version": 1}, headers=headers)
    assert stale.status_code == 409
    audit = client.get(
        f"/v1/accounts/{acme.name}/audit", params={"deployment": "web"}, headers=headers
    ).json()
    actions = [e["action"] for e in audit["entries"]]
    assert actions == ["deployment.update", "deployment.update", "deployment.update", "deployment.create"]
    first_update = audit["entries"][-2]
    assert first_update["before"]["speculation_mode"] == "default"
    assert first_update["after"]["draft_model"] == "reference-drafter"
    assert first_update["actor"].startswith("key:admin#")


def test_delete_frees_the_name_and_keeps_history(client: TestClient, tenants: tuple[Tenant, Tenant]) -> None:
    acme, _ = tenants
    headers = acme.headers(Role.admin)
    _create(client, acme, {"target_model": "reference-target", "deployment_id": "tmp"})
    duplicate = client.post(
        f"/v1/accounts/{acme.name}/deployments",
        json={"target_model": "reference-target", "deployment_id": "tmp"},
        headers=headers,
    )
    assert duplicate.status_code == 409
    assert client.delete(f"/v1/accounts/{acme.name}/deployments/tmp", headers=headers).status_code == 204
    assert client.get(f"/v1/accounts/{acme.name}/deployments/tmp", headers=headers).status_code == 404
    _create(client, acme, {"target_model": "reference-target", "deployment_id": "tmp"})
    audit = client.get(f"/v1/accounts/{acme.name}/audit", headers=headers).json()["entries"]
    assert [e["action"] for e in audit][:3] == ["deployment.create", "deployment.delete", "deployment.create"]


def test_keys_are_hashed_and_revocable(
    client: TestClient, tenants: tuple[Tenant, Tenant], db: object
) -> None:
    acme, _ = tenants
    headers = acme.headers(Role.admin)
    created = client.post(
        f"/v1/accounts/{acme.name}/api-keys", json={"name": "ci", "role": "viewer"}, headers=headers
    ).json()
    secret = created["key"]
    listed = client.get(f"/v1/accounts/{acme.name}/api-keys", headers=headers).json()["api_keys"]
    assert all("key" not in k and secret not in str(k) for k in listed)
    viewer = {"Authorization": f"Bearer {secret}"}
    assert client.get("/v1/whoami", headers=viewer).json()["role"] == "viewer"
    assert (
        client.delete(f"/v1/accounts/{acme.name}/api-keys/{created['id']}", headers=headers).status_code
        == 204
    )
    assert client.get("/v1/whoami", headers=viewer).status_code == 401
    assert client.get("/v1/whoami").status_code == 401
    assert client.get("/v1/whoami", headers={"Authorization": "Bearer sk_nope_nope"}).status_code == 401


def test_health_and_readiness(client: TestClient) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz")
    assert ready.status_code == 200 and ready.json()["status"] == "ready"
    assert client.get("/docs").status_code == 200
    assert "/v1/accounts/{account}/deployments" in client.get("/openapi.json").json()["paths"]
