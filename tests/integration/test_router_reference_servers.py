"""Three reference servers started as vLLM-style backends with fixed configurations (the incumbent
drafter, a candidate drafter, no speculation), reporting vLLM's per-request metrics shape only,
behind `controlplane router` and a control plane in a live canary. The router relies on nothing
only our server sends: each arm's records come from vLLM's metrics and the pool's labels."""

from __future__ import annotations

import json
import sqlite3
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from subprocess import Popen
from typing import Any

import httpx
import openai
import pytest

from tests.fleet.canary_setup import open_live_canary
from tests.fleet.processes import (
    ROOT,
    ControlPlaneProcess,
    free_port,
    spawn_process,
    start_router,
    started,
    stop,
)

REFERENCE = ROOT / "workers" / "models" / "reference"
DEPLOYMENTS = "/v1/accounts/default/deployments"


def _fixed_backend(work: Path, name: str, arm: dict[str, Any]) -> tuple[Popen[bytes], int]:
    """A reference server that serves one configuration, whatever serving-config says (started,
    not yet healthy: the three load their models side by side)."""
    config = work / f"{name}.json"
    config.write_text(json.dumps({"chat": {"target_path": str(REFERENCE / "target"), **arm}}))
    port = free_port()
    process = spawn_process(
        [
            sys.executable,
            "-m",
            "workers.serve",
            "--config",
            str(config),
            "--metrics-style",
            "vllm",
            "--no-report",
            "--threads",
            "1",
            "--port",
            str(port),
        ],
    )
    return process, port


@pytest.fixture(scope="module")
def router_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    work = tmp_path_factory.mktemp("reference-fleet")
    cp = ControlPlaneProcess(work).start()
    processes: list[Popen[bytes]] = []
    try:
        created = cp.api("POST", DEPLOYMENTS, {"target_model": "reference-target", "deployment_id": "chat"})
        assert created.status_code == 201, created.text
        cp.api(
            "PATCH", f"{DEPLOYMENTS}/chat/canary-policy", {"candidate_weight": 0.35, "baseline_weight": 0.3}
        )
        database = work / "var" / "controlplane.db"
        open_live_canary(f"sqlite:///{database}", "chat")
        draft = {"speculation": "draft_model", "k": 4}
        fixed = {
            "incumbent": {**draft, "drafter_path": str(REFERENCE / "generic-drafter")},
            # The target drafting for itself: a drafter that never misses, so the arm shows.
            "candidate": {**draft, "drafter_path": str(REFERENCE / "target")},
            "baseline": {"speculation": "disabled"},
        }
        ports = {}
        for pool, arm in fixed.items():
            process, ports[pool] = _fixed_backend(work, pool, arm)
            processes.append(process)
        for process, port in zip(processes, ports.values(), strict=True):
            started(process, f"http://127.0.0.1:{port}/healthz")
        lines = [
            f'[control_plane]\nurl = "{cp.url}"',
            f'[router]\nspool_dir = "{work / "spool"}"\nreport_interval_s = 0.2',
            '[[deployments]]\nname = "chat"',
        ]
        for pool, port in ports.items():
            label = "\ndrafter_version = 1" if pool == "candidate" else ""
            lines.append(
                f'[[deployments.backends]]\nname = "{pool}"\npool = "{pool}"\nurl = "http://127.0.0.1:{port}"{label}'
            )
        config = work / "router.toml"
        config.write_text("\n".join(lines) + "\n")
        port = free_port()
        processes.append(start_router(config, port, work, CONTROLPLANE_ROUTER_API_KEY=cp.admin_key))
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60  # a wait, not a figure: room for a loaded machine
        while len(httpx.get(f"{url}/healthz").json()["deployments"]["chat"]["arms"]) != 3:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        yield url, database
    finally:
        for process in processes:
            stop(process)
        cp.stop()


def _records(database: Path, prefix: str) -> list[tuple[Any, ...]]:
    with sqlite3.connect(database) as conn:
        return conn.execute(
            "SELECT arm, drafter_version, drafted_tokens, accepted_tokens, generated_tokens, ttft_ms "
            "FROM acceptance_records WHERE request_id LIKE ?",
            (f"{prefix}%",),
        ).fetchall()


def _wait_for(database: Path, prefix: str, n: int) -> list[tuple[Any, ...]]:
    deadline = time.monotonic() + 30
    while len(rows := _records(database, prefix)) < n:
        assert time.monotonic() < deadline, f"{len(rows)} of {n} records arrived"
        time.sleep(0.3)
    return rows


def test_each_arm_is_served_by_its_fixed_backend_and_recorded_from_vllm_metrics(
    router_url: tuple[str, Path],
) -> None:
    url, database = router_url
    prefix = f"ref-{uuid.uuid4().hex[:8]}-"
    arms: dict[str, int] = {}
    with httpx.Client(timeout=60) as client:
        for i in range(36):
            reply = client.post(
                f"{url}/v1/completions",
                json={"model": "chat", "prompt": "The weather today is", "max_tokens": 12, "user": f"u{i}"},
                headers={"x-request-id": f"{prefix}{i}"},
            )
            assert reply.status_code == 200, reply.text
            assert "perf_metrics" not in reply.json()  # vLLM's shape only
            arms[reply.headers["x-speculation-arm"]] = arms.get(reply.headers["x-speculation-arm"], 0) + 1
    assert set(arms) == {"live", "canary:1", "baseline"}
    rows = _wait_for(database, prefix, 36)
    by_arm: dict[str, list[tuple[Any, ...]]] = {}
    for row in rows:
        by_arm.setdefault(row[0], []).append(row)
    assert {arm: len(v) for arm, v in by_arm.items()} == arms
    assert all(r[1] == 1 and r[2] > 0 for r in by_arm["canary:1"])
    assert all(r[1] is None and r[2] == 0 and r[4] == 12 for r in by_arm["baseline"])

    def hit(arm: str) -> float:
        return sum(r[3] for r in by_arm[arm]) / sum(r[2] for r in by_arm[arm])

    assert hit("canary:1") > 0.95 > hit("live")  # the never-missing drafter against the generic one


def test_streamed_chat_through_the_router_reaches_a_reference_server(router_url: tuple[str, Path]) -> None:
    url, database = router_url
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    request_id = f"refchat-{uuid.uuid4().hex}"
    stream = client.chat.completions.create(
        model="chat",
        messages=[{"role": "user", "content": "Tell me about the sea."}],
        max_tokens=10,
        stream=True,
        stream_options={"include_usage": True},  # exact token counts in the record
        user="carol",
        extra_headers={"x-request-id": request_id},
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text
    [row] = _wait_for(database, request_id, 1)
    assert row[4] == 10 and row[5] is not None and row[5] > 0
