"""GET .../serving-config/export: the serving config as a LiteLLM config or an HTTPRoute, in YAML."""

from __future__ import annotations

import yaml
from fastapi.testclient import TestClient

from controlplane.db.models import Role
from tests.conftest import Tenant

BASE = "/v1/accounts/acme/deployments"


def test_export_litellm_and_httproute(client: TestClient, tenants: tuple[Tenant, Tenant]) -> None:
    acme = tenants[0]
    admin, serving = acme.headers(Role.admin), acme.headers(Role.serving)
    created = client.post(
        BASE,
        json={
            "target_model": "reference-target",
            "deployment_id": "svc",
            "draft_model": "reference-drafter",
            "draft_token_count": 4,
        },
        headers=admin,
    )
    assert created.status_code == 201, created.text
    url = f"{BASE}/svc/serving-config/export"
    empty = client.get(url, params={"format": "httproute"}, headers=serving)
    assert empty.status_code == 200 and yaml.safe_load(empty.text)["spec"]["rules"][0]["backendRefs"] == []

    for name in ("engine-a", "engine-b"):
        backend = {"name": name, "pool": "incumbent", "url": f"http://{name}.serving:8000"}
        added = client.post(f"{BASE}/svc/backends", json=backend, headers=admin)
        assert added.status_code == 201, added.text

    litellm = client.get(url, params={"format": "litellm"}, headers=serving)
    assert litellm.status_code == 200 and litellm.headers["content-type"].startswith("application/yaml")
    doc = yaml.safe_load(litellm.text)
    assert [e["litellm_params"]["api_base"] for e in doc["model_list"]] == [
        "http://engine-a.serving:8000/v1",
        "http://engine-b.serving:8000/v1",
    ]
    assert [e["litellm_params"]["weight"] for e in doc["model_list"]] == [5000, 5000]

    route = client.get(
        url, params={"format": "httproute", "as": "json", "namespace": "serving"}, headers=serving
    )
    assert route.status_code == 200 and route.headers["content-type"].startswith("application/json")
    refs = route.json()["spec"]["rules"][0]["backendRefs"]
    assert refs == [
        {"name": "engine-a", "port": 8000, "weight": 5000},
        {"name": "engine-b", "port": 8000, "weight": 5000},
    ]

    bad = client.get(url, params={"format": "nginx"}, headers=serving)
    assert bad.status_code == 422 and "format" in bad.text
    assert client.get(url, params={"as": "xml"}, headers=serving).status_code == 422
