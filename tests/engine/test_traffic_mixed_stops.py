"""A mixed phase whose domains end differently: `stop_by_domain` sends each request its own
domain's stop strings, and the phase's `stop` for the other domains."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from workers.serve.traffic import Scenario, TrafficDriver

MIXED = """
[server]
url = "http://test"
model = "demo"

[[phase]]
name = "half structured"
mix = { prose = 1, tool = 1 }
requests = 40
seed = 4
stop_by_domain = { tool = "\\n" }
"""


def _recording_server(sent: list[dict[str, Any]]) -> httpx.MockTransport:
    lock = threading.Lock()

    def handler(request: httpx.Request) -> httpx.Response:
        with lock:
            sent.append(json.loads(request.content))
        return httpx.Response(
            200,
            json={
                "id": request.headers["x-request-id"],
                "choices": [{"text": "x", "index": 0, "finish_reason": "stop"}],
                "usage": {"completion_tokens": 1, "prompt_tokens": 5},
            },
        )

    return httpx.MockTransport(handler)


def test_each_domain_of_a_mixed_phase_gets_its_own_stop(tmp_path: Path) -> None:
    path = tmp_path / "mixed.toml"
    path.write_text(MIXED)
    scenario = Scenario.load(path)
    [phase] = scenario.phases
    assert phase.stop_by_domain == {"structured": ("\n",)} and phase.stop == ()
    assert phase.stop_for("structured") == ("\n",) and phase.stop_for("prose") == ()
    sent: list[dict[str, Any]] = []
    TrafficDriver(scenario.url, scenario.model, run_id="mix", transport=_recording_server(sent)).run([phase])
    by_category: dict[str, list[dict[str, Any]]] = {}
    for body in sent:
        by_category.setdefault(body["category"], []).append(body)
    assert set(by_category) == {"prose", "structured"}
    assert all(body["stop"] == ["\n"] for body in by_category["structured"])
    assert all("stop" not in body for body in by_category["prose"])
    # Both domains name their source document, as the held-out split by document needs.
    assert all(body["document"].startswith(f"{body['category']}:") for body in sent)


@pytest.mark.parametrize(
    ("table", "problem"),
    [("stop_by_domain = 3", "stop_by_domain"), ("stop_by_domain = { poetry = 'x' }", "poetry")],
)
def test_bad_stop_tables_are_refused(tmp_path: Path, table: str, problem: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(f"[[phase]]\nmix = {{ prose = 1 }}\nrequests = 1\n{table}\n")
    with pytest.raises(ValueError, match=problem):
        Scenario.load(path)
