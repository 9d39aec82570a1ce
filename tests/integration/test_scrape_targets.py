"""Pull scraping against real HTTP servers: what a target's scrapes store equals the engine's true
counter increases since its first scrape (a baseline), across Prometheus text, OpenMetrics,
restarts, fail-over and bad answers; scraped records count as the fleet's own."""

from __future__ import annotations

import shutil
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from controlplane.config import get_settings
from controlplane.db.models import AcceptanceRecordRow, Deployment, Role
from controlplane.db.session import get_engine, unit_of_work
from controlplane.ingest.scrape import FetchError, create_target, http_fetch, scrape_all, validate_target
from tests.conftest import Database, Tenant, add_deployment
from workers.scrape_tasks import scrape_all_targets

OPENMETRICS_TYPE = "application/openmetrics-text; version=1.0.0; charset=utf-8"
PROMETHEUS_TYPE = "text/plain; version=0.0.4; charset=utf-8"
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
STARTED_AT = 1764633600.0


@dataclass
class Engine:
    """One vLLM engine's spec-decode counters, as its /metrics shows them (k = 4)."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    per_pos: list[int] = field(default_factory=lambda: [0, 0, 0, 0])
    created: float = STARTED_AT
    # How /metrics answers: "prometheus", "openmetrics", "openmetrics-no-eof", "garbage" or "down".
    mode: str = "prometheus"
    lock: threading.Lock = field(default_factory=threading.Lock)

    def serve(self, drafts: int, draft_tokens: int, accepted: int, per_pos: list[int]) -> None:
        with self.lock:
            self.drafts += drafts
            self.draft_tokens += draft_tokens
            self.accepted += accepted
            self.per_pos = [a + b for a, b in zip(self.per_pos, per_pos, strict=True)]

    def restart(self, created: float) -> None:
        """A new process: every counter starts again at zero, with a new creation time."""
        with self.lock:
            self.drafts = self.draft_tokens = self.accepted = 0
            self.per_pos = [0, 0, 0, 0]
            self.created = created

    def page(self) -> tuple[int, str, str]:
        with self.lock:
            if self.mode == "down":
                return 503, "text/plain", "engine is starting"
            if self.mode == "garbage":
                return 200, "text/html", "<html><body>502 Bad Gateway</body></html>"
            if self.mode == "prometheus":
                return 200, PROMETHEUS_TYPE, self._prometheus()
            text = self._openmetrics()
            if self.mode == "openmetrics-no-eof":
                text = text.removesuffix("# EOF\n")
            return 200, OPENMETRICS_TYPE, text

    def _families(self) -> list[tuple[str, str, list[tuple[str, int]]]]:
        return [
            ("spec_decode_num_drafts", "Number of spec decoding drafts.", [("", self.drafts)]),
            ("spec_decode_num_draft_tokens", "Number of draft tokens.", [("", self.draft_tokens)]),
            ("spec_decode_num_accepted_tokens", "Number of accepted tokens.", [("", self.accepted)]),
            (
                "spec_decode_num_accepted_tokens_per_pos",
                "Accepted tokens per draft position.",
                [(f',position="{i}"', v) for i, v in enumerate(self.per_pos)],
            ),
        ]

    def _prometheus(self) -> str:
        """vLLM's default exposition: ``vllm:`` names, classic text format, other metrics around."""
        labels = f'engine="0",model_name="{MODEL}"'
        lines = [
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{labels}}} 3.0",
        ]
        for name, help_text, samples in self._families():
            lines += [f"# HELP vllm:{name}_total {help_text}", f"# TYPE vllm:{name}_total counter"]
            lines += [f"vllm:{name}_total{{{labels}{extra}}} {float(v)}" for extra, v in samples]
        lines += [
            "# HELP vllm:e2e_request_latency_seconds Histogram of end to end request latency.",
            "# TYPE vllm:e2e_request_latency_seconds histogram",
            f'vllm:e2e_request_latency_seconds_bucket{{{labels},le="+Inf"}} 12.0',
            f"vllm:e2e_request_latency_seconds_count{{{labels}}} 12.0",
            f"vllm:e2e_request_latency_seconds_sum{{{labels}}} 3.5",
        ]
        return "\n".join(lines) + "\n"

    def _openmetrics(self) -> str:
        """OpenMetrics as exporters that allow only ``[a-zA-Z0-9_]`` write it: ``vllm_`` names,
        families without ``_total``, and each counter's ``_created``."""
        labels = f'engine="0",model_name="{MODEL}"'
        lines = [
            "# TYPE vllm_time_to_first_token_seconds histogram",
            "# UNIT vllm_time_to_first_token_seconds seconds",
            "# HELP vllm_time_to_first_token_seconds Histogram of time to first token in seconds.",
            f'vllm_time_to_first_token_seconds_bucket{{{labels},le="+Inf"}} 12.0',
            f"vllm_time_to_first_token_seconds_count{{{labels}}} 12.0",
            f"vllm_time_to_first_token_seconds_sum{{{labels}}} 0.84",
        ]
        for name, help_text, samples in self._families():
            lines += [f"# TYPE vllm_{name} counter", f"# HELP vllm_{name} {help_text}"]
            for extra, v in samples:
                lines.append(f"vllm_{name}_total{{{labels}{extra}}} {float(v)}")
                lines.append(f"vllm_{name}_created{{{labels}{extra}}} {self.created}")
        return "\n".join(lines) + "\n# EOF\n"


class MetricsServer:
    """A real HTTP server on 127.0.0.1 whose /metrics shows an engine (one of the API servers in
    front of it: several may share one engine)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.requests = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer.requests += 1
                if self.path == "/old-metrics":
                    self.send_response(307)
                    self.send_header("Location", "/metrics")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if self.path != "/metrics":
                    self.send_error(404)
                    return
                status, content_type, text = outer.engine.page()
                body = text.encode()
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


@pytest.fixture
def servers() -> Iterator[list[MetricsServer]]:
    started: list[MetricsServer] = []
    yield started
    for server in started:
        server.close()


def _start(servers: list[MetricsServer], engine: Engine) -> MetricsServer:
    server = MetricsServer(engine)
    servers.append(server)
    return server


def _closed_port_url() -> str:
    """A URL nothing listens on (connection refused at once)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"http://127.0.0.1:{port}/metrics"


def _deployment(client: TestClient, tenant: Tenant, name: str = "svc") -> str:
    response = client.post(
        f"/v1/accounts/{tenant.name}/deployments",
        json={"target_model": "reference-target", "deployment_id": name},
        headers=tenant.headers(Role.admin),
    )
    assert response.status_code == 201, response.text
    return f"/v1/accounts/{tenant.name}/deployments/{name}/scrape-targets"


def _register(client: TestClient, tenant: Tenant, base: str, body: dict[str, Any]) -> dict[str, Any]:
    response = client.post(base, json=body, headers=tenant.headers(Role.admin))
    assert response.status_code == 201, response.text
    reply: dict[str, Any] = response.json()
    return reply


def _scrape(client: TestClient, tenant: Tenant, base: str, name: str) -> dict[str, Any]:
    response = client.post(f"{base}/{name}/scrape", headers=tenant.headers(Role.admin))
    assert response.status_code == 200, response.text
    reply: dict[str, Any] = response.json()
    return reply


def _stored(db: Database) -> list[tuple[int, int, int, list[int], str, int | None]]:
    session = db.new_session()
    try:
        rows = session.scalars(select(AcceptanceRecordRow).order_by(AcceptanceRecordRow.id)).all()
        return [
            (
                r.verify_steps,
                r.drafted_tokens,
                r.accepted_tokens,
                list(r.accepted_per_position),
                r.arm,
                r.drafter_version,
            )
            for r in rows
        ]
    finally:
        session.close()


def _totals(rows: list[tuple[int, int, int, list[int], str, int | None]]) -> tuple[int, int, int, list[int]]:
    return (
        sum(r[0] for r in rows),
        sum(r[1] for r in rows),
        sum(r[2] for r in rows),
        [sum(r[3][i] for r in rows) for i in range(4)],
    )


def test_scrapes_store_the_true_increases_across_formats_and_restarts(
    client: TestClient, tenants: tuple[Tenant, Tenant], db: Database, servers: list[MetricsServer]
) -> None:
    acme, _ = tenants
    base = _deployment(client, acme)
    engine = Engine()
    server = _start(servers, engine)
    target = _register(client, acme, base, {"name": "engine-0", "urls": [server.url], "arm": "canary:2"})
    assert (target["arm"], target["drafter_version"], target["scrapes"]) == ("canary:2", 2, 0)
    # The first scrape is the baseline: what the engine counted before it is not a window.
    baseline = _scrape(client, acme, base, "engine-0")
    assert (baseline["ok"], baseline["inserted"], baseline["baseline_label_sets"]) == (True, 0, 1)

    engine.serve(10, 40, 25, [9, 8, 5, 3])
    first = _scrape(client, acme, base, "engine-0")
    assert (first["ok"], first["format"], first["inserted"], first["url"]) == (
        True,
        "prometheus",
        1,
        server.url,
    )
    again = _scrape(client, acme, base, "engine-0")  # nothing moved: nothing stored twice
    assert (again["ok"], again["inserted"], again["duplicates"]) == (True, 0, 0)

    engine.mode = "openmetrics"
    engine.serve(5, 20, 8, [4, 2, 2, 0])
    second = _scrape(client, acme, base, "engine-0")
    assert (second["ok"], second["format"], second["inserted"]) == (True, "openmetrics", 1)

    # A restart: counters fall back and `_created` moves; what was served since counts once.
    engine.restart(STARTED_AT + 3600)
    engine.serve(3, 12, 6, [3, 2, 1, 0])
    third = _scrape(client, acme, base, "engine-0")
    assert (third["ok"], third["inserted"]) == (True, 1)
    # A second restart whose new counters already exceed the old ones: only `_created` tells.
    engine.restart(STARTED_AT + 7200)
    engine.serve(20, 80, 50, [18, 14, 11, 7])
    fourth = _scrape(client, acme, base, "engine-0")
    assert (fourth["ok"], fourth["inserted"]) == (True, 1)

    stored = _stored(db)
    assert [r[:4] for r in stored] == [
        (10, 40, 25, [9, 8, 5, 3]),
        (5, 20, 8, [4, 2, 2, 0]),
        (3, 12, 6, [3, 2, 1, 0]),
        (20, 80, 50, [18, 14, 11, 7]),
    ]
    assert {(r[4], r[5]) for r in stored} == {("canary:2", 2)}
    session = db.new_session()
    try:  # the scraped engines are the fleet itself
        assert set(session.scalars(select(AcceptanceRecordRow.from_serving_key))) == {True}
    finally:
        session.close()
    shown = client.get(f"{base}/engine-0", headers=acme.headers(Role.viewer)).json()
    assert (shown["scrapes"], shown["records_stored"], shown["label_sets"]) == (6, 4, 1)
    assert shown["last_error"] is None
    assert shown["last_scraped_at"].endswith("+00:00") and shown["created_at"].endswith("+00:00")
    listed = client.get(base, headers=acme.headers(Role.viewer)).json()["scrape_targets"]
    assert [t["name"] for t in listed] == ["engine-0"]

    audit = client.get(f"/v1/accounts/{acme.name}/audit", headers=acme.headers(Role.viewer)).json()["entries"]
    actions = [e["action"] for e in audit if e["resource"].endswith("/scrape-targets/engine-0")]
    assert actions.count("scrape_target.scrape") == 6 and "scrape_target.register" in actions


def test_api_servers_of_one_engine_count_once_and_fail_over(
    client: TestClient, tenants: tuple[Tenant, Tenant], db: Database, servers: list[MetricsServer]
) -> None:
    acme, _ = tenants
    base = _deployment(client, acme)
    engine = Engine()
    front_a, front_b = _start(servers, engine), _start(servers, engine)
    dead = _closed_port_url()
    _register(client, acme, base, {"name": "engine-0", "urls": [dead, front_a.url, front_b.url]})
    assert _scrape(client, acme, base, "engine-0")["baseline_label_sets"] == 1

    engine.serve(10, 40, 25, [9, 8, 5, 3])
    first = _scrape(client, acme, base, "engine-0")
    assert (first["ok"], first["url"], first["inserted"]) == (True, front_a.url, 1)
    assert len(first["url_errors"]) == 1 and first["url_errors"][0].startswith(dead)
    assert front_b.requests == 0  # the first URL that answers is the only one read

    front_a.close()
    servers.remove(front_a)
    engine.serve(5, 20, 8, [4, 2, 2, 0])
    second = _scrape(client, acme, base, "engine-0")
    assert (second["ok"], second["url"], second["inserted"]) == (True, front_b.url, 1)
    assert [r[:4] for r in _stored(db)] == [(10, 40, 25, [9, 8, 5, 3]), (5, 20, 8, [4, 2, 2, 0])]


def test_a_bad_answer_records_the_error_stores_nothing_and_loses_nothing(
    client: TestClient, tenants: tuple[Tenant, Tenant], db: Database, servers: list[MetricsServer]
) -> None:
    acme, _ = tenants
    base = _deployment(client, acme)
    engine = Engine(mode="openmetrics")
    server = _start(servers, engine)
    _register(client, acme, base, {"name": "engine-0", "urls": [server.url]})
    assert _scrape(client, acme, base, "engine-0")["baseline_label_sets"] == 1
    engine.serve(10, 40, 25, [9, 8, 5, 3])
    assert _scrape(client, acme, base, "engine-0")["inserted"] == 1

    engine.serve(1, 4, 2, [1, 1, 0, 0])
    for mode, reason in (
        ("garbage", "no vllm:spec_decode_* counters"),
        ("openmetrics-no-eof", "# EOF"),
        ("down", "HTTP 503"),
    ):
        engine.mode = mode
        failed = _scrape(client, acme, base, "engine-0")
        assert (failed["ok"], failed["inserted"]) == (False, 0), mode
        assert reason in failed["error"], (mode, failed["error"])
        shown = client.get(f"{base}/engine-0", headers=acme.headers(Role.viewer)).json()
        assert reason in shown["last_error"]
    assert len(_stored(db)) == 1

    # The old snapshot was kept: the next good scrape stores everything since the last good one.
    engine.mode = "openmetrics"
    engine.serve(2, 8, 4, [2, 1, 1, 0])
    recovered = _scrape(client, acme, base, "engine-0")
    assert (recovered["ok"], recovered["inserted"]) == (True, 1)
    assert _totals(_stored(db)) == (13, 52, 31, [12, 10, 6, 3])
    shown = client.get(f"{base}/engine-0", headers=acme.headers(Role.viewer)).json()
    assert (shown["last_error"], shown["scrapes"], shown["records_stored"]) == (None, 6, 2)


def test_registration_is_validated_and_names_are_unique(
    client: TestClient, tenants: tuple[Tenant, Tenant], db: Database
) -> None:
    acme, _ = tenants
    base = _deployment(client, acme)
    admin = acme.headers(Role.admin)
    url = _closed_port_url()
    bad: list[tuple[dict[str, Any], str]] = [
        ({"name": "engine-0", "urls": ["ftp://host/metrics"]}, "urls.0"),
        ({"name": "engine-0", "urls": ["http://user:secret@host/metrics"]}, "urls.0"),
        ({"name": "engine-0", "urls": []}, "urls"),
        ({"name": "engine-0", "urls": [f"http://h{i}/metrics" for i in range(9)]}, "urls"),
        ({"name": "Engine_0", "urls": [url]}, "name"),
        ({"name": "engine-0", "urls": [url], "arm": "shadow"}, "arm"),
        ({"name": "engine-0", "urls": [url], "arm": "canary:3", "drafter_version": 2}, "drafter_version"),
        # Values the database could not store: an INTEGER drafter version, a 40-character arm.
        ({"name": "engine-0", "urls": [url], "drafter_version": 2**31}, "drafter_version"),
        ({"name": "engine-0", "urls": [url], "arm": "canary:" + "9" * 40}, "arm"),
        ({"name": "engine-0", "urls": [url], "arm": "canary:2147483648"}, "arm"),
        ({"name": "engine-0", "urls": [url], "arm": "canary:²"}, "arm"),
    ]
    for body, field_name in bad:
        response = client.post(base, json=body, headers=admin)
        assert response.status_code == 422, (body, response.text)
        fields = [d["field"] for d in response.json()["error"]["details"]]
        assert field_name in fields, (body, fields)
    assert client.get(base, headers=admin).json()["scrape_targets"] == []

    _register(client, acme, base, {"name": "engine-0", "urls": [url]})
    duplicate = client.post(base, json={"name": "engine-0", "urls": [url]}, headers=admin)
    assert duplicate.status_code == 409, duplicate.text
    assert client.delete(f"{base}/engine-0", headers=admin).status_code == 204
    assert client.get(f"{base}/engine-0", headers=admin).status_code == 404
    assert client.post(f"{base}/engine-0/scrape", headers=admin).status_code == 404


def test_another_account_can_neither_see_nor_scrape_the_targets(
    client: TestClient, tenants: tuple[Tenant, Tenant], db: Database, servers: list[MetricsServer]
) -> None:
    acme, globex = tenants
    base = _deployment(client, acme)
    _deployment(client, globex)  # globex has a deployment of the same name
    engine = Engine()
    engine.serve(10, 40, 25, [9, 8, 5, 3])
    server = _start(servers, engine)
    _register(client, acme, base, {"name": "engine-0", "urls": [server.url]})
    for method, path in (
        ("GET", base),
        ("GET", f"{base}/engine-0"),
        ("POST", f"{base}/engine-0/scrape"),
        ("DELETE", f"{base}/engine-0"),
    ):
        assert client.request(method, path, headers=globex.headers(Role.admin)).status_code == 404, path
    # Its own deployment of the same name has no such target either.
    own = f"/v1/accounts/{globex.name}/deployments/svc/scrape-targets"
    assert client.post(f"{own}/engine-0/scrape", headers=globex.headers(Role.admin)).status_code == 404
    assert server.requests == 0 and _stored(db) == []


def test_scrape_all_with_the_real_fetcher(
    client: TestClient, tenants: tuple[Tenant, Tenant], db: Database, servers: list[MetricsServer]
) -> None:
    """The beat task's body: every enabled target of every live deployment, one bad one aside."""
    acme, globex = tenants
    acme_base = _deployment(client, acme)
    globex_base = _deployment(client, globex)
    gone_base = _deployment(client, acme, "gone")
    engines = [Engine(), Engine(mode="openmetrics"), Engine()]
    live = [_start(servers, e) for e in engines]
    _register(client, acme, acme_base, {"name": "good", "urls": [live[0].url]})
    _register(client, acme, acme_base, {"name": "down", "urls": [_closed_port_url()]})
    _register(client, acme, acme_base, {"name": "off", "urls": [live[2].url], "enabled": False})
    _register(client, globex, globex_base, {"name": "good", "urls": [live[1].url], "arm": "baseline"})
    _register(client, acme, gone_base, {"name": "good", "urls": [live[2].url]})
    assert (
        client.delete(
            f"/v1/accounts/{acme.name}/deployments/gone", headers=acme.headers(Role.admin)
        ).status_code
        < 300
    )

    baselines = scrape_all(db.new_session, http_fetch)
    assert (baselines["ok"], baselines["failed"], baselines["inserted"]) == (2, 1, 0)
    for engine in engines:
        engine.serve(10, 40, 25, [9, 8, 5, 3])
    summary = scrape_all(db.new_session, http_fetch)
    assert (summary["targets"], summary["ok"], summary["failed"], summary["inserted"]) == (3, 1, 2, 1)
    errors = list(summary["errors"].values())
    assert any("ConnectError" in e for e in errors)
    # The baseline arm runs without speculation: an engine that drafts is refused, not filed.
    assert any("baseline" in e for e in errors)
    assert live[2].requests == 0  # disabled, and a deleted deployment's target: never fetched

    engines[0].serve(5, 20, 8, [4, 2, 2, 0])
    again = scrape_all(db.new_session, http_fetch)
    assert (again["ok"], again["inserted"]) == (1, 1)
    assert [r[:4] for r in _stored(db)] == [(10, 40, 25, [9, 8, 5, 3]), (5, 20, 8, [4, 2, 2, 0])]
    session = db.new_session()
    try:
        acme_svc = session.scalars(
            select(Deployment).where(Deployment.account_id == acme.account_id, Deployment.name == "svc")
        ).one()
        ids = {r.deployment_id for r in session.scalars(select(AcceptanceRecordRow))}
        assert ids == {acme_svc.id}
    finally:
        session.close()


def test_the_fetcher_caps_the_body(servers: list[MetricsServer]) -> None:
    engine = Engine()
    engine.serve(10, 40, 25, [9, 8, 5, 3])
    server = _start(servers, engine)
    status, content_type, text = http_fetch(server.url)
    assert status == 200 and content_type == PROMETHEUS_TYPE and "vllm:spec_decode_num_drafts_total" in text
    assert http_fetch(server.url.replace("/metrics", "/old-metrics")) == (status, content_type, text)
    with pytest.raises(FetchError, match="exceeds the 100-byte limit"):
        http_fetch(server.url, max_bytes=100)


def test_the_beat_task_scrapes_through_the_configured_database(
    sqlite_template: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, servers: list[MetricsServer]
) -> None:
    """The Celery task's own body, called in-process: settings, session factory, real fetcher."""
    path = tmp_path / "controlplane.db"
    shutil.copy(sqlite_template, path)
    url = f"sqlite:///{path}"
    engine = Engine(mode="openmetrics")
    server = _start(servers, engine)
    with unit_of_work(url) as session:
        deployment = add_deployment(session, "acme")
        spec = validate_target(name="engine-0", urls=[_closed_port_url(), server.url])
        create_target(session=session, deployment_id=deployment.id, spec=spec)
    monkeypatch.setenv("CONTROLPLANE_DATABASE_URL", url)
    get_settings.cache_clear()
    try:
        assert scrape_all_targets()["inserted"] == 0  # the baseline
        engine.serve(10, 40, 25, [9, 8, 5, 3])
        summary = scrape_all_targets()
        assert (summary["targets"], summary["ok"], summary["inserted"]) == (1, 1, 1)
        assert scrape_all_targets()["inserted"] == 0  # unchanged counters: nothing twice
    finally:
        get_settings.cache_clear()
    with unit_of_work(url) as session:
        rows = session.scalars(select(AcceptanceRecordRow)).all()
        assert [(r.verify_steps, r.drafted_tokens, r.accepted_tokens) for r in rows] == [(10, 40, 25)]
    get_engine(url).dispose()
