"""Serving-config exports: LiteLLM router config and Gateway API HTTPRoute, from hand-built configs.

Field names checked against the upstream sources: LiteLLM docs.litellm.ai/docs/routing and
``litellm/router_strategy/simple_shuffle.py`` (``model_list[].model_name``, ``litellm_params``
with ``model``, ``api_base``, ``weight``; ``routing_strategy: simple-shuffle``), and the Gateway
API v1 HTTPRoute (``spec.parentRefs``, ``spec.rules[].backendRefs[]`` with ``name``, ``port``,
integer ``weight``).
"""

from __future__ import annotations

from typing import Any

import pytest

from controlplane.drafters.exports import (
    WEIGHT_TOTAL,
    ExportError,
    export,
    httproute,
    litellm_config,
    pool_of,
    service_of,
)


def canary_config(**changes: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "model": "chat",
        "config_version": "v7",
        "arms": [
            {"arm": "live", "weight": 0.8, "drafter_version": 3},
            {"arm": "canary:4", "weight": 0.1, "drafter_version": 4},
            {"arm": "baseline", "weight": 0.1, "drafter_version": None, "speculation": "disabled"},
        ],
        "backends": [
            {"name": "inc-a", "pool": "incumbent", "url": "http://engine-inc-a:8000", "drafter_version": 3},
            {
                "name": "inc-b",
                "pool": "incumbent",
                "url": "http://engine-inc-b.serving:8000/",
                "drafter_version": 3,
            },
            {"name": "cand", "pool": "candidate", "url": "http://engine-cand:8000/v1", "drafter_version": 4},
            {"name": "old-cand", "pool": "candidate", "url": "http://engine-old:8000", "drafter_version": 2},
            {"name": "base", "pool": "baseline", "url": "https://engine-base.serving.svc.cluster.local"},
        ],
    }
    config.update(changes)
    return config


def test_pools_of_arms() -> None:
    assert [pool_of(a) for a in ("live", "canary:12", "baseline")] == ["incumbent", "candidate", "baseline"]
    with pytest.raises(ExportError):
        pool_of("shadow")


def test_litellm_split_over_pools() -> None:
    out = litellm_config(canary_config())
    assert out["router_settings"] == {"routing_strategy": "simple-shuffle"}
    entries = out["model_list"]
    assert {e["model_name"] for e in entries} == {"chat"}
    by_id = {e["model_info"]["id"]: e["litellm_params"] for e in entries}
    # The candidate pool's backend on an older drafter gets nothing: it does not serve canary:4.
    assert set(by_id) == {"inc-a", "inc-b", "cand", "base"}
    assert {k: p["weight"] for k, p in by_id.items()} == {
        "inc-a": 4000,
        "inc-b": 4000,
        "cand": 1000,
        "base": 1000,
    }
    assert all(isinstance(p["weight"], int) for p in by_id.values())
    assert by_id["inc-b"]["api_base"] == "http://engine-inc-b.serving:8000/v1"
    assert by_id["cand"]["api_base"] == "http://engine-cand:8000/v1"
    assert by_id["cand"]["model"] == "openai/chat"
    assert by_id["cand"]["extra_headers"] == {"x-speculation-arm": "canary:4"}
    assert set(by_id["inc-a"]) == {"model", "api_base", "weight", "extra_headers"}


def test_httproute_backend_refs() -> None:
    route = httproute(canary_config(), namespace="serving", gateway="inference")
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1" and route["kind"] == "HTTPRoute"
    assert route["metadata"]["name"] == "chat-speculation" and route["metadata"]["namespace"] == "serving"
    assert route["spec"]["parentRefs"] == [{"name": "inference"}]
    (rule,) = route["spec"]["rules"]
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/v1"}}]
    assert rule["backendRefs"] == [
        {"name": "engine-inc-a", "port": 8000, "weight": 4000},
        {"name": "engine-inc-b", "port": 8000, "weight": 4000},  # same namespace as the route
        {"name": "engine-cand", "port": 8000, "weight": 1000},
        {"name": "engine-base", "port": 443, "weight": 1000},
    ]
    other_ns = httproute(canary_config())["spec"]["rules"][0]["backendRefs"]
    assert other_ns[1]["namespace"] == "serving"


def test_weights_are_integers_summing_to_the_total() -> None:
    config = canary_config(
        arms=[{"arm": "live", "weight": 1.0}],
        backends=[{"name": f"b{i}", "pool": "incumbent", "url": f"http://e{i}:80"} for i in range(3)],
    )
    weights = [e["litellm_params"]["weight"] for e in litellm_config(config)["model_list"]]
    assert weights == [3334, 3333, 3333] and sum(weights) == WEIGHT_TOTAL
    # Two backends behind one Service share one backendRef.
    same = canary_config(
        arms=[{"arm": "live", "weight": 1.0}],
        backends=[{"name": n, "pool": "incumbent", "url": "http://engine:8000"} for n in ("x", "y")],
    )
    assert httproute(same)["spec"]["rules"][0]["backendRefs"] == [
        {"name": "engine", "port": 8000, "weight": 10000}
    ]


def test_zero_weight_arms_need_no_backend() -> None:
    config = canary_config(
        arms=[{"arm": "live", "weight": 1.0}, {"arm": "canary:4", "weight": 0.0}],
        backends=[{"name": "a", "pool": "incumbent", "url": "http://engine:8000"}],
    )
    assert [e["model_info"]["id"] for e in litellm_config(config)["model_list"]] == ["a"]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"backends": [{"name": "c", "pool": "candidate", "url": "http://c"}]},
            "incumbent pool has no backend",
        ),
        ({"arms": []}, "no arms"),
        ({"arms": [{"arm": "live", "weight": 0.0}]}, "no arm has a positive weight"),
    ],
)
def test_unexportable_configs(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ExportError, match=message):
        litellm_config(canary_config(**changes))


def test_no_backends_registered_exports_no_destinations() -> None:
    assert litellm_config(canary_config(backends=[]))["model_list"] == []
    assert httproute(canary_config(backends=[]))["spec"]["rules"][0]["backendRefs"] == []


def test_service_of_urls() -> None:
    assert service_of("http://engine:8000") == ("engine", None, 8000)
    assert service_of("https://engine.ns.svc.cluster.local/v1") == ("engine", "ns", 443)
    assert service_of("http://engine.ns") == ("engine", "ns", 80)
    for bad in ("http://10.0.0.4:8000", "ftp://engine", "engine:8000"):
        with pytest.raises(ExportError):
            service_of(bad)


def test_export_dispatch() -> None:
    assert export(canary_config(), "httproute")["kind"] == "HTTPRoute"
    assert "model_list" in export(canary_config(), "litellm")
    with pytest.raises(ExportError, match="format must be one of"):
        export(canary_config(), "nginx")
