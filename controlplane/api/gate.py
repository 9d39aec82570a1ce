"""What every HTTP request passes before a route sees it: the caller's key (from the headers
alone), the key's request rate, and the size of the body, counted while it is read.

FastAPI parses a route's JSON body before it resolves any dependency, the key check included:
without this gate, anyone who can reach the port could make the API read and parse 64 MiB per
request without a key. The gate answers 401, 429 or 413 before a byte of the body is read, and
stops a body sent in chunks as soon as it crosses its route's limit.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass

from fastapi import HTTPException, Request, status
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from controlplane.api.deps import PRINCIPAL_SCOPE_KEY, get_principal
from controlplane.config import Settings
from controlplane.db.session import UNREACHABLE_DATABASE_ERRORS
from controlplane.fleet.payloads import HEADER_SIGNATURE
from controlplane.traces.formats import MAX_DATASET_BYTES

# The data-writing routes: records, Prometheus pushes, traces, datasets, and edges' windows of
# aggregates (account-wide). They take large bodies and are called far more often than the rest.
DEPLOYMENT_PATH = r"^/v1/accounts/[^/]+/deployments/[^/]+"
INGEST_ROUTE = re.compile(
    r"^/v1/accounts/[^/]+(?:/deployments/[^/]+/(acceptance|acceptance/prometheus|traces|datasets)|/aggregates)$"
)
# An actuator proves itself on this route by signing its body with the deployment's webhook
# secret instead of presenting a key (controlplane.api.fleet.ready_caller checks the signature).
SIGNED_READY_ROUTE = re.compile(DEPLOYMENT_PATH + r"/canaries/[^/]+/ready$")
SIGNATURE_HEADER = HEADER_SIGNATURE.lower()


def error_response(
    status_code: int,
    code: str,
    message: str,
    details: object = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    """The API's one error shape: ``{"error": {"code", "message"[, "details"]}}``."""
    error: dict[str, object] = {"code": code, "message": message}
    if details is not None:
        error["details"] = details
    return JSONResponse({"error": error}, status_code=status_code, headers=headers)


def database_unavailable_response() -> JSONResponse:
    """The database is restarting or refused a connection: the same request will succeed shortly
    (request ids make a retried batch idempotent), so a retrying client is told to back off."""
    return error_response(
        503,
        "DatabaseUnavailable",
        "the database is unavailable; retry shortly (a retried batch is stored once)",
        headers={"Retry-After": "1"},
    )


class BodyTooLargeError(HTTPException):
    """A body crossed its route's limit while it was being read (an HTTPException, so that
    FastAPI's body parsing lets it through instead of calling it a malformed body)."""

    def __init__(self, limit: int, setting: str) -> None:
        super().__init__(status.HTTP_413_CONTENT_TOO_LARGE, f"body exceeds the {limit}-byte limit")
        self.limit = limit
        self.setting = setting

    def response(self) -> JSONResponse:
        return error_response(
            self.status_code,
            "PayloadTooLargeError",
            f"body exceeds the {self.limit}-byte limit of this route ({self.setting})",
            {"limit": self.setting, "limit_bytes": self.limit},
        )


@dataclass(frozen=True, slots=True)
class BodyLimit:
    """A route's largest body and the limit's name, told to the caller (the setting that sets it;
    dataset files have a fixed limit, controlplane.traces.formats.MAX_DATASET_BYTES)."""

    max_bytes: int
    setting: str


def body_limit(settings: Settings, ingest_route: re.Match[str] | None) -> BodyLimit:
    """The largest body a route accepts: the ingest routes (``ingest_route``, INGEST_ROUTE's match
    of the path) their configured size, datasets theirs, every other route a small JSON body."""
    if ingest_route is None:
        return BodyLimit(settings.max_json_body_bytes, "max_json_body_bytes")
    if ingest_route.group(1) == "datasets":
        return BodyLimit(MAX_DATASET_BYTES, "max_dataset_bytes")
    return BodyLimit(settings.max_body_bytes, "max_body_bytes")


class TokenBucket:
    """``rate_per_s`` requests a second on average, ``burst`` at once."""

    __slots__ = ("burst", "rate_per_s", "tokens", "updated")

    def __init__(self, rate_per_s: float, burst: int, now: float) -> None:
        self.rate_per_s = rate_per_s
        self.burst = burst
        self.tokens = float(burst)
        self.updated = now

    def take(self, now: float) -> float:
        """0 when a request may go now (one token taken), else the seconds until it may."""
        self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate_per_s)
        self.updated = now
        if self.tokens >= 1:
            self.tokens -= 1
            return 0.0
        return (1 - self.tokens) / self.rate_per_s


class RateLimiter:
    """Per-key token buckets, one kind for ingest routes and one for every other route.

    The buckets live in this process: N API processes behind a balancer let a key through N
    times as fast. Each check is a dict lookup and a few float operations (about a microsecond).
    """

    # A bucket untouched this long is full again: forgetting it changes nothing.
    MAX_BUCKETS = 100_000

    def __init__(self, settings: Settings) -> None:
        self._limits = {
            "ingest": (settings.ingest_rate_per_s, settings.ingest_rate_burst),
            "admin": (settings.admin_rate_per_s, settings.admin_rate_burst),
        }
        self._buckets: dict[tuple[int, str], TokenBucket] = {}

    def wait_s(self, key_id: int, kind: str) -> float:
        """0 when the key may make a ``kind`` request now, else how long it should wait."""
        now = time.monotonic()
        bucket = self._buckets.get((key_id, kind))
        if bucket is None:
            if len(self._buckets) >= self.MAX_BUCKETS:
                self._forget_full(now)
            rate, burst = self._limits[kind]
            bucket = self._buckets[(key_id, kind)] = TokenBucket(rate, burst, now)
        return bucket.take(now)

    def refusal(self, kind: str, wait_s: float) -> JSONResponse:
        rate, burst = self._limits[kind]
        retry_after = max(1, math.ceil(wait_s))
        return error_response(
            status.HTTP_429_TOO_MANY_REQUESTS,
            "RateLimited",
            f"this key's {kind} requests exceed {rate:g}/s (burst {burst}; "
            f"settings {kind}_rate_per_s, {kind}_rate_burst): retry after {retry_after} s",
            {"limit": f"{kind}_rate_per_s", "rate_per_s": rate, "burst": burst},
            headers={"Retry-After": str(retry_after)},
        )

    def _forget_full(self, now: float) -> None:
        for key, bucket in list(self._buckets.items()):
            if bucket.tokens + (now - bucket.updated) * bucket.rate_per_s >= bucket.burst:
                del self._buckets[key]
        if len(self._buckets) >= self.MAX_BUCKETS:
            self._buckets.clear()


class RequestGate:
    """Pure ASGI middleware: key, rate, then body size, before the route reads anything.

    Every ``/v1/`` route needs a key (tests/integration/test_limits.py holds the API to that), so
    the gate authenticates those from the headers alone, through the same principal cache the
    routes use, and leaves the principal in the request scope for the route's own check. Other
    paths (health, /metrics, the dashboard pages, /docs) pass to their routes as before, under
    the small body limit.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._limiter: RateLimiter | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        settings: Settings = request.app.state.settings
        path: str = scope["path"]
        method: str = scope["method"]
        ingest_route = INGEST_ROUTE.match(path)
        signed = (
            path.endswith("/ready")
            and SIGNATURE_HEADER in request.headers
            and SIGNED_READY_ROUTE.match(path) is not None
        )
        if path.startswith("/v1/") and not signed:
            try:
                principal = await get_principal(request)
            except HTTPException as exc:
                await error_response(exc.status_code, "HTTPError", str(exc.detail), headers=exc.headers)(
                    scope, receive, send
                )
                return
            except UNREACHABLE_DATABASE_ERRORS:
                # A key not in the cache while the database restarts: outside FastAPI's handlers
                # here, so answer as they would (503, retry), not with a bare 500.
                await database_unavailable_response()(scope, receive, send)
                return
            scope[PRINCIPAL_SCOPE_KEY] = principal
            kind = "ingest" if ingest_route is not None and method == "POST" else "admin"
            limiter = self._limiter or self._make_limiter(settings)
            wait_s = limiter.wait_s(principal.key_id, kind)
            if wait_s > 0:
                await limiter.refusal(kind, wait_s)(scope, receive, send)
                return
        limit = body_limit(settings, ingest_route)
        declared = _declared_length(scope)
        if declared is not None and declared > limit.max_bytes:
            await BodyTooLargeError(limit.max_bytes, limit.setting).response()(scope, receive, send)
            return
        received = 0

        async def receive_limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit.max_bytes:
                    raise BodyTooLargeError(limit.max_bytes, limit.setting)
            return message

        started = False

        async def send_tracked(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive_limited, send_tracked)
        except BodyTooLargeError as exc:
            # Raised while a route read its body outside FastAPI's exception handlers.
            if started:
                raise
            await exc.response()(scope, receive, send)

    def _make_limiter(self, settings: Settings) -> RateLimiter:
        self._limiter = RateLimiter(settings)
        return self._limiter


def _declared_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            return int(value) if value.isdigit() else None
    return None
