"""Generated chat traffic (the chat and chat_structured domains) and the driver's chat route: streams
fixed by their seed, prompts that rarely repeat, held-out streams that share no document, prompt or
question with the others, structured requests whose expected answers are well formed, the request
body and route of a chat phase, the SmolLM2 scenarios, and a chat phase through the real reference
server (the committed reference target, which has no chat template: the plain rendering)."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from controlplane.router.acceptance import prompt_text
from controlplane.traces.holdout import normalised_prompt, prompt_hash
from workers import corpora
from workers.corpora import chat
from workers.demo import merge_knobs, planned_phases
from workers.serve.traffic import (
    API_PATHS,
    Phase,
    Scenario,
    TrafficDriver,
    completion_body,
    plan_figures,
    plan_requests,
)

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "workers" / "models" / "reference"
SMOLLM2 = [ROOT / "scenarios" / "smollm2.toml", ROOT / "scenarios" / "smollm2_partial.toml"]


def _draw(domain: str, n: int, seed: int = 1, *, heldout: bool = False) -> list[corpora.Prompt]:
    return list(itertools.islice(corpora.traffic_prompts(domain, "test", seed, heldout=heldout), n))


def _question(p: corpora.Prompt) -> str:
    return normalised_prompt(chat.last_user_turn(p.messages))


@pytest.mark.parametrize("domain", corpora.CHAT_DOMAINS)
def test_chat_streams_are_fixed_by_their_seed(domain: str) -> None:
    a, b = _draw(domain, 40), _draw(domain, 40)
    assert a == b
    assert [p.text for p in _draw(domain, 40, seed=2)] != [p.text for p in a]
    assert chat.document(domain, "test", 1, 7) == chat.document(domain, "test", 1, 7)
    for p in a:
        assert p.domain == p.category == domain and p.doc_id.startswith(f"{p.kind}:test:1:")
        assert p.text == chat.plain_text(p.messages) == prompt_text({"messages": list(p.messages)})
        assert p.messages[-1]["role"] == "user"
        roles = [m["role"] for m in p.messages if m["role"] != "system"]
        assert roles == ["user", "assistant"] * (len(roles) // 2) + ["user"]  # turns alternate


@pytest.mark.parametrize("heldout", [False, True], ids=["open", "heldout"])
@pytest.mark.parametrize("domain", corpora.CHAT_DOMAINS)
def test_chat_streams_rarely_repeat_a_prompt(domain: str, heldout: bool) -> None:
    # Deterministic (the streams are fixed by their seeds). Measured on 2,000 draws: chat repeats
    # 0 prompts and 2 questions (last user turns) on the open side, 7 prompts (0.35%) and 20
    # questions (1.0%) on the held-out side; chat_structured repeats none on either side.
    prompts = _draw(domain, 2000, heldout=heldout)
    hashes = [prompt_hash(p.text) for p in prompts]
    assert (len(hashes) - len(set(hashes))) / len(hashes) <= 0.02
    questions = [_question(p) for p in prompts]
    assert (len(questions) - len(set(questions))) / len(questions) <= 0.02
    kinds = {p.kind for p in prompts}
    assert kinds == (
        {"explain", "howto", "advise", "rewrite", "summarise", "compose"}
        if domain == "chat"
        else {"extract_json", "tool_call", "sql"}
    )


@pytest.mark.parametrize("domain", corpora.CHAT_DOMAINS)
def test_heldout_chat_streams_share_nothing_with_the_others(domain: str) -> None:
    held, other = _draw(domain, 600, heldout=True), _draw(domain, 1500, seed=2)
    assert all(corpora.is_heldout_document(corpora.document_key(domain, p.doc_id)) for p in held)
    assert not any(corpora.is_heldout_document(corpora.document_key(domain, p.doc_id)) for p in other)
    assert not {p.doc_id for p in held} & {p.doc_id for p in other}
    assert not {prompt_hash(p.text) for p in held} & {prompt_hash(p.text) for p in other}
    assert not {_question(p) for p in held} & {_question(p) for p in other}


def test_structured_requests_carry_well_formed_expected_answers() -> None:
    for p in _draw("chat_structured", 300):
        system, asked = p.messages[0]["content"], p.messages[-1]["content"]
        assert p.messages[0]["role"] == "system" and len(p.messages) >= 4  # one worked turn at least
        if p.kind == "sql":
            assert re.fullmatch(r"(SELECT|UPDATE|DELETE|INSERT) [^\n]+;", p.reference), p.reference
            assert all(f" {t} " not in p.reference or f"{t}(" in system for t in chat_tables())
            continue
        answer = json.loads(p.reference)
        if p.kind == "tool_call":
            assert f'"name": "{answer["name"]}"' in system  # the tool is among the schemas shown
            continue
        # Extraction: every value asked for is in the text, in the order the keys list them.
        found = [asked.find(str(value)) for value in answer.values()]
        assert all(i >= 0 for i in found) and found == sorted(found), (asked, p.reference)


def chat_tables() -> tuple[str, ...]:
    return ("customers", "orders", "products", "employees", "flights")


def test_a_chat_phase_needs_the_chat_route(tmp_path: Path) -> None:
    path = tmp_path / "s.toml"
    for bad, message in [
        ("[[phase]]\nmix = { chat = 1 }\nrequests = 1\n", "api"),
        ("[[phase]]\nmix = { chat_structured = 1 }\nrequests = 1\napi = 'completions'\n", "api"),
        ("[[phase]]\nmix = { prose = 1 }\nrequests = 1\napi = 'responses'\n", "api"),
        ("[[phase]]\nmix = { chatter = 1 }\nrequests = 1\napi = 'chat'\n", "unknown domain"),
    ]:
        path.write_text(bad)
        with pytest.raises(ValueError, match=message):
            Scenario.load(path)
    path.write_text("[defaults]\napi = 'chat'\n[[phase]]\nmix = { chat = 1, prose = 1 }\nrequests = 1\n")
    assert Scenario.load(path).phases[0].api == "chat"


def test_the_chat_body_keeps_every_field_of_a_completion() -> None:
    phase = Phase(
        name="c",
        mix={"chat_structured": 0.5, "structured": 0.5},
        requests=8,
        max_tokens=80,
        temperature=0.5,
        seed=4,
        stop_by_domain={"chat_structured": ("\n\n",)},
        api="chat",
    )
    planned = list(itertools.islice(plan_requests(phase), 8))
    assert {r.domain for r in planned} == {"chat_structured", "structured"}
    for req in planned:
        body = completion_body("svc", phase, req)
        assert "prompt" not in body and body["model"] == "svc" and body["max_tokens"] == 80
        assert body["category"] == req.domain and body["document"] == req.document
        assert body["perf_metrics_in_response"] is True and body["temperature"] == 0.5
        assert body["seed"] == (4 * 1_000_003 + req.index) % 2**31
        if req.domain == "chat_structured":
            assert body["messages"] == [dict(m) for m in req.messages] and body["stop"] == ["\n\n"]
        else:  # a completion domain's prompt goes as one user message
            assert body["messages"] == [{"role": "user", "content": req.prompt}] and "stop" not in body
    completions = completion_body("svc", Phase(name="p", mix={"structured": 1.0}, requests=1), planned[0])
    assert "messages" not in completions and completions["prompt"] == planned[0].prompt


def test_the_driver_posts_a_chat_phase_to_the_chat_route() -> None:
    seen: list[tuple[str, str, dict[str, Any]]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.path, request.headers["x-request-id"], json.loads(request.content)))
        record = {"drafted_tokens": 4, "accepted_tokens": 3, "generated_tokens": 5, "arm": "live"}
        return httpx.Response(
            200,
            json={
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "x"}}],
                "usage": {"completion_tokens": 5},
                "speculation_record": record,
            },
        )

    phases = [
        Phase(name="chat", mix={"chat": 1.0}, requests=3, api="chat", seed=1),
        Phase(name="structured", mix={"structured": 1.0}, requests=2, seed=1),
    ]
    driver = TrafficDriver("http://s", "m", run_id="r", transport=httpx.MockTransport(handler))
    chat_report, _ = driver.run(phases)
    assert chat_report.hit_rate == pytest.approx(0.75) and chat_report.completion_tokens == 15
    assert [(path, rid) for path, rid, _ in seen] == [
        *((API_PATHS["chat"], f"r-p0-{i}") for i in range(3)),
        *((API_PATHS["completions"], f"r-p1-{i}") for i in range(2)),
    ]
    planned = list(itertools.islice(plan_requests(phases[0]), 3))
    assert [body["messages"] for _, _, body in seen[:3]] == [[dict(m) for m in r.messages] for r in planned]
    assert [body["document"] for _, _, body in seen[:3]] == [r.document for r in planned]


@pytest.mark.parametrize("path", SMOLLM2, ids=lambda p: p.name)
def test_smollm2_scenarios_plan_and_parse_as_the_demo_reads_them(path: Path) -> None:
    import tomllib

    raw = tomllib.loads(path.read_text())
    scenario = Scenario.from_dict(raw)
    assert all(p.api == "chat" for p in scenario.phases)
    assert [p.heldout for p in scenario.phases] == [False, False, True]
    assert scenario.phases[0].mix == {"chat": 1.0} and "chat_structured" in scenario.phases[1].mix
    assert all(
        p.stop_for("chat_structured") == ("\n\n",) and p.stop_for("chat") == () for p in scenario.phases
    )
    knobs = raw["demo"]
    assert knobs["target_model"] == "smollm2-135m-instruct" and knobs["draft_model"] == ""
    fast = merge_knobs(knobs, knobs["fast"])
    for phases in (
        planned_phases(scenario, False, None, []),
        planned_phases(scenario, True, fast["max_tokens"], fast["phase_requests"]),
    ):
        figures = plan_figures(phases)
        assert all(f.repeat_share is not None and f.repeat_share <= 0.02 for f in figures)
        assert figures[-1].heldout_prompt_overlap == 0
        planned = [list(itertools.islice(plan_requests(p), p.requests)) for p in phases[:2]]
        held = list(itertools.islice(plan_requests(phases[2]), phases[2].requests))
        others = [r for rs in planned for r in rs]
        assert not {r.document for r in held} & {r.document for r in others}
        assert not {prompt_hash(r.prompt) for r in held} & {prompt_hash(r.prompt) for r in others}


def test_a_chat_phase_through_the_reference_server() -> None:
    """The real server app in-process: the chat route renders the messages (the reference target has
    no chat template: the plain rendering, the same text the ledger counts), and the record and the
    trace carry the category and the source document."""
    from workers.serve.server import ServerConfig, create_app

    entry = {"target_path": str(REFERENCE / "target"), "speculation": "disabled", "trace_sample_rate": 1.0}
    records: list[dict[str, Any]] = []
    traces: list[tuple[Any, ...]] = []
    app = create_app(
        ServerConfig(
            serving_config={"demo": entry},
            on_record=lambda m, r: records.append(r),
            on_trace=lambda *t: traces.append(t),
        )
    )
    # Seed 9: one chat and three structured requests whose prompts fit the reference target's
    # 512-token context (a structured prompt with three worked tool calls may not; SmolLM2 has 8k).
    phase = Phase(
        name="chat",
        mix={"chat": 0.5, "chat_structured": 0.5},
        requests=4,
        max_tokens=6,
        seed=9,
        api="chat",
        stop_by_domain={"chat_structured": ("\n\n",)},
    )
    driver = TrafficDriver("http://ref", "demo", run_id="c", transport=httpx.ASGITransport(app=app))
    (report,) = driver.run([phase])
    assert report.requests == 4 and report.errors == 0 and report.completion_tokens > 0
    planned = {r.document: r for r in itertools.islice(plan_requests(phase), 4)}
    assert sorted(r["request_id"] for r in records) == [f"c-p0-{i}" for i in range(4)]
    assert sorted(r["category"] for r in records) == sorted(r.category for r in planned.values())
    assert len(traces) == 4
    for _model, prompt, _completion, category, document in traces:
        assert prompt == planned[document].prompt and category == planned[document].category
