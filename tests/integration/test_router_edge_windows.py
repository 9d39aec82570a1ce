"""The router's aggregate windows with real processes: the control plane's API (SQLite), a
vLLM-style stub backend and a reference server (its vLLM metrics shape) behind `controlplane
router` with 10-second windows. Every request served is
counted in one window body per (edge, window) whose sums are the requests' own; raw records arrive
only for the sampled share, marked as counted in an aggregate; a window that ends while the control
plane is down is spooled and stored once when it is back; and a router restarted within a window
sends the old process's partial window and its own under two edge ids, never a conflict."""

from __future__ import annotations

import json
import sqlite3
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from subprocess import Popen
from typing import Any

import httpx
import pytest

from controlplane.router.arms import unit_hash
from tests.fleet.processes import (
    ROOT,
    ControlPlaneProcess,
    free_port,
    start_process,
    start_router,
    start_stub_backend,
    stop,
)

DEPLOYMENTS = "/v1/accounts/default/deployments"
RATES = {"chat": 0.25, "docs": 0.0}


@dataclass
class Fleet:
    cp: ControlPlaneProcess
    work: Path
    key: str
    backends: dict[str, int]
    database: Path
    processes: list[Popen[bytes]] = field(default_factory=list)

    def query(self, sql: str, *params: Any) -> list[tuple[Any, ...]]:
        with sqlite3.connect(self.database) as conn:
            return conn.execute(sql, params).fetchall()

    def windows(self, edge: str) -> list[tuple[Any, ...]]:
        """(edge id, window start, deployment, requests, drafted, accepted) of this edge's aggregates."""
        return self.query(
            "SELECT w.edge_id, w.window_start, d.name, a.requests, a.drafted_tokens, a.accepted_tokens "
            "FROM edge_windows w JOIN acceptance_aggregates a ON a.edge_window_id = w.id "
            "JOIN deployments d ON d.id = a.deployment_id WHERE w.edge_id LIKE ?",
            f"{edge}/%",
        )

    def ledger(self, edge: str) -> list[tuple[Any, ...]]:
        return self.query(
            "SELECT edge_id, window_start FROM edge_windows WHERE edge_id LIKE ? ORDER BY id", f"{edge}/%"
        )

    def router(self, edge: str, window_s: int = 10) -> str:
        """Start a router sending windows as ``edge``; its base URL."""
        lines = [
            f'[control_plane]\nurl = "{self.cp.url}"',
            f'[router]\nspool_dir = "{self.work / f"spool-{edge}"}"\nreport_interval_s = 0.2\n'
            f'aggregate_window_s = {window_s}\nedge_id = "{edge}"',
        ]
        for name, port in self.backends.items():
            lines.append(f'[[deployments]]\nname = "{name}"\nraw_record_sample_rate = {RATES[name]}')
            lines.append(
                f'[[deployments.backends]]\nname = "{name}-1"\npool = "incumbent"\nurl = "http://127.0.0.1:{port}"'
            )
        config = self.work / f"router-{edge}.toml"
        config.write_text("\n".join(lines) + "\n")
        port = free_port()
        self.processes.append(start_router(config, port, self.work, CONTROLPLANE_ROUTER_API_KEY=self.key))
        return f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    work = tmp_path_factory.mktemp("router-windows")
    cp = ControlPlaneProcess(work).start()
    backends: list[Popen[bytes]] = []
    fleet: Fleet | None = None
    try:
        for name in RATES:
            created = cp.api("POST", DEPLOYMENTS, {"target_model": "reference-target", "deployment_id": name})
            assert created.status_code == 201, created.text
            # The control plane's rate wins over the router file's once serving-config carries it.
            rate = cp.api("PATCH", f"{DEPLOYMENTS}/{name}", {"raw_record_sample_rate": RATES[name]})
            assert rate.status_code == 200, rate.text
        key = cp.api("POST", "/v1/accounts/default/api-keys", {"role": "serving", "name": "router"})
        assert key.status_code == 201, key.text
        ports = {"chat": free_port(), "docs": free_port()}
        backends.append(start_stub_backend(ports["chat"], "--accept", "0.6"))
        reference = ROOT / "workers" / "models" / "reference"
        served_config = work / "docs-backend.json"
        served_config.write_text(
            json.dumps(
                {
                    "docs": {
                        "target_path": str(reference / "target"),
                        "drafter_path": str(reference / "generic-drafter"),
                        "speculation": "draft_model",
                        "k": 4,
                    }
                }
            )
        )
        backends.append(
            start_process(
                [
                    sys.executable,
                    "-m",
                    "workers.serve",
                    "--config",
                    str(served_config),
                    "--metrics-style",
                    "vllm",
                    "--no-report",
                    "--threads",
                    "1",
                    "--port",
                    str(ports["docs"]),
                ],
                f"http://127.0.0.1:{ports['docs']}/healthz",
            )
        )
        fleet = Fleet(cp, work, key.json()["key"], ports, work / "var" / "controlplane.db")
        yield fleet
    finally:
        for process in [*backends, *(fleet.processes if fleet else [])]:
            stop(process)
        cp.stop()


@dataclass
class Served:
    requests: int = 0
    drafted: int = 0
    accepted: int = 0
    request_ids: list[str] = field(default_factory=list)


def serve(
    url: str, plan: dict[str, int], tag: str, served: dict[str, Served] | None = None
) -> dict[str, Served]:
    """Send ``plan[name]`` whole completions per deployment; what the backends reported, per deployment."""
    served = served if served is not None else {name: Served() for name in plan}
    # A wait, not a figure: a reference server beside other test runs has taken over 30 s to answer.
    with httpx.Client(timeout=120) as client:
        for name, n in plan.items():
            for _ in range(n):
                request_id = f"{tag}-{name}-{uuid.uuid4().hex[:12]}"
                reply = client.post(
                    f"{url}/v1/completions",
                    json={"model": name, "prompt": "The weather today is", "max_tokens": 12},
                    headers={"x-request-id": request_id},
                )
                assert reply.status_code == 200, reply.text
                spec = reply.json()["metrics"]["speculative_decoding"]
                mine = served[name]
                mine.requests += 1
                mine.drafted += spec["num_draft_tokens"]
                mine.accepted += spec["num_accepted_draft_tokens"]
                mine.request_ids.append(request_id)
    return served


def early_in_a_window(window_s: int, room_s: float) -> None:
    """Wait, if need be, until at least ``room_s`` of the current window is left."""
    left = window_s - time.time() % window_s
    if left < room_s:
        time.sleep(left + 0.1)


def health(url: str) -> dict[str, Any]:
    return dict(httpx.get(f"{url}/healthz", timeout=5).json())


def wait_for(condition: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.25)


def assert_sums(rows: list[tuple[Any, ...]], served: dict[str, Served]) -> None:
    for name, mine in served.items():
        of = [r for r in rows if r[2] == name]
        assert (sum(r[3] for r in of), sum(r[4] for r in of), sum(r[5] for r in of)) == (
            mine.requests,
            mine.drafted,
            mine.accepted,
        ), name


def test_served_requests_arrive_as_one_window_per_edge_and_raw_records_only_for_the_sample(
    fleet: Fleet,
) -> None:
    url = fleet.router("edge-a")
    early_in_a_window(10, 5.0)
    served = serve(url, {"chat": 60, "docs": 10}, "agg")
    wait_for(
        lambda: sum(r[3] for r in fleet.windows("edge-a")) == 70,
        20.0,
        f"windows of 70 requests: {fleet.windows('edge-a')} {health(url)['reporter']}",
    )
    rows = fleet.windows("edge-a")
    assert_sums(rows, served)
    ledger = fleet.ledger("edge-a")
    assert len({edge for edge, _ in ledger}) == 1  # one process, one edge id
    assert len({start for _, start in ledger}) == len(ledger)  # one body per window
    assert {(r[1], r[2]) for r in rows} <= {(start, name) for _, start in ledger for name in RATES}
    sampled = {rid for rid in served["chat"].request_ids if unit_hash(f"raw:{rid}") < RATES["chat"]}
    # The ids are fresh uuids, so the sampled count is Binomial(60, 0.25): none sampled has
    # probability 0.75^60 = 3e-8, all sampled 0.25^60 (nothing).
    assert 0 < len(sampled) < 60
    wait_for(
        lambda: (
            len(fleet.query("SELECT 1 FROM acceptance_records WHERE request_id LIKE 'agg-%'")) >= len(sampled)
        ),
        10.0,
        "the sampled raw records",
    )
    time.sleep(0.5)  # one more report interval: nothing beyond the sample may follow
    raw = fleet.query(
        "SELECT request_id, counted_in_aggregate FROM acceptance_records WHERE request_id LIKE 'agg-%'"
    )
    assert {rid for rid, _ in raw} == sampled and all(flag for _, flag in raw)
    windows = health(url)["reporter"]["windows"]
    assert windows["records_not_sampled"] == 70 - len(sampled)
    assert windows["rejected"] == 0 and windows["duplicates"] == 0 and windows["posted"] == len(ledger)


def test_a_window_ending_while_the_control_plane_is_down_is_stored_once_when_it_is_back(fleet: Fleet) -> None:
    # Every request must land in one window that ends after the kill: 35 requests take about 2 s
    # here, and a 30 s window started with 25 s left keeps a loaded machine's tenfold slow-down
    # inside it (a 10 s window with 6 s left did not have that margin).
    url = fleet.router("edge-b", window_s=30)
    early_in_a_window(30, 25.0)
    served = serve(url, {"chat": 30, "docs": 5}, "down")
    fleet.cp.stop(kill=True)
    try:
        wait_for(lambda: health(url)["reporter"]["windows"]["sealed"] >= 1, 45.0, "the window ended")
        reporter = health(url)["reporter"]
        assert reporter["windows"]["posted"] == 0 and reporter["spool_bytes"] > 0
    finally:
        fleet.cp.start()
    wait_for(
        lambda: health(url)["reporter"]["spool_bytes"] == 0,
        30.0,
        f"the spool drained: {health(url)['reporter']}",
    )
    rows = fleet.windows("edge-b")
    assert_sums(rows, served)
    ledger = fleet.ledger("edge-b")
    assert len(ledger) == len({start for _, start in ledger}) == health(url)["reporter"]["windows"]["posted"]
    assert health(url)["reporter"]["windows"]["rejected"] == 0


def test_a_router_restarted_within_a_window_sends_both_bodies_under_two_edge_ids(fleet: Fleet) -> None:
    # Both processes must serve inside one window, across a router's stop and start: seconds when
    # idle, but a loaded machine has taken over 50 s. So each attempt starts with 50 s of a 60 s
    # window left, and the client's clock (the routers' own) tells whether the attempt fitted in
    # one window; one that did not is repeated rather than judged.
    window_s, attempts = 60, 0
    served: dict[str, Served] | None = None
    while True:
        attempts += 1
        early_in_a_window(window_s, 50.0)
        began = time.time()
        url = fleet.router("edge-c", window_s=window_s)
        served = serve(url, {"chat": 15, "docs": 5}, "restart", served)
        first = fleet.processes.pop()
        stop(first)  # SIGTERM: the current window is spooled as it is
        url = fleet.router("edge-c", window_s=window_s)
        serve(url, {"chat": 15, "docs": 5}, "restart", served)
        if began // window_s == time.time() // window_s:
            break
        assert attempts < 3, "three attempts never fitted a router restart into one 60 s window"
        stop(fleet.processes.pop())
    wait_for(
        lambda: sum(r[3] for r in fleet.windows("edge-c")) == 40 * attempts,
        90.0,
        f"both processes' windows: {fleet.ledger('edge-c')} {health(url)['reporter']}",
    )
    assert_sums(fleet.windows("edge-c"), served)
    ledger = fleet.ledger("edge-c")
    assert len({edge for edge, _ in ledger}) == 2 * attempts  # a boot id per process
    starts = [start for _, start in ledger]
    assert len(set(starts)) < len(starts)  # both processes sent a body for one window, no conflict
    assert len(ledger) == len(set(ledger)) and health(url)["reporter"]["windows"]["rejected"] == 0
