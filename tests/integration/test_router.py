"""The router as a team runs it, with real processes: the control plane's API (SQLite) in a live
canary, three vLLM-style backends (incumbent, candidate, no speculation) and `controlplane router`.
Streamed chat through the `openai` client, every arm recorded under the version that served it,
the control plane killed and restarted under traffic with every record arriving once, a candidate
backend's death absorbed, and a promotion followed within seconds."""

from __future__ import annotations

import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from subprocess import Popen
from typing import Any

import httpx
import openai
import pytest

from tests.fleet.canary_setup import open_live_canary
from tests.fleet.processes import ControlPlaneProcess, free_port, start_router, start_stub_backend, stop

DEPLOYMENTS = "/v1/accounts/default/deployments"


@dataclass
class Fleet:
    cp: ControlPlaneProcess
    router_url: str
    backends: dict[str, Popen[bytes]]
    canary_id: int
    database: Path

    def stored(self, where: str, *params: Any) -> list[tuple[Any, ...]]:
        with sqlite3.connect(self.database) as conn:
            return conn.execute(
                "SELECT request_id, arm, drafter_version, drafted_tokens, accepted_tokens, generated_tokens, "
                "ttft_ms, total_ms, category FROM acceptance_records WHERE " + where,
                params,
            ).fetchall()

    def health(self) -> dict[str, Any]:
        return dict(httpx.get(f"{self.router_url}/healthz", timeout=5).json())

    def drained(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            reporter = self.health()["reporter"]
            if reporter["buffered"] == 0 and reporter["spool_bytes"] == 0:
                time.sleep(0.6)  # one more flush interval for what was in flight
                reporter = self.health()["reporter"]
                if reporter["buffered"] == 0 and reporter["spool_bytes"] == 0:
                    return
            time.sleep(0.3)
        raise AssertionError(f"the router's reports did not drain: {self.health()['reporter']}")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    work = tmp_path_factory.mktemp("router")
    cp = ControlPlaneProcess(work).start()
    processes: dict[str, Popen[bytes]] = {}
    try:
        created = cp.api("POST", DEPLOYMENTS, {"target_model": "reference-target", "deployment_id": "chat"})
        assert created.status_code == 201, created.text
        policy = cp.api(
            "PATCH", f"{DEPLOYMENTS}/chat/canary-policy", {"candidate_weight": 0.3, "baseline_weight": 0.2}
        )
        assert policy.status_code == 200, policy.text
        database = work / "var" / "controlplane.db"
        canary_id = open_live_canary(f"sqlite:///{database}", "chat")
        ports = {name: free_port() for name in ("inc", "cand", "base")}
        processes["inc"] = start_stub_backend(ports["inc"], "--accept", "0.6")
        processes["cand"] = start_stub_backend(ports["cand"], "--drafter-version", "1", "--accept", "0.85")
        processes["base"] = start_stub_backend(ports["base"], "--no-speculation")
        config = work / "router.toml"
        config.write_text(
            f"""
[control_plane]
url = "{cp.url}"
[router]
spool_dir = "{work / "spool"}"
report_interval_s = 0.2
[[deployments]]
name = "chat"
backend_model = "served-name"
[[deployments.backends]]
name = "inc"
pool = "incumbent"
url = "http://127.0.0.1:{ports["inc"]}"
[[deployments.backends]]
name = "cand"
pool = "candidate"
url = "http://127.0.0.1:{ports["cand"]}"
drafter_version = 1
[[deployments.backends]]
name = "base"
pool = "baseline"
url = "http://127.0.0.1:{ports["base"]}"
"""
        )
        # A serving key is what the router needs: it reads serving-config and writes records.
        key = cp.api("POST", "/v1/accounts/default/api-keys", {"role": "serving", "name": "router"})
        assert key.status_code == 201, key.text
        router_port = free_port()
        processes["router"] = start_router(
            config, router_port, work, CONTROLPLANE_ROUTER_API_KEY=key.json()["key"]
        )
        fleet = Fleet(cp, f"http://127.0.0.1:{router_port}", processes, canary_id, database)
        deadline = time.monotonic() + 60  # a wait, not a figure: room for a loaded machine
        while len(fleet.health()["deployments"]["chat"]["arms"]) != 3 and time.monotonic() < deadline:
            time.sleep(0.2)
        yield fleet
    finally:
        for process in processes.values():
            stop(process)
        cp.stop()


def test_streamed_chat_through_the_router_with_the_openai_client(fleet: Fleet) -> None:
    client = openai.OpenAI(base_url=f"{fleet.router_url}/v1", api_key="unused", max_retries=0)
    request_id = f"chat-{uuid.uuid4().hex}"
    stream = client.chat.completions.create(
        model="chat",
        messages=[{"role": "user", "content": "Hello there"}],
        stream=True,
        user="alice",
        extra_headers={"x-request-id": request_id},
        extra_body={"category": "support"},
    )
    pieces = [chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices]
    assert "".join(pieces).startswith("w0 w1")
    whole = client.completions.create(model="chat", prompt="Hi", max_tokens=16, user="alice")
    assert whole.choices[0].text.startswith("w0")
    fleet.drained()
    [row] = fleet.stored("request_id = ?", request_id)
    _, arm, version, drafted, accepted, generated, ttft_ms, total_ms, category = row
    assert generated == 16 and category == "support" and 0 < ttft_ms <= total_ms
    if arm == "baseline":
        assert drafted == 0 and version is None
    else:
        assert drafted > 0 and accepted <= drafted and version == (1 if arm == "canary:1" else None)


def test_a_document_reaches_the_trace_and_never_the_backend(fleet: Fleet) -> None:
    # The stub backends refuse a body that still holds ``document``: every 200 below was stripped.
    for bad in (7, "", "x" * 201):
        response = httpx.post(
            f"{fleet.router_url}/v1/completions",
            json={"model": "chat", "prompt": "Hi", "document": bad},
            timeout=10,
        )
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "document"
    assert fleet.cp.api("PATCH", f"{DEPLOYMENTS}/chat", {"trace_sample_rate": 1.0}).status_code == 200
    try:
        document = f"structured:doc-{uuid.uuid4().hex[:8]}"
        traced: list[tuple[str, str]] = []
        deadline = time.monotonic() + 30
        while not traced and time.monotonic() < deadline:  # until the router follows the new rate
            response = httpx.post(
                f"{fleet.router_url}/v1/chat/completions",
                json={"model": "chat", "messages": [{"role": "user", "content": "Hi"}], "document": document},
                timeout=10,
            )
            assert response.status_code == 200, response.text
            fleet.drained()
            with sqlite3.connect(fleet.database) as conn:
                traced = conn.execute(
                    "SELECT prompt, document FROM traces WHERE document = ?", (document,)
                ).fetchall()
        assert traced and all(prompt == "user: Hi\nassistant: " for prompt, _ in traced)
    finally:
        fleet.cp.api("PATCH", f"{DEPLOYMENTS}/chat", {"trace_sample_rate": 0.1})


def test_every_arm_is_served_by_its_pool_and_recorded_under_its_version(fleet: Fleet) -> None:
    tag = uuid.uuid4().hex[:8]
    served: dict[str, int] = {}
    with httpx.Client(timeout=30) as client:
        for i in range(300):
            reply = client.post(
                f"{fleet.router_url}/v1/completions",
                json={"model": "chat", "prompt": "p", "max_tokens": 16, "user": f"u{i}"},
                headers={"x-request-id": f"arms-{tag}-{i}"},
            )
            assert reply.status_code == 200, reply.text
            served[reply.headers["x-speculation-arm"]] = served.get(reply.headers["x-speculation-arm"], 0) + 1
            # The same user lands on the same arm every time.
            again = client.post(
                f"{fleet.router_url}/v1/completions", json={"model": "chat", "prompt": "q", "user": f"u{i}"}
            )
            assert again.headers["x-speculation-arm"] == reply.headers["x-speculation-arm"]
    assert set(served) == {"live", "canary:1", "baseline"}
    # Deterministic: the arm is a sha256 of the fixed user ids u0..u299, so the shares change only
    # if the hashing rule does (for 300 random keys the chance of a miss would be 5e-4 + 2e-4, by
    # the binomial tails at 3.5 and 3.8 sd).
    assert abs(served["live"] / 300 - 0.5) < 0.1 and abs(served["canary:1"] / 300 - 0.3) < 0.1
    fleet.drained()
    rows = fleet.stored("request_id LIKE ?", f"arms-{tag}-%")
    assert len(rows) == 300
    by_arm: dict[str, list[tuple[Any, ...]]] = {}
    for row in rows:
        by_arm.setdefault(row[1], []).append(row)
    assert {len(v) for v in by_arm.values()} == {served[a] for a in by_arm}
    assert all(r[2] == 1 and r[3] > 0 for r in by_arm["canary:1"])
    assert all(r[2] is None and r[3] == 0 for r in by_arm["baseline"])
    assert all(r[2] is None and r[3] > 0 for r in by_arm["live"])

    def hit(arm: str) -> float:
        return sum(r[4] for r in by_arm[arm]) / sum(r[3] for r in by_arm[arm])

    # The candidate backend accepts more, and it shows. Seeded (each stub backend draws from
    # random.Random(0)); with fresh draws it would still hold: per-token acceptance is 0.68 at
    # p = 0.85 and 0.33 at p = 0.6 (k = 4), a gap of 0.35 against 0.1. Every request takes 4 or
    # more steps (16 tokens, at most 5 per step); Hoeffding over steps, with the 0.25 shortfall
    # split 0.145 / 0.105, gives exp(-2 * 240 * 0.145^2) + exp(-2 * 480 * 0.105^2) = 7e-5 even at
    # the fewest requests the shares above allow (60 and 120), about 1e-6 at the expected 90 / 150.
    assert hit("canary:1") > hit("live") + 0.1
    unknown = httpx.post(f"{fleet.router_url}/v1/completions", json={"model": "nope", "prompt": "p"})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    broken = httpx.post(f"{fleet.router_url}/v1/completions", content=b"{not json")
    assert broken.status_code == 400


def test_every_record_arrives_once_while_the_control_plane_is_killed_and_restarted(fleet: Fleet) -> None:
    tag = uuid.uuid4().hex[:8]
    replies: list[int] = []
    errors: list[str] = []
    done = threading.Event()

    def traffic() -> None:
        with httpx.Client(timeout=30) as client:
            i = 0
            while not done.is_set():
                try:
                    reply = client.post(
                        f"{fleet.router_url}/v1/completions",
                        json={"model": "chat", "prompt": "p", "max_tokens": 8, "user": f"r{i}"},
                        headers={"x-request-id": f"restart-{tag}-{i}"},
                    )
                    (replies if reply.status_code == 200 else errors).append(i)
                except httpx.HTTPError as exc:
                    errors.append(repr(exc))
                i += 1
                time.sleep(0.04)

    thread = threading.Thread(target=traffic)
    thread.start()
    time.sleep(3.0)
    fleet.cp.stop(kill=True)
    # Polled rather than slept on: a loaded machine may take longer than a fixed pause to route
    # the next request while the control plane is down.
    deadline = time.monotonic() + 60.0
    while (spooled_while_down := fleet.health()["reporter"]["spooled"]) == 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(2.0)
    fleet.cp.start()
    time.sleep(2.0)
    fleet.cp.stop()  # a graceful stop too
    time.sleep(1.5)
    fleet.cp.start()
    done.set()
    thread.join()
    assert not errors
    fleet.drained()
    rows = fleet.stored("request_id LIKE ?", f"restart-{tag}-%")
    assert spooled_while_down > 0
    assert len(rows) == len(replies) and len({r[0] for r in rows}) == len(replies)


def test_a_dead_candidate_backend_fails_over_and_is_recorded_under_the_arm_that_served(fleet: Fleet) -> None:
    stop(fleet.backends["cand"], kill=True)
    tag = uuid.uuid4().hex[:8]
    arms: dict[str, int] = {}
    with httpx.Client(timeout=30) as client:
        for i in range(120):
            reply = client.post(
                f"{fleet.router_url}/v1/completions",
                json={"model": "chat", "prompt": "p", "max_tokens": 8, "user": f"u{i}"},
                headers={"x-request-id": f"failover-{tag}-{i}"},
            )
            assert reply.status_code == 200, reply.text
            arms[reply.headers["x-speculation-arm"]] = arms.get(reply.headers["x-speculation-arm"], 0) + 1
    # Its users went to no speculation. Deterministic: arms hash the fixed user ids u0..u119, about
    # half of them (baseline's 20 % and the candidate's 30 %) land on baseline.
    assert "canary:1" not in arms and arms.get("baseline", 0) > 30
    cand = next(b for b in fleet.health()["deployments"]["chat"]["backends"] if b["name"] == "cand")
    assert cand["open"] and cand["failed"] >= 3
    fleet.drained()
    rows = fleet.stored("request_id LIKE ?", f"failover-{tag}-%")
    assert len(rows) == 120 and not [r for r in rows if r[1] == "canary:1"]
    assert all(r[3] == 0 for r in rows if r[1] == "baseline")


def test_a_promotion_reaches_the_router_within_a_few_polls(fleet: Fleet) -> None:
    promoted = fleet.cp.api(
        "POST", f"{DEPLOYMENTS}/chat/canaries/{fleet.canary_id}:promote", {"reason": "test"}
    )
    assert promoted.status_code == 200, promoted.text
    started = time.monotonic()
    while fleet.health()["deployments"]["chat"]["arms"] != [
        {"arm": "live", "weight": 0.95, "drafter_version": 1},
        {"arm": "baseline", "weight": 0.05, "drafter_version": None},  # the standing share
    ]:
        # The router polls serving-config every second (its default poll_interval_s). 15 s is 15
        # polls: room for a loaded machine's stalls, while a router that stopped following (or
        # followed only on restart) never gets there.
        assert time.monotonic() - started < 15.0, fleet.health()["deployments"]["chat"]
        time.sleep(0.1)
