"""The REST API's contract, read from the app itself (no database): every route declares its reply
model, the OpenAPI document names a schema for every JSON reply, and every route under a
deployment's path gets that deployment from the one dependency that checks the key's role first."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Iterator
from pathlib import Path
from typing import get_args

import pytest
from fastapi import FastAPI
from fastapi.datastructures import DefaultPlaceholder
from fastapi.dependencies.models import Dependant
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute, iter_route_contexts
from pydantic import BaseModel

from controlplane.api.deps import (
    AdminDeployment,
    ReadableDeployment,
    ServingDeployment,
    WritableDeployment,
    get_session,
)
from controlplane.api.fleet import ready_caller
from controlplane.app import create_app
from controlplane.config import Settings

DEPLOYMENT_PATH = "/v1/accounts/{account}/deployments/{deployment}"

# Every route that sends no JSON, so declares no reply model: the dashboard's pages and assets
# (HTML, scripts, a redirect), Prometheus' text format, and the deletes' empty 204.
NON_JSON_ROUTES = {
    ("GET", "/metrics"),
    ("DELETE", "/v1/accounts/{account}/api-keys/{key_id}"),
    ("DELETE", DEPLOYMENT_PATH),
    ("DELETE", "/v1/accounts/{account}/models/{name}"),
    ("DELETE", f"{DEPLOYMENT_PATH}/scrape-targets/{{name}}"),
    ("DELETE", f"{DEPLOYMENT_PATH}/backends/{{backend}}"),
    # A gateway's own config file: YAML by default.
    ("GET", f"{DEPLOYMENT_PATH}/serving-config/export"),
    ("GET", "/dashboard"),
    ("GET", "/dashboard/"),
    ("GET", "/dashboard/login"),
    ("GET", "/dashboard/deployments/{deployment}"),
    ("GET", "/dashboard/deployments/{deployment}/canary"),
    ("GET", "/dashboard/jobs"),
    ("GET", "/dashboard/audit"),
    ("GET", "/dashboard/static/vendor/plotly.min.js"),
    ("GET", "/dashboard/static/{name}"),
}
# The ingest route resolves only the deployment's id, through a cache, with no dependency: it is
# by far the most requested route, and a dependency per request costs more than the lookup.
CACHED_DEPLOYMENT_ROUTES = {("POST", DEPLOYMENT_PATH + "/acceptance")}
# An actuator's callback may carry a webhook signature instead of a key: it resolves its deployment
# only after checking either (controlplane.api.fleet.ready_caller and ready_deployment).
SIGNED_CALLBACK_ROUTES = {("POST", DEPLOYMENT_PATH + "/canaries/{canary_id}/ready")}
DEPLOYMENT_DEPENDENCIES = {
    get_args(alias)[1].dependency
    for alias in (ReadableDeployment, WritableDeployment, AdminDeployment, ServingDeployment)
}


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> FastAPI:
    database = Path(tmp_path_factory.mktemp("contract")) / "unused.db"
    settings = Settings(
        database_url=f"sqlite:///{database}",
        environment="test",
        secret_key="contract-test-secret-not-for-production",
        drift_enqueue_on_ingest=False,
        api_gc_freeze=False,
    )
    return create_app(settings)


def api_routes(app: FastAPI) -> Iterator[tuple[str, str, APIRoute]]:
    """(method, full path, route) for every route the app serves, routers included."""
    for context in iter_route_contexts(app.routes):
        route = context.original_route
        if isinstance(route, APIRoute):
            for method in sorted(route.methods):
                yield method, str(context.path), route


def dependants(dependant: Dependant) -> Iterator[Dependant]:
    """Every dependency under ``dependant``, depth first."""
    for sub in dependant.dependencies:
        yield sub
        yield from dependants(sub)


def test_every_route_declares_its_reply(app: FastAPI) -> None:
    seen = set()
    for method, path, route in api_routes(app):
        seen.add((method, path))
        if (method, path) in NON_JSON_ROUTES:
            assert route.response_model is None, (method, path)
            response_class = route.response_class
            if isinstance(response_class, DefaultPlaceholder):
                response_class = response_class.value
            sends_json = issubclass(response_class, JSONResponse) and route.status_code != 204
            assert not sends_json, f"{method} {path} sends JSON: give it a response model"
            continue
        model = route.response_model
        named = isinstance(model, type) and (issubclass(model, BaseModel) or dataclasses.is_dataclass(model))
        assert named, f"{method} {path} declares no reply model (response_model is {model!r})"
    assert NON_JSON_ROUTES <= seen, f"exceptions for routes that no longer exist: {NON_JSON_ROUTES - seen}"


def test_every_json_reply_in_the_document_names_a_schema(app: FastAPI) -> None:
    document = app.openapi()
    schemas = document["components"]["schemas"]
    checked = 0
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            for code, response in operation["responses"].items():
                if not code.startswith("2"):
                    continue
                for media_type, content in response.get("content", {}).items():
                    if media_type != "application/json":
                        continue
                    if (method.upper(), path) in NON_JSON_ROUTES:
                        # A gateway's file sent as JSON on request (`as=json`): its schema is the
                        # gateway's, not ours.
                        continue
                    ref = content.get("schema", {}).get("$ref", "")
                    assert ref.startswith("#/components/schemas/"), (method, path, code, content)
                    name = ref.rsplit("/", 1)[1]
                    assert schemas[name].get("properties"), f"{method} {path} {code}: {name} has no fields"
                    checked += 1
    assert checked >= 40


def test_routes_under_a_deployment_resolve_it_through_the_deployment_dependency(app: FastAPI) -> None:
    resolved = 0
    for method, path, route in api_routes(app):
        if not path.startswith("/v1/") or "{deployment}" not in path:
            continue
        found = [d for d in dependants(route.dependant) if d.call in DEPLOYMENT_DEPENDENCIES]
        if (method, path) in CACHED_DEPLOYMENT_ROUTES:
            assert not found, f"{method} {path} should keep its cached lookup"
            continue
        if (method, path) in SIGNED_CALLBACK_ROUTES:
            assert ready_caller in {d.call for d in dependants(route.dependant)}, (method, path)
            continue
        assert len({d.call for d in found}) == 1, (
            f"{method} {path} resolves its deployment {found or 'itself'}"
        )
        # Through the request's session, the one the route commits (FastAPI resolves it once).
        for dependency in found:
            assert any(sub.call is get_session and sub.use_cache for sub in dependency.dependencies), path
        resolved += 1
    assert resolved >= 30


def test_no_route_looks_a_deployment_up_itself(app: FastAPI) -> None:
    for method, path, route in api_routes(app):
        source = inspect.getsource(route.endpoint)
        assert "get_deployment(" not in source, f"{method} {path}: take ReadableDeployment (or the like)"
