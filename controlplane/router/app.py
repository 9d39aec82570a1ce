"""The router's ASGI app: ``POST /v1/completions`` and ``POST /v1/chat/completions`` proxied to the
backend pools of the arm each request is assigned, streamed or whole; ``GET /v1/models``,
``GET /healthz`` (backends and their breakers) and ``GET /metrics`` (Prometheus).

Per request: read the body once; the deployment is its ``model``; the arm comes from the followed
serving config and the client's key (``controlplane.router.arms``); the backends to try, in order,
from ``controlplane.router.pools``. A streamed reply is passed through chunk by chunk as the backend
sends it (``SseScanner`` reads the metrics on the way); a whole reply is returned as the backend
sent it. The acceptance record and the sampled trace are built after the reply has left (in the
request's own task), so the client never waits on them; they go to the ``ControlPlaneReporter``.
With aggregate windows on, every record is counted in the current window there (about 10 µs of
arithmetic at k = 4, 30 at k = 16, done inline: a hand-off to a thread costs more, and a thread
summing under the GIL would hold the event loop up longer), and only the sampled share (a hash of
the request id against the deployment's ``raw_record_sample_rate``, so every process and retry
agrees) is also sent as a raw record, marked ``counted_in_aggregate``.

The router adds ``x-request-id`` and ``x-speculation-arm`` (the arm that served) to replies, tells a
``follower`` backend which arm to serve with the same header, and strips the non-standard
``category`` and ``document`` fields before forwarding (some engines refuse unknown fields); the
trace carries both (``document``: the source document the prompt was cut from, which held-out
evaluation keeps apart from training; a malformed one is the client's 400, as the control plane
would refuse the whole trace batch for it). Client errors (4xx) from a backend are the client's to
see and are never retried.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import re
import secrets
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from controlplane.config import get_settings
from controlplane.ingest.record import ARM_BASELINE, ARM_CANARY_PREFIX
from controlplane.router.acceptance import (
    SseScanner,
    UnreadableReply,
    acceptance_of,
    completion_text,
    native,
    prompt_text,
    trace_messages,
)
from controlplane.router.arms import client_key, pick_arm, unit_hash
from controlplane.router.config import (
    DEPLOYMENT_NAME,
    MAX_EDGE_ID_BASE,
    WILDCARD,
    DeploymentRoutes,
    RouterConfig,
    RouterConfigError,
    load_config,
)
from controlplane.router.follower import DEFAULT, FollowedConfig, ServingConfigFollower
from controlplane.router.pools import Attempt, BackendState, CircuitBreakers, Pools
from controlplane.router.reporter import ControlPlaneReporter
from controlplane.router.spool import DiskSpool
from controlplane.traces.formats import MAX_DOCUMENT_CHARS

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

PROXY_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
ARM_HEADER = "x-speculation-arm"
VERSION_HEADER = "x-drafter-version"


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "router_requests",
            "Requests answered, by deployment, arm served and outcome",
            ["deployment", "arm", "outcome"],
            registry=self.registry,
        )
        self.failovers = Counter(
            "router_failovers",
            "Backend attempts that failed before the first byte",
            ["deployment", "backend"],
            registry=self.registry,
        )
        self.unreadable = Counter(
            "router_unreadable_replies",
            "Replies whose acceptance metrics the adapters refused",
            ["deployment"],
            registry=self.registry,
        )
        self.spool_bytes = Gauge("router_spool_bytes", "Bytes waiting in the spool", registry=self.registry)
        self.spool_dropped = Gauge(
            "router_spool_dropped_items", "Items dropped because the spool was full", registry=self.registry
        )
        self.spool_dropped_windows = Gauge(
            "router_spool_dropped_windows",
            "Aggregate windows dropped because the spool was full",
            registry=self.registry,
        )
        self.posted = Gauge(
            "router_reported_items",
            "Items the control plane took (for aggregates: window bodies)",
            ["kind"],
            registry=self.registry,
        )


@dataclass
class DeploymentState:
    routes: DeploymentRoutes
    pools: Pools = field(default_factory=Pools)
    followed: FollowedConfig = DEFAULT

    def apply(self, followed: FollowedConfig) -> None:
        """A new serving config: its arms, and the backends it declares merged with the file's."""
        self.followed = followed
        declared: dict[str, tuple[str, str, str, int | None]] = {
            b.name: (b.name, b.pool, b.url, b.drafter_version) for b in self.routes.backends
        }
        for backend in followed.backends:
            declared.setdefault(backend[0], backend)
        self.pools.update(declared.values())


class Router:
    def __init__(self, config: RouterConfig, api_key: str | None = None) -> None:
        self.config = config
        settings = config.router
        self.deployments = {d.name: DeploymentState(d) for d in config.deployments if d.name != WILDCARD}
        self.wildcard = next((d for d in config.deployments if d.name == WILDCARD), None)
        # Models a wildcard lookup found unknown, and when to ask the control plane again.
        self._unknown: dict[str, float] = {}
        for state in self.deployments.values():
            state.apply(DEFAULT)
        self.breakers = CircuitBreakers(settings.breaker_failures, settings.breaker_cooldown_s)
        self.metrics = RouterMetrics()
        link = config.control_plane
        self.reporter = ControlPlaneReporter(
            base_url=link.url,
            account=link.account,
            api_key=api_key,
            spool=DiskSpool(settings.spool_dir, int(settings.spool_max_mb * 1024 * 1024)),
            interval_s=settings.report_interval_s,
            batch=settings.report_batch,
            timeout_s=link.timeout_s,
            window_s=settings.aggregate_window_s,
            edge_id=process_edge_id(settings.edge_id),
            max_window_bytes=int(settings.aggregate_max_body_mb * 1024 * 1024),
        )
        self.follower = ServingConfigFollower(
            base_url=link.url,
            account=link.account,
            api_key=api_key,
            deployments=list(self.deployments),  # wildcard ones join as requests name them
            interval_s=link.poll_interval_s,
            timeout_s=link.timeout_s,
            on_change=self._apply,
        )
        self._timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=settings.connect_timeout_s, sock_read=settings.first_byte_timeout_s
        )
        self._session: aiohttp.ClientSession | None = None

    def _apply(self, name: str, followed: FollowedConfig) -> None:
        state = self.deployments.get(name)
        if state is None and self.wildcard is not None:
            state = self.deployments[name] = DeploymentState(self.wildcard.model_copy(update={"name": name}))
        if state is not None:
            state.apply(followed)

    async def _state(self, model: object) -> DeploymentState | None:
        """The deployment a request names; under a wildcard, one the control plane confirms."""
        if not isinstance(model, str):
            return None
        state = self.deployments.get(model)
        if state is not None or self.wildcard is None or not DEPLOYMENT_NAME.match(model):
            return state
        if self._unknown.get(model, 0.0) > time.monotonic():
            return None
        status = await self.follower.follow(model)
        if status != 200:
            self._unknown[model] = time.monotonic() + (5.0 if status == 404 else 1.0)
            if len(self._unknown) > 10_000:
                self._unknown.clear()
            return None
        return self.deployments.get(model)

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
        self._session = aiohttp.ClientSession(
            connector=connector, timeout=self._timeout, auto_decompress=False
        )
        await self.reporter.start()
        await self.follower.start()
        # What exists now lives as long as the router: keep it out of every collection, and
        # collect the young generation less often, so pauses stay out of the latency tail.
        gc.collect()
        gc.freeze()
        gc.set_threshold(50_000, 20, 20)

    async def close(self) -> None:
        await self.follower.close()
        await self.reporter.close()
        if self._session is not None:
            await self._session.close()

    # ------------------------------------------------------------------------------- the proxy
    async def proxy(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"]
        raw = await _body(receive)
        headers = _headers(scope)
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            return await _error(send, 400, f"request body is not JSON: {exc}", "invalid_request_error")
        if not isinstance(body, dict):
            return await _error(send, 400, "request body must be a JSON object", "invalid_request_error")
        model = body.get("model")
        state = await self._state(model)
        if state is None:
            known = ", ".join(sorted(self.deployments))
            return await _error(
                send,
                404,
                f"model {model!r} is not served here (served: {known})",
                "invalid_request_error",
                "model",
                "model_not_found",
            )
        request_id = headers.get("x-request-id") or f"rt-{uuid.uuid4().hex}"
        followed = state.followed
        arm = pick_arm(
            followed.arms, client_key(body, headers, self.config.router.client_key_header, request_id)
        )
        category = (
            body.get("category")
            if isinstance(body.get("category"), str)
            else headers.get("x-traffic-category")
        )
        document = body.get("document") if "document" in body else headers.get("x-traffic-document")
        if (problem := document_problem(document)) is not None:
            return await _error(send, 400, f"document: {problem}", "invalid_request_error", "document")
        payload = _forwarded_body(raw, body, state.routes.backend_model)
        now = time.monotonic()
        attempts = state.pools.attempts(
            arm.name, arm.drafter_version, [(a.name, a.drafter_version) for a in followed.arms], now
        )
        if not attempts:
            return await _error(
                send, 503, f"deployment {model!r} has no backends declared", "service_unavailable"
            )
        forwarded = _forwarded_headers(headers, request_id)
        sampled = (
            followed.trace_sample_rate > 0.0 and unit_hash(f"trace:{request_id}") < followed.trace_sample_rate
        )
        raw_rate = (
            followed.raw_record_sample_rate
            if followed.raw_record_sample_rate is not None
            else state.routes.raw_record_sample_rate
        )
        raw_record = (
            self.reporter.windows is None
            or raw_rate >= 1.0
            or (raw_rate > 0.0 and unit_hash(f"raw:{request_id}") < raw_rate)
        )
        call = ServedCall(
            state.routes.name,
            request_id,
            category,
            body if sampled else None,
            time.perf_counter(),
            raw_record,
            followed.draft_positions,
            document,
        )
        await self._forward(send, path, payload, forwarded, attempts, call, stream=body.get("stream") is True)

    async def _forward(
        self,
        send: Send,
        path: str,
        payload: bytes,
        headers: dict[str, str],
        attempts: list[Attempt],
        call: ServedCall,
        *,
        stream: bool,
    ) -> None:
        """Try the backends in order until one answers below 500 before its first byte (a whole
        reply: before its last byte, since nothing has reached the client yet); relay a stream,
        send a whole reply. With every backend failed, the client sees the last one's own error."""
        assert self._session is not None
        last: tuple[int, bytes, str | None] | None = None
        for attempt in attempts:
            backend = attempt.backend
            self.breakers.started(backend, time.monotonic())
            try:
                resp = await self._session.post(
                    backend.url + path, data=payload, headers=_to(backend, attempt, headers)
                )
                relayed = stream and resp.status < 400
                data = b"" if relayed else await resp.read()
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                self._failed(call.deployment, backend, exc)
                continue
            except asyncio.CancelledError:
                self.breakers.released(backend)
                raise
            media_type = resp.headers.get("Content-Type")
            if resp.status >= 500:
                resp.release()
                self._failed(call.deployment, backend, f"HTTP {resp.status}")
                last = (resp.status, data, media_type)
                continue
            arm, version = served_as(attempt, resp.headers)
            self.metrics.requests.labels(call.deployment, arm, str(resp.status)).inc()
            if relayed:
                await self._relay(send, resp, media_type or "text/event-stream", backend, call, arm, version)
                return
            resp.release()
            self.breakers.succeeded(backend)
            total_ms = (time.perf_counter() - call.started) * 1000.0
            await _respond(send, resp.status, data, media_type, call.request_id, arm)
            if resp.status < 400:  # after the reply has left: the client never waits on its record
                self._report_whole(call, data, arm, version, total_ms)
            return
        self.metrics.requests.labels(call.deployment, "none", "failed").inc()
        if last is not None:
            await _respond(send, last[0], last[1], last[2], call.request_id, None)
        else:
            await _error(send, 502, "no backend could serve this request", "service_unavailable")

    async def _relay(
        self,
        send: Send,
        resp: aiohttp.ClientResponse,
        media_type: str,
        backend: BackendState,
        call: ServedCall,
        arm: str,
        version: int | None,
    ) -> None:
        """Pass the stream on chunk by chunk as the backend sends it; read its metrics on the way."""
        scanner = SseScanner(keep_text=call.body is not None)
        first: float | None = None
        outcome = "released"
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": resp.status,
                    "headers": _reply_headers(media_type, call.request_id, arm, stream=True),
                }
            )
            read = resp.content.readany
            while chunk := await read():
                if first is None:
                    first = time.perf_counter()
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                scanner.feed(chunk)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            scanner.close()
            outcome = "done"
        except (aiohttp.ClientError, TimeoutError) as exc:
            outcome = "failed"  # the backend broke off mid-stream: too late to serve elsewhere
            self._failed(call.deployment, backend, exc, counted=False)
        except OSError:
            pass  # the client went away: says nothing about the backend
        finally:
            resp.release()
            if outcome == "done":
                self.breakers.succeeded(backend)
            elif outcome == "released":
                self.breakers.released(backend)
        if outcome == "done":
            total_ms = (time.perf_counter() - call.started) * 1000.0
            ttft_ms = (first - call.started) * 1000.0 if first is not None else None
            self._report(
                call,
                scanner.reply,
                arm,
                version,
                ttft_ms,
                total_ms,
                scanner.content_events,
                "".join(scanner.text),
            )

    def _failed(self, deployment: str, backend: BackendState, why: object, *, counted: bool = True) -> None:
        self.breakers.failed(backend, time.monotonic())
        if counted:
            self.metrics.failovers.labels(deployment, backend.name).inc()
        log.warning("backend %s of %s failed: %s", backend.name, deployment, why)

    # ------------------------------------------------------------------------------- reporting
    def _report_whole(
        self, call: ServedCall, data: bytes, arm: str, version: int | None, total_ms: float
    ) -> None:
        """Parse a whole reply and file its record (on the event loop, in the request's own task
        once the reply has left: a thread hand-off per request would cost more than the parsing)."""
        try:
            reply = orjson.loads(data)
        except orjson.JSONDecodeError:
            self.metrics.unreadable.labels(call.deployment).inc()
            return
        if isinstance(reply, dict):
            self._report(call, reply, arm, version, None, total_ms, 0, completion_text(reply))

    def _report(
        self,
        call: ServedCall,
        reply: Mapping[str, Any],
        arm: str,
        version: int | None,
        ttft_ms: float | None,
        total_ms: float,
        content_events: int,
        text: str,
    ) -> None:
        try:
            record = acceptance_of(
                reply,
                request_id=call.request_id,
                arm=arm,
                drafter_version=version,
                category=call.category,
                ttft_ms=ttft_ms,
                total_ms=total_ms,
                content_events=content_events,
            )
        except UnreadableReply as exc:
            self.metrics.unreadable.labels(call.deployment).inc()
            log.warning("reply %s of %s: acceptance unreadable: %s", call.request_id, call.deployment, exc)
            return
        if self.reporter.windows is None:
            self.reporter.record(call.deployment, native(record))
        else:
            self.reporter.aggregate(call.deployment, record, call.draft_positions)
            if call.raw_record:
                raw = native(record)
                raw["counted_in_aggregate"] = True  # stored for detail, never counted twice
                self.reporter.record(call.deployment, raw)
            else:
                self.reporter.stats.records_not_sampled += 1
        if call.body is not None:
            prompt = prompt_text(call.body)
            if prompt is not None and text:
                self.reporter.trace(
                    call.deployment, prompt, text, call.category, call.document, trace_messages(call.body)
                )

    # ------------------------------------------------------------------------------- the rest
    async def models(self, send: Send) -> None:
        created = int(time.time())
        data = [
            {"id": name, "object": "model", "created": created, "owned_by": "specctl"}
            for name in sorted(self.deployments)
        ]
        await _json(send, 200, {"object": "list", "data": data})

    async def health(self, send: Send) -> None:
        now = time.monotonic()
        deployments = {
            name: {
                "config_version": state.followed.version,
                "arms": [
                    {"arm": a.name, "weight": a.weight, "drafter_version": a.drafter_version}
                    for a in state.followed.arms
                ],
                "backends": [
                    {
                        "name": b.name,
                        "pool": b.pool,
                        "url": b.url,
                        "drafter_version": b.drafter_version,
                        "open": not b.available(now),
                        "in_flight": b.in_flight,
                        "served": b.served,
                        "failed": b.failed,
                    }
                    for b in state.pools.backends
                ],
            }
            for name, state in self.deployments.items()
        }
        stats = self.reporter.stats
        windows = self.reporter.windows
        await _json(
            send,
            200,
            {
                "status": "ok",
                "deployments": deployments,
                "reporter": {
                    "buffered": self.reporter.buffered,
                    "posted": stats.posted,
                    "spooled": stats.spooled,
                    "rejected": stats.rejected,
                    "spool_bytes": self.reporter.spool.bytes,
                    "spool_dropped_items": self.reporter.spool.dropped_items,
                    "last_error": stats.last_error,
                    "windows": {
                        "window_s": windows.window_s if windows is not None else 0,
                        "edge_id": self.reporter.edge_id if windows is not None else None,
                        "requests_in_current": windows.requests if windows is not None else 0,
                        "sealed": stats.windows_sealed,
                        "posted": stats.posted["aggregates"],
                        "duplicates": stats.windows_duplicate,
                        "rejected": stats.windows_rejected,
                        "aggregates_rejected": stats.aggregates_rejected,
                        "spool_dropped": self.reporter.spool.dropped_windows,
                        "records_not_sampled": stats.records_not_sampled,
                    },
                },
                "serving_config": {
                    "polls": self.follower.polls,
                    "changes": self.follower.changes,
                    "last_error": self.follower.last_error,
                },
            },
        )

    async def prometheus(self, send: Send) -> None:
        self.metrics.spool_bytes.set(self.reporter.spool.bytes)
        self.metrics.spool_dropped.set(self.reporter.spool.dropped_items)
        self.metrics.spool_dropped_windows.set(self.reporter.spool.dropped_windows)
        for kind, count in self.reporter.stats.posted.items():
            self.metrics.posted.labels(kind).set(count)
        await _respond(
            send, 200, generate_latest(self.metrics.registry), "text/plain; version=0.0.4", None, None
        )

    # ------------------------------------------------------------------------------ the ASGI app
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A plain ASGI app: five routes do not need a framework, and on a proxy that must add
        under 2 ms at p99 every layer between the socket and the backend counts."""
        if scope["type"] == "lifespan":
            return await self._lifespan(receive, send)
        if scope["type"] != "http":
            return
        method, path = scope["method"], scope["path"]
        try:
            if path in PROXY_PATHS:
                if method != "POST":
                    return await _error(send, 405, f"{path} takes POST", "invalid_request_error")
                return await self.proxy(scope, receive, send)
            route = {"/v1/models": self.models, "/healthz": self.health, "/metrics": self.prometheus}.get(
                path
            )
            if route is None:
                return await _error(send, 404, f"no route {path}", "invalid_request_error")
            if method != "GET":
                return await _error(send, 405, f"{path} takes GET", "invalid_request_error")
            await route(send)
        except Exception:  # noqa: BLE001 - one bad request must never take the router down
            log.exception("request %s %s failed", method, path)
            with contextlib.suppress(Exception):  # the reply may have started already
                await _error(send, 500, "the router failed on this request", "server_error")

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.start()
                except Exception as exc:  # noqa: BLE001 - reported to the server, which stops
                    await send({"type": "lifespan.startup.failed", "message": repr(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.close()
                await send({"type": "lifespan.shutdown.complete"})
                return


@dataclass(frozen=True, slots=True)
class ServedCall:
    """One proxied request, as the reporter needs it once the reply has left."""

    deployment: str
    request_id: str
    category: str | None
    body: dict[str, Any] | None  # kept only when the trace is sampled
    started: float
    raw_record: bool  # sent as a raw record too (always, without aggregate windows)
    draft_positions: int | None  # the most draft positions the deployment's arms draft
    document: str | None = None  # the source document the client named, for the trace


def document_problem(document: Any) -> str | None:
    """Why a request's ``document`` cannot be traced (None: absent, or a usable label).

    >>> document_problem(None), document_problem("structured:doc-1"), document_problem(7)
    (None, None, 'must be a string or null, got int')
    """
    if document is None:
        return None
    if not isinstance(document, str):
        return f"must be a string or null, got {type(document).__name__}"
    if not document.strip() or len(document) > MAX_DOCUMENT_CHARS or "\x00" in document:
        return f"must be 1 to {MAX_DOCUMENT_CHARS} characters, not only space, without NUL"
    return None


# Fields only the router and the reference server read: an engine may refuse unknown ones.
_ROUTER_ONLY_FIELDS = frozenset({"category", "document"})


def _forwarded_body(raw: bytes, body: dict[str, Any], backend_model: str | None) -> bytes:
    """The body as the backend gets it: the engine's own model name, no ``category`` or ``document``."""
    if _ROUTER_ONLY_FIELDS.isdisjoint(body) and (backend_model is None or backend_model == body.get("model")):
        return raw
    out = {k: v for k, v in body.items() if k not in _ROUTER_ONLY_FIELDS}
    if backend_model is not None:
        out["model"] = backend_model
    return orjson.dumps(out)


def _forwarded_headers(headers: Mapping[str, str], request_id: str) -> dict[str, str]:
    out = {"Content-Type": "application/json", "x-request-id": request_id}
    auth = headers.get("authorization")
    if auth:
        out["Authorization"] = auth
    return out


def _to(backend: BackendState, attempt: Attempt, headers: dict[str, str]) -> dict[str, str]:
    if backend.pool == "follower":
        return {**headers, ARM_HEADER: attempt.arm}
    return headers


def served_as(attempt: Attempt, headers: Mapping[str, str]) -> tuple[str, int | None]:
    """The arm and drafter version a reply is filed under: what a follower says it served (its
    own config may lag or lead the router's by a poll), else the arm of the pool that served and
    the version its backend is labelled with."""
    arm = attempt.arm
    if attempt.backend.pool == "follower":
        stated = headers.get(ARM_HEADER)
        version_text = headers.get(VERSION_HEADER)
        version = int(version_text) if version_text and version_text.isdigit() else None
        if stated:
            return stated, version
        return arm, version
    if arm.startswith(ARM_CANARY_PREFIX):
        return arm, int(arm.removeprefix(ARM_CANARY_PREFIX))
    if arm == ARM_BASELINE:
        return arm, None
    return arm, attempt.backend.drafter_version


async def _body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


def _headers(scope: Scope) -> dict[str, str]:
    return {name.decode("latin-1"): value.decode("latin-1") for name, value in scope["headers"]}


def _reply_headers(
    media_type: str | None, request_id: str | None, arm: str | None, *, stream: bool = False
) -> list[tuple[bytes, bytes]]:
    out = [(b"content-type", (media_type or "application/json").encode("latin-1"))]
    if request_id is not None:
        out.append((b"x-request-id", request_id.encode("latin-1")))
    if arm is not None:
        out.append((ARM_HEADER.encode(), arm.encode("latin-1")))
    if stream:
        out.append((b"cache-control", b"no-cache"))
    return out


async def _respond(
    send: Send, status: int, data: bytes, media_type: str | None, request_id: str | None, arm: str | None
) -> None:
    headers = _reply_headers(media_type, request_id, arm)
    headers.append((b"content-length", str(len(data)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


async def _json(send: Send, status: int, body: Any) -> None:
    await _respond(send, status, orjson.dumps(body), "application/json", None, None)


async def _error(
    send: Send, status: int, message: str, type_: str, param: str | None = None, code: str | None = None
) -> None:
    """An OpenAI-shaped error."""
    await _json(send, status, {"error": {"message": message, "type": type_, "param": param, "code": code}})


def process_edge_id(configured: str | None) -> str:
    """This process's edge id: the configured name (else the host's) and a boot id. Windows are
    keyed by (edge id, window start): a restarted router, or another worker of the same file,
    starts a window of the same start under its own id, and never sends a second body for a
    window another process's body was stored under."""
    base = configured or re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname()).strip("-._") or "router"
    return f"{base[:MAX_EDGE_ID_BASE]}/{secrets.token_hex(6)}"


def create_app(config: RouterConfig, api_key: str | None = None) -> Router:
    """The router as an ASGI app (uvicorn runs it; its lifespan starts and stops the followers).
    ``api_key``: used when the file names no ``api_key_file``."""
    return Router(config, config.control_plane.api_key(api_key))


def from_settings() -> Router:
    """The app of one router worker process (``controlplane router --workers N``): the file and
    the key from Settings, which the CLI passes on in the environment."""
    settings = get_settings()
    if settings.router_config is None:
        raise RouterConfigError("CONTROLPLANE_ROUTER_CONFIG names no router configuration file")
    config = load_config(settings.router_config)
    if settings.router_account:
        config = config.model_copy(
            update={
                "control_plane": config.control_plane.model_copy(update={"account": settings.router_account})
            }
        )
    return create_app(config, settings.router_api_key)


__all__ = ["Router", "create_app", "from_settings"]
