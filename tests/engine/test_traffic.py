"""The traffic driver: scenario parsing, deterministic prompt order, prompts that do not repeat and
held-out phases that share nothing with the others (every shipped scenario, planned), aggregation,
callbacks, and a tiny scenario against the reference server with the committed reference models."""

from __future__ import annotations

import itertools
import json
import threading
import tomllib
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from controlplane.traces.holdout import prompt_hash
from workers.demo import FAST_OVERRIDES
from workers.serve.traffic import (
    Callbacks,
    Phase,
    PhaseReport,
    PromptLedger,
    RequestResult,
    Scenario,
    TrafficDriver,
    fireworks_counts,
    plan_figures,
    plan_requests,
)

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "workers" / "models" / "reference"

TINY = """
[server]
url = "http://server.test"
model = "svc"

[defaults]
max_tokens = 8
concurrency = 2

[[phase]]
name = "prose"
mix = { prose = 1.0 }
requests = 6
seed = 1

[[phase]]
name = "shift"
mix = { structured = 3, tool = 1, prose = 0 }
requests = 8
seed = 2
temperature = 0.7
stop = "\\nUser:"
"""


def test_default_scenario_parses() -> None:
    scenario = Scenario.load(ROOT / "scenarios" / "demo.toml")
    assert scenario.model and scenario.url.startswith("http")
    assert len(scenario.phases) >= 2 and all(p.split == "test" for p in scenario.phases)


def test_scenario_keys_and_mix(tmp_path: Path) -> None:
    path = tmp_path / "s.toml"
    path.write_text(TINY)
    scenario = Scenario.load(path)
    prose, shift = scenario.phases
    assert (prose.max_tokens, prose.concurrency, prose.requests) == (8, 2, 6)
    assert shift.mix == {"structured": 1.0} and shift.temperature == 0.7
    assert shift.stop == ("\nUser:",) and prose.stop == ()
    for bad, message in [
        ("[[phase]]\nmix = { poetry = 1 }\nrequests = 1\n", "unknown domain"),
        ("[[phase]]\nmix = { prose = 1 }\n", "requests"),
        ("[[phase]]\nmix = { prose = 1 }\nrequests = 1\nrps = 3\n", "unknown key"),
        ("[server]\n", "at least one"),
        ("[[phase]]\nmix = { prose = 1 }\nrequests = 1\nstop = ''\n", "stop"),
        ("[[phase]]\nmix = { prose = 1 }\nrequests = 1\nstop = ['a','b','c','d','e']\n", "stop"),
        ("[[phase]]\nmix = { prose = 1 }\nrequests = 1\nstop = 3\n", "stop"),
        ("[[phase]]\nmix = { prose = 1 }\nrequests = 1\nstop = []\n", "stop"),
    ]:
        path.write_text(bad)
        with pytest.raises(ValueError, match=message):
            Scenario.load(path)


def test_prompt_order_is_fixed_by_the_seed() -> None:
    phase = Phase(name="mix", mix={"prose": 0.5, "structured": 0.5}, requests=60, seed=3)

    def first(n: int, p: Phase) -> list[tuple[str, str]]:
        it = plan_requests(p)
        return [(r.domain, r.prompt) for r in (next(it) for _ in range(n))]

    a, b = first(60, phase), first(60, phase)
    assert a == b
    assert first(60, Phase(name="mix", mix=phase.mix, requests=60, seed=4)) != a
    shares = sum(d == "prose" for d, _ in a) / len(a)
    assert 0.3 < shares < 0.7
    # Far more requests than the prose test split has documents (25): every one a new window.
    prose = first(400, Phase(name="p", mix={"prose": 1.0}, requests=400, seed=1))
    assert len(set(prose)) >= 396


SCENARIOS = sorted((ROOT / "scenarios").glob("*.toml"))


def _sizes(path: Path) -> dict[str, tuple[Phase, ...]]:
    """A scenario's phases at their full counts and at the demo's `--fast` counts."""
    with open(path, "rb") as f:
        raw = tomllib.load(f)
    phases = Scenario.from_dict(raw).phases
    fast = raw.get("demo", {}).get("fast", {}).get("phase_requests", FAST_OVERRIDES["phase_requests"])
    return {"full": phases, "fast": tuple(replace(p, requests=n) for p, n in zip(phases, fast, strict=True))}


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: p.name)
def test_no_scenario_phase_repeats_more_than_two_percent(path: Path) -> None:
    # Deterministic: the plan is fixed by the phases' seeds. Measured (bench/traffic_repeats.py):
    # at most 0.5% on any phase, the partial shift's prose windows (pools of 220,000-510,000
    # windows per side of the held-out partition); the old cycled pool repeated up to 94%.
    for label, phases in _sizes(path).items():
        for phase, figures in zip(phases, plan_figures(phases), strict=True):
            assert figures.requests == phase.requests
            assert figures.repeat_share is not None and figures.repeat_share <= 0.02, (label, phase.name)


@pytest.mark.parametrize("path", [p for p in SCENARIOS if p.name in {"demo.toml", "partial_shift.toml"}])
def test_after_promotion_phases_are_held_out_and_share_nothing(path: Path) -> None:
    phases = _sizes(path)["full"]
    assert phases[-1].heldout and not any(p.heldout for p in phases[:-1])
    planned = [list(itertools.islice(plan_requests(p), p.requests)) for p in phases]
    heldout = planned[-1]
    others = [r for phase in planned[:-1] for r in phase]
    assert not {r.document for r in heldout} & {r.document for r in others}
    assert not {prompt_hash(r.prompt) for r in heldout} & {prompt_hash(r.prompt) for r in others}
    # The ledger's own count of the same thing, as the driver reports it.
    assert plan_figures(phases)[-1].heldout_prompt_overlap == 0
    assert all(f.heldout_prompt_overlap is None for f in plan_figures(phases)[:-1])


def test_the_ledger_counts_repeats_across_phases_and_overlap_with_open_phases() -> None:
    # The same seed twice: the second phase repeats the first's prompts (and documents) one for one.
    open_phase = Phase(name="a", mix={"prose": 1.0}, requests=20, seed=5)
    figures = plan_figures([open_phase, replace(open_phase, name="b"), replace(open_phase, name="c")])
    assert (figures[0].repeats, figures[1].repeats, figures[1].repeat_share) == (0, 20, 1.0)
    # A held-out phase draws from its own documents: nothing in common with the open phase ...
    held = replace(open_phase, name="h", heldout=True)
    assert plan_figures([open_phase, held])[1].heldout_prompt_overlap == 0
    # ... and the ledger does see it when a held-out phase's prompts were sent by an open phase too.
    ledger = PromptLedger()
    requests = list(itertools.islice(plan_requests(held), 5))
    open_tally, held_tally = ledger.open_phase(heldout=False), ledger.open_phase(heldout=True)
    for r in requests[:2]:
        ledger.record(open_tally, r)
    for r in requests:
        ledger.record(held_tally, r)
    open_documents = {r.document for r in requests[:2]}
    expected = sum(i < 2 or r.document in open_documents for i, r in enumerate(requests))
    assert ledger.figures(held_tally).heldout_prompt_overlap == expected >= 2
    assert ledger.figures(held_tally).repeats == 2


def test_drivers_sharing_a_ledger_count_repeats_across_them() -> None:
    # The demo drives each phase with its own driver (a run id per phase): one ledger spans them.
    phase = Phase(name="a", mix={"structured": 1.0}, requests=4, seed=8)
    ledger = PromptLedger()
    sent: list[dict[str, Any]] = []
    (first,) = TrafficDriver("http://s", "m", transport=_fake_server(sent), ledger=ledger).run([phase])
    (again,) = TrafficDriver("http://s", "m", transport=_fake_server(sent), ledger=ledger).run([phase])
    (alone,) = TrafficDriver("http://s", "m", transport=_fake_server(sent)).run([phase])
    assert (first.repeat_share, again.repeat_share, alone.repeat_share) == (0.0, 1.0, 0.0)


def test_heldout_must_be_a_boolean(tmp_path: Path) -> None:
    path = tmp_path / "s.toml"
    path.write_text("[[phase]]\nmix = { prose = 1 }\nrequests = 1\nheldout = true\n")
    assert Scenario.load(path).phases[0].heldout is True
    path.write_text("[[phase]]\nmix = { prose = 1 }\nrequests = 1\nheldout = 'yes'\n")
    with pytest.raises(ValueError, match="heldout"):
        Scenario.load(path)


def _fake_server(requests: list[dict[str, Any]]) -> httpx.MockTransport:
    lock = threading.Lock()

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        rid = request.headers["x-request-id"]
        with lock:
            requests.append({**body, "id": rid})
        if body["prompt"].startswith("FAIL"):
            return httpx.Response(500, json={"error": {"message": "boom"}})
        structured = body["category"] == "structured"
        record = {
            "request_id": rid,
            "drafted_tokens": 10,
            "accepted_tokens": 2 if structured else 8,
            "generated_tokens": 8,
            "arm": "canary:2" if structured else "live",
            "drafter_version": 2 if structured else 1,
        }
        return httpx.Response(
            200,
            json={
                "id": rid,
                "choices": [{"text": "x", "index": 0, "finish_reason": "length"}],
                "usage": {"completion_tokens": 8, "prompt_tokens": 5},
                # Fireworks' shape: G = completion tokens - 1, acceptance as "position:hits/total".
                "perf_metrics": {
                    "speculation-generated-tokens": 7,
                    "speculation-acceptance": "0:1/1",
                    "server-time-to-first-token": 0.01,
                },
                "speculation_record": record,
            },
        )

    return httpx.MockTransport(handler)


def test_driver_sends_in_order_aggregates_and_calls_back(tmp_path: Path) -> None:
    path = tmp_path / "s.toml"
    path.write_text(TINY)
    scenario = Scenario.load(path)
    sent: list[dict[str, Any]] = []
    events: list[tuple[str, Any]] = []
    driver = TrafficDriver(scenario.url, scenario.model, run_id="run1", transport=_fake_server(sent))
    reports = driver.run(
        scenario.phases,
        Callbacks(
            on_phase_start=lambda n, p: events.append(("start", p.name)),
            on_result=lambda n, p, r: events.append(("result", r.request_id)),
            on_phase_end=lambda n, p, rep: events.append(("end", rep.requests)),
        ),
    )
    prose, shift = reports
    assert isinstance(prose, PhaseReport) and (prose.requests, shift.requests) == (6, 8)
    assert prose.hit_rate == pytest.approx(0.8) and shift.hit_rate == pytest.approx(0.2)
    assert shift.by_arm["canary:2"].requests == 8 and prose.by_domain["prose"].requests == 6
    assert prose.completion_tokens == 48 and prose.tokens_per_s > 0
    assert prose.latency_p50_s is not None and prose.latency_p95_s is not None
    assert prose.latency_p50_s <= prose.latency_p95_s
    assert events[0] == ("start", "prose") and events[7] == ("end", 6) and events[-1] == ("end", 8)
    ids = sorted(r["id"] for r in sent)
    assert ids == sorted([f"run1-p0-{i}" for i in range(6)] + [f"run1-p1-{i}" for i in range(8)])
    first = {r["id"]: r for r in sent}
    assert first["run1-p0-0"]["perf_metrics_in_response"] is True
    assert "seed" not in first["run1-p0-0"] and "seed" in first["run1-p1-0"]  # sampled: reproducible
    assert "stop" not in first["run1-p0-0"] and first["run1-p1-0"]["stop"] == ["\nUser:"]
    # Each request names its source document beside its category.
    assert all(r["document"].startswith(f"{r['category']}:") for r in sent)
    planned = {
        f"run1-p0-{r.index}": r.document for r in itertools.islice(plan_requests(scenario.phases[0]), 6)
    }
    assert {rid: first[rid]["document"] for rid in planned} == planned
    assert prose.repeat_share == 0.0 and prose.heldout_prompt_overlap is None and not prose.heldout
    # The same scenario and run id send the same prompts to the same request ids.
    again: list[dict[str, Any]] = []
    TrafficDriver(scenario.url, scenario.model, run_id="run1", transport=_fake_server(again)).run(
        scenario.phases
    )
    assert {r["id"]: r["prompt"] for r in again} == {r["id"]: r["prompt"] for r in sent}


def test_duration_rate_and_stop() -> None:
    sent: list[dict[str, Any]] = []
    driver = TrafficDriver("http://s", "m", transport=_fake_server(sent))
    # 20 requests/s for 0.5 s: about 10 are sent, never the 1,000 asked for.
    (report,) = driver.run([Phase(name="r", mix={"prose": 1.0}, requests=1000, duration_s=0.5, rate=20.0)])
    assert 5 <= report.requests <= 12
    stop_after: list[RequestResult] = []
    reports = driver.run(
        [Phase(name="a", mix={"code": 1.0}, requests=50), Phase(name="b", mix={"code": 1.0}, requests=50)],
        Callbacks(on_result=lambda n, p, r: stop_after.append(r)),
        should_stop=lambda: len(stop_after) >= 3,
    )
    assert len(reports) == 1 and reports[0].requests == 3


def test_errors_are_counted_not_raised() -> None:
    def failing(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503, json={"error": {"message": "down"}})

    driver = TrafficDriver("http://s", "m", transport=httpx.MockTransport(failing))
    (report,) = driver.run([Phase(name="x", mix={"prose": 1.0}, requests=3)])
    assert report.errors == 3 and report.hit_rate is None and report.latency_p50_s is None


def test_fireworks_only_responses_count_from_the_acceptance_pairs() -> None:
    """A Fireworks deployment sends no speculation_record: counts come from the "position:hits/total"
    pairs, and speculation-generated-tokens (tokens the verify steps emitted) is not read as drafts."""

    def fireworks(request: httpx.Request) -> httpx.Response:
        perf = {"speculation-generated-tokens": 11, "speculation-acceptance": "0:5/6,1:2/5"}
        return httpx.Response(
            200,
            json={
                "choices": [{"text": "x", "index": 0, "finish_reason": "length"}],
                "usage": {"completion_tokens": 12, "prompt_tokens": 5},
                "perf_metrics": perf,
            },
        )

    driver = TrafficDriver("http://s", "m", transport=httpx.MockTransport(fireworks))
    (report,) = driver.run([Phase(name="x", mix={"prose": 1.0}, requests=2)])
    assert (report.drafted_tokens, report.accepted_tokens) == (22, 14)
    assert fireworks_counts("0:5/6,1:2/5") == (7, 11) and fireworks_counts([0.5]) == (0, 0)


def test_tiny_scenario_against_the_reference_server() -> None:
    """The real server app (reference target + generic drafter) in-process over ASGI."""
    from workers.serve.server import ServerConfig, create_app

    entry = {
        "target_path": str(REFERENCE / "target"),
        "arms": [
            {
                "arm": "live",
                "weight": 1.0,
                "speculation": "draft_model",
                "drafter_path": str(REFERENCE / "generic-drafter"),
                "drafter_version": 1,
                "k": 4,
            }
        ],
    }
    records: list[dict[str, Any]] = []
    app = create_app(ServerConfig(serving_config={"demo": entry}, on_record=lambda m, r: records.append(r)))
    driver = TrafficDriver("http://ref", "demo", run_id="tiny", transport=httpx.ASGITransport(app=app))
    (report,) = driver.run(
        [Phase(name="mixed", mix={"prose": 1.0, "structured": 1.0}, requests=4, max_tokens=12, concurrency=2)]
    )
    assert report.requests == 4 and report.errors == 0
    assert report.hit_rate is not None and 0.0 <= report.hit_rate <= 1.0
    assert report.completion_tokens > 0 and report.by_arm["live"].requests == 4
    assert sorted(r["request_id"] for r in records) == [f"tiny-p0-{i}" for i in range(4)]
    assert {r["category"] for r in records} <= {"prose", "structured"}
