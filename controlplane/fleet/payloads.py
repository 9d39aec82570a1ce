"""What an actuator is told, pure: the event payload, the engines' launch arguments, the webhook
signature, the per-deployment signing secret and the retry schedule.

Payload (one JSON object, the same for the webhook and the command actuator; a command reads it
on stdin)::

    {
      "event": "canary-start" | "promotion" | "rollback",
      "delivery_id": 42,
      "deployment": "accounts/acme/deployments/svc",
      "account": "acme",
      "canary_id": 7,                      # null for a rollback or promotion with no canary
      "drafter_version": 3,                # the version the event is about; null: the registered
                                           # drafter (or none) serves
      "artifact": {"uri": "s3://bucket/drafters/v3", "manifest_sha256": "ab12..."} | null,
      "k": 4,                              # draft tokens per step
      "drafter_kind": "draft_model" | "eagle3" | null,
      "vllm_speculative_config": {"method": "draft_model", "model": "/srv/drafters/v3",
                                  "num_speculative_tokens": 4} | null,
      "sglang_args": ["--speculative-algorithm", "STANDALONE",
                      "--speculative-draft-model-path", "/srv/drafters/v3",
                      "--speculative-num-steps", "4", "--speculative-eagle-topk", "1",
                      "--speculative-num-draft-tokens", "5"] | null,
      "sglang_draft_config": null | "config.sglang.json",
      "ready_callback_url": "https://cp/v1/accounts/acme/deployments/svc/canaries/7/ready" | null,
      "created_at": "2026-12-02T01:00:00+00:00"
    }

``canary-start``: the shadow replay passed; the candidate pool should load the candidate and then
say so (its readiness URL answers 2xx, or it calls ``ready_callback_url``). ``promotion``: the
incumbent pool should serve ``drafter_version``. ``rollback``: it should serve what the payload
names again (the previous version, or the registered drafter when ``drafter_version`` is null).

The model is named by location and manifest digest, as in the serving config: a fleet verifies
the artifact's MANIFEST.json against ``artifact.manifest_sha256`` before loading it. A ``file://``
artifact is given to the engines as its local path; any other URI is passed as it is (the fleet
fetches it). vLLM takes ``vllm_speculative_config`` as ``--speculative-config '<json>'``; SGLang's
STANDALONE (small draft model) speculation drafts a chain of ``k`` tokens with top-k 1, so it
verifies ``k + 1`` tokens per step.

An ``eagle3`` drafter is a head over the target's states (its artifact is the folder vLLM's
``speculators`` format describes): vLLM takes ``{"method": "eagle3", ...}`` on the folder as it is;
SGLang (``--speculative-algorithm EAGLE3``) reads no speculators config, so the fleet serves it a copy
of the folder whose config.json is the artifact's ``sglang_draft_config`` file.

Webhook signature: ``X-Specctl-Signature: sha256=<hex HMAC-SHA256(secret, "<timestamp>.<body>")>``
with ``X-Specctl-Timestamp`` the Unix time in seconds the request was signed at; a receiver
refuses a timestamp too far from its clock (a replayed request).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from datetime import timedelta
from typing import Any
from urllib.parse import unquote, urlparse

EVENT_CANARY_START = "canary-start"
EVENT_PROMOTION = "promotion"
EVENT_ROLLBACK = "rollback"
EVENTS = (EVENT_CANARY_START, EVENT_PROMOTION, EVENT_ROLLBACK)

HEADER_EVENT = "X-Specctl-Event"
HEADER_DELIVERY = "X-Specctl-Delivery"
HEADER_TIMESTAMP = "X-Specctl-Timestamp"
HEADER_SIGNATURE = "X-Specctl-Signature"
SIGNATURE_PREFIX = "sha256="
# How far a signed request's timestamp may be from the verifier's clock.
SIGNATURE_TOLERANCE_S = 300

# Retries: 10 s, 20 s, 40 s ... capped at 15 min; the eighth failed attempt gives up (about
# 21 minutes after the first), which outlasts a restart of a receiver but not a forgotten one.
BACKOFF_BASE_S = 10.0
BACKOFF_MAX_S = 900.0
MAX_ATTEMPTS = 8


def backoff(attempts: int) -> timedelta | None:
    """How long after failed attempt number ``attempts`` (1 = the first) the next one is due;
    None once ``MAX_ATTEMPTS`` have failed (the delivery has failed for good).

    >>> [backoff(n).total_seconds() for n in (1, 2, 3)]
    [10.0, 20.0, 40.0]
    >>> backoff(MAX_ATTEMPTS) is None
    True
    """
    if attempts >= MAX_ATTEMPTS:
        return None
    return timedelta(seconds=min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2 ** max(0, attempts - 1)))


def derive_secret(secret_key: str, deployment_id: int, nonce: str) -> str:
    """A deployment's webhook signing secret, derived from the service's secret key and a nonce
    stored with the actuator: the database alone never holds it, and a new nonce rotates it."""
    digest = hmac.new(
        secret_key.encode(), f"specctl-actuator:{deployment_id}:{nonce}".encode(), hashlib.sha256
    ).hexdigest()
    return f"whsec_{digest}"


def sign(secret: str, timestamp: int, body: bytes) -> str:
    """The ``X-Specctl-Signature`` value for ``body`` signed at ``timestamp``.

    >>> sign("s", 1, b"{}")
    'sha256=b253639bcd705ed1cda3073f66104f16988bd40272584dea7d0d345ae93e61cc'
    """
    mac = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256)
    return SIGNATURE_PREFIX + mac.hexdigest()


def verify(
    secret: str,
    timestamp: str | None,
    body: bytes,
    signature: str | None,
    *,
    now: float | None = None,
    tolerance_s: float = SIGNATURE_TOLERANCE_S,
) -> bool:
    """Whether ``signature`` signs ``body`` at ``timestamp`` with ``secret``, and the timestamp
    is within ``tolerance_s`` of ``now`` (compared in constant time)."""
    if not timestamp or not signature or not timestamp.isdigit():
        return False
    if abs((time.time() if now is None else now) - int(timestamp)) > tolerance_s:
        return False
    return hmac.compare_digest(sign(secret, int(timestamp), body), signature.strip())


def signed_headers(
    secret: str, event: str, delivery_id: int, body: bytes, *, now: float | None = None
) -> dict[str, str]:
    """The headers of a webhook POST of ``body``."""
    timestamp = int(time.time() if now is None else now)
    return {
        "Content-Type": "application/json",
        HEADER_EVENT: event,
        HEADER_DELIVERY: str(delivery_id),
        HEADER_TIMESTAMP: str(timestamp),
        HEADER_SIGNATURE: sign(secret, timestamp, body),
    }


def encode(payload: dict[str, Any]) -> bytes:
    """The exact bytes sent (and signed): compact, keys sorted."""
    return json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()


def engine_model_path(uri: str) -> str:
    """What an engine is told to load: a local path for a ``file://`` URI, else the URI.

    >>> engine_model_path("file:///srv/drafters/v3"), engine_model_path("s3://b/v3")
    ('/srv/drafters/v3', 's3://b/v3')
    """
    parsed = urlparse(uri)
    if parsed.scheme == "file":
        return unquote(parsed.path)
    return uri


DRAFT_MODEL = "draft_model"
EAGLE3 = "eagle3"
# The file of an eagle3 artifact that SGLang reads as the draft folder's config.json.
SGLANG_HEAD_CONFIG = "config.sglang.json"


def vllm_speculative_config(model: str, k: int, kind: str = DRAFT_MODEL) -> dict[str, Any]:
    """vLLM's ``--speculative-config`` for a drafter of ``kind`` speculating ``k`` tokens per step."""
    method = EAGLE3 if kind == EAGLE3 else "draft_model"
    return {"method": method, "model": model, "num_speculative_tokens": k}


def sglang_args(model: str, k: int, kind: str = DRAFT_MODEL) -> list[str]:
    """SGLang's server arguments for a drafter of ``kind`` (a small model is STANDALONE, a head
    EAGLE3) drafting a chain of ``k``."""
    return [
        "--speculative-algorithm",
        "EAGLE3" if kind == EAGLE3 else "STANDALONE",
        "--speculative-draft-model-path",
        model,
        "--speculative-num-steps",
        str(k),
        "--speculative-eagle-topk",
        "1",
        "--speculative-num-draft-tokens",
        str(k + 1),
    ]


def build_payload(
    *,
    event: str,
    delivery_id: int,
    deployment: str,
    account: str,
    canary_id: int | None,
    drafter_version: int | None,
    artifact_uri: str | None,
    manifest_sha256: str | None,
    k: int,
    ready_callback_url: str | None,
    created_at: str,
    drafter_kind: str | None = None,
) -> dict[str, Any]:
    """The payload of one event (the module docstring shows its shape)."""
    if event not in EVENTS:
        raise ValueError(f"unknown actuator event {event!r}")
    model = engine_model_path(artifact_uri) if artifact_uri else None
    kind = drafter_kind or DRAFT_MODEL
    return {
        "event": event,
        "delivery_id": delivery_id,
        "deployment": deployment,
        "account": account,
        "canary_id": canary_id,
        "drafter_version": drafter_version,
        "artifact": {"uri": artifact_uri, "manifest_sha256": manifest_sha256} if artifact_uri else None,
        "k": k,
        "drafter_kind": (drafter_kind or DRAFT_MODEL) if model else None,
        "vllm_speculative_config": vllm_speculative_config(model, k, kind) if model else None,
        "sglang_args": sglang_args(model, k, kind) if model else None,
        "sglang_draft_config": SGLANG_HEAD_CONFIG if model and kind == EAGLE3 else None,
        "ready_callback_url": ready_callback_url,
        "created_at": created_at,
    }
