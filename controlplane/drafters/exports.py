"""Serving-config exports for gateways users already run: a LiteLLM router config and a Kubernetes
Gateway API ``HTTPRoute``.

Owns ``litellm_config`` and ``httproute`` (pure: dicts in, dicts out; the API renders them as YAML or
JSON) and ``ExportError``. The input is the dict ``controlplane.drafters.serving.serving_config``
returns, with its ``arms`` (name, weight, drafter_version) and ``backends``
(``[{"name", "pool", "url", "drafter_version", "readiness_url"}]``).

Traffic split: each arm's weight goes to its pool (``live`` → ``incumbent``, ``canary:<n>`` →
``candidate``, ``baseline`` → ``baseline``) and is split evenly over the pool's backends. A backend
that says which drafter version it serves and differs from its arm's is left out (a candidate pool
still running an older candidate must not get this canary's traffic). An arm with weight but no
backend to take it is an ``ExportError``: exporting it would send that share nowhere. Weights become
integers in basis points (the shares sum to exactly 10,000 by largest remainder), which both
LiteLLM's weighted ``simple-shuffle`` (it draws ``weight / sum(weights)``) and Gateway API
(``weight`` is an integer, 0 to 1,000,000, proportional) read as proportions. Backends that get no
traffic are left out of both exports. A config without any backend (none registered yet) exports
an empty ``model_list`` / ``backendRefs``.
Outside a canary, the standing no-speculation share of a fleet without a baseline pool goes to
the other arms (as the arm router sends it): the export still works, that share speculates.

LiteLLM (docs.litellm.ai/docs/routing, ``router_strategy/simple_shuffle.py``): one ``model_list``
entry per backend, all under the deployment's model name, ``litellm_params`` = ``model``
(``openai/<model>``: any OpenAI-compatible server), ``api_base`` (the backend URL ending in
``/v1``), ``weight``, and ``extra_headers`` with ``x-speculation-arm`` so a backend that serves
several arms (the reference server) serves the one the gateway picked; ``model_info.id`` is the
backend's name. ``router_settings.routing_strategy`` is ``simple-shuffle``.

HTTPRoute (``gateway.networking.k8s.io/v1``): one rule matching ``/v1`` whose ``backendRefs`` are
Services. A backend URL maps to a Service by its host and port: the host's first DNS label is the
Service name and its second, when the host has one (``svc.ns``, ``svc.ns.svc.cluster.local``), the
Service's namespace (a cross-namespace reference also needs a ReferenceGrant there); the port is
the URL's, else 80 for http and 443 for https. A URL whose host is an IP address cannot name a
Service and is an ``ExportError``. Backends that map to the same Service and port share one
``backendRef`` with their weights summed.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Sequence
from typing import Any, Final
from urllib.parse import urlsplit

from controlplane.ingest.record import ARM_BASELINE, ARM_CANARY_PREFIX, ARM_LIVE

POOL_INCUMBENT: Final = "incumbent"
POOL_CANDIDATE: Final = "candidate"
POOL_BASELINE: Final = "baseline"
WEIGHT_TOTAL: Final = 10_000
ARM_HEADER: Final = "x-speculation-arm"
FORMATS: Final = ("litellm", "httproute")


class ExportError(ValueError):
    """The serving config cannot be exported as asked (the message says why)."""


def pool_of(arm: str) -> str:
    """The backend pool that serves an arm."""
    if arm == ARM_LIVE:
        return POOL_INCUMBENT
    if arm == ARM_BASELINE:
        return POOL_BASELINE
    if arm.startswith(ARM_CANARY_PREFIX):
        return POOL_CANDIDATE
    raise ExportError(f"arm {arm!r} has no pool (expected live, canary:<n> or baseline)")


def _basis_points(shares: Sequence[float]) -> list[int]:
    """Non-negative shares as integers summing to WEIGHT_TOTAL (largest remainder, ties to the
    earlier entry, so the result is deterministic)."""
    total = sum(shares)
    if total <= 0:
        raise ExportError("no arm has a positive weight")
    exact = [share / total * WEIGHT_TOTAL for share in shares]
    out = [int(x) for x in exact]
    order = sorted(range(len(exact)), key=lambda i: (-(exact[i] - out[i]), i))
    for i in order[: WEIGHT_TOTAL - sum(out)]:
        out[i] += 1
    return out


def weighted_backends(config: Mapping[str, Any]) -> list[tuple[dict[str, Any], str, int]]:
    """(backend, arm, weight in basis points) for every backend that gets traffic, in arm order
    and then the listed backend order."""
    arms = config.get("arms") or []
    backends = config.get("backends") or []
    if not isinstance(arms, list) or not arms:
        raise ExportError("the serving config has no arms")
    if not isinstance(backends, list):
        raise ExportError("backends must be a list")
    if not backends:  # nothing registered yet: an export with no destinations, not an error
        return []
    rows: list[tuple[dict[str, Any], str, float]] = []
    canary_live = any(str(a.get("arm") or "").startswith(ARM_CANARY_PREFIX) for a in arms)
    for arm in arms:
        name = str(arm.get("arm") or ARM_LIVE)
        weight = float(arm.get("weight", 1.0))
        if weight <= 0:
            continue
        pool = pool_of(name)
        version = arm.get("drafter_version")
        members = [
            dict(b)
            for b in backends
            if b.get("pool") == pool
            and (version is None or b.get("drafter_version") is None or b.get("drafter_version") == version)
        ]
        if not members and name == ARM_BASELINE and not canary_live:
            # The standing no-speculation share needs a baseline pool; a fleet without one serves
            # that share with speculation (as the arm router does), rather than exporting nothing.
            continue
        if not members:
            raise ExportError(
                f"arm {name!r} has weight {weight:g} but the {pool} pool has no backend"
                + (f" serving drafter version {version}" if version is not None else "")
            )
        rows.extend((b, name, weight / len(members)) for b in members)
    points = _basis_points([share for _, _, share in rows])
    return [(b, arm, w) for (b, arm, _), w in zip(rows, points, strict=True) if w > 0]


def _api_base(url: str) -> str:
    base = url.rstrip("/")
    return base if base.endswith("/v1") else f"{base}/v1"


def litellm_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """A LiteLLM proxy/router config that splits the deployment's traffic as the serving config says."""
    model = str(config.get("model") or "")
    if not model:
        raise ExportError("the serving config has no model name")
    entries = [
        {
            "model_name": model,
            "litellm_params": {
                "model": f"openai/{model}",
                "api_base": _api_base(str(backend["url"])),
                "weight": weight,
                "extra_headers": {ARM_HEADER: arm},
            },
            "model_info": {"id": str(backend.get("name") or backend["url"])},
        }
        for backend, arm, weight in weighted_backends(config)
    ]
    return {"model_list": entries, "router_settings": {"routing_strategy": "simple-shuffle"}}


def service_of(url: str) -> tuple[str, str | None, int]:
    """(Service name, namespace or None, port) a backend URL names (see the module doc)."""
    parts = urlsplit(url)
    host = parts.hostname
    if not host or parts.scheme not in ("http", "https"):
        raise ExportError(f"backend url {url!r} is not an http(s) URL with a host")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        pass
    else:
        raise ExportError(f"backend url {url!r} names an IP address, not a Service")
    labels = host.split(".")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return labels[0], labels[1] if len(labels) > 1 else None, port


def httproute(
    config: Mapping[str, Any],
    *,
    name: str | None = None,
    namespace: str | None = None,
    gateway: str = "gateway",
) -> dict[str, Any]:
    """A Gateway API HTTPRoute whose backendRefs carry the serving config's split."""
    model = str(config.get("model") or "")
    route_name = name or f"{model or 'deployment'}-speculation"
    merged: dict[tuple[str, str | None, int], int] = {}
    for backend, _, weight in weighted_backends(config):
        key = service_of(str(backend["url"]))
        merged[key] = merged.get(key, 0) + weight
    refs: list[dict[str, Any]] = []
    for (service, ns, port), weight in merged.items():
        ref: dict[str, Any] = {"name": service, "port": port, "weight": weight}
        if ns is not None and ns != namespace:
            ref["namespace"] = ns
        refs.append(ref)
    metadata: dict[str, Any] = {"name": route_name}
    if namespace:
        metadata["namespace"] = namespace
    if config.get("config_version") is not None:
        metadata["annotations"] = {"speculation.config-version": str(config["config_version"])}
    return {
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "HTTPRoute",
        "metadata": metadata,
        "spec": {
            "parentRefs": [{"name": gateway}],
            "rules": [{"matches": [{"path": {"type": "PathPrefix", "value": "/v1"}}], "backendRefs": refs}],
        },
    }


def export(config: Mapping[str, Any], fmt: str, **options: Any) -> dict[str, Any]:
    """The export named by ``fmt`` (one of FORMATS)."""
    if fmt == "litellm":
        return litellm_config(config)
    if fmt == "httproute":
        return httproute(config, **options)
    raise ExportError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")
