"""Whether a deployment's candidate pool is ready for a canary's traffic: every ``candidate``-pool
backend that declares a readiness URL answers it with a 2xx. A pool with no such backend cannot
be checked this way; its actuator says so instead (``POST .../canaries/{id}/ready``).

The HTTP check is a plain function (``Probe``) so that the canary evaluator can be handed another.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
from sqlalchemy.orm import Session

from controlplane.fleet.backends import POOL_CANDIDATE, list_backends

# GET a readiness URL: whether it answered 2xx, and a short note for the canary row.
Probe = Callable[[str], tuple[bool, str]]
PROBE_TIMEOUT_S = 2.0


def http_probe(url: str) -> tuple[bool, str]:
    """GET ``url``: (answered 2xx, what it answered)."""
    try:
        response = httpx.get(url, timeout=PROBE_TIMEOUT_S)
    except httpx.HTTPError as exc:
        return False, f"{type(exc).__name__}: {exc}"[:200]
    return 200 <= response.status_code < 300, f"HTTP {response.status_code}"


@dataclass(frozen=True, slots=True)
class PoolCheck:
    """``ready`` only when at least one backend was checked and every one answered 2xx."""

    ready: bool
    backends: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        return {"ready": self.ready, "backends": dict(self.backends)}


def check_candidate_pool(*, session: Session, deployment_id: int, probe: Probe | None = None) -> PoolCheck:
    """Probe every candidate-pool backend with a readiness URL (none: not ready by this check)."""
    probe = probe or http_probe
    backends = list_backends(session=session, deployment_id=deployment_id, pool=POOL_CANDIDATE)
    checked = {b.name: probe(b.readiness_url) for b in backends if b.readiness_url}
    return PoolCheck(
        ready=bool(checked) and all(ok for ok, _ in checked.values()),
        backends={name: note for name, (_, note) in checked.items()},
    )
