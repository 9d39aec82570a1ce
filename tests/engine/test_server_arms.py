"""The reference server's live-canary side: weighted arms by request-id hash, trace sampling, and
the background reporter that posts records and traces to the control plane."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from workers.engine.hf_io import save_hf_folder
from workers.engine.model import Transformer
from workers.engine.tokenizer import Tokenizer
from workers.serve.reporter import ControlPlaneReporter
from workers.serve.server import ServerConfig, ServingPlan, create_app, http_serving_config, unit_interval

PROMPT = "def add(a, b):\n    return"


def three_arms(target: str = "t", drafter: str = "d", canary: str = "c") -> dict[str, Any]:
    return {
        "model": "svc",
        "config_version": "7",
        "target_path": target,
        "target_sha256": None,
        "arms": [
            {
                "arm": "live",
                "weight": 0.8,
                "speculation": "draft_model",
                "drafter_path": drafter,
                "drafter_sha256": None,
                "drafter_version": 1,
                "k": 3,
                "ngram_length": 3,
            },
            {
                "arm": "canary:2",
                "weight": 0.1,
                "speculation": "draft_model",
                "drafter_path": canary,
                "drafter_sha256": None,
                "drafter_version": 2,
                "k": 5,
                "ngram_length": 3,
            },
            {
                "arm": "baseline",
                "weight": 0.1,
                "speculation": "disabled",
                "drafter_path": None,
                "drafter_sha256": None,
                "drafter_version": None,
                "k": 3,
                "ngram_length": 3,
            },
        ],
    }


# ------------------------------------------------------------------------------------ pure routing


def test_weights_are_honoured_over_many_request_ids() -> None:
    plan = ServingPlan.parse("svc", three_arms())
    n = 20_000
    counts = Counter(plan.assign(f"cmpl-{i}").name for i in range(n))
    # Deterministic: the ids are fixed and hashed with sha256, so the shares change only if the rule
    # does. For 20,000 random ids the 1-point margins are 4.7 sd (10 % shares, 2.6e-6 each) and 3.5 sd
    # (the 80 % share, 4.6e-4).
    # Binomial sd of a 10% share over 20,000 ids is 0.2 percentage points; allow 1.
    assert abs(counts["live"] / n - 0.8) < 0.01
    assert abs(counts["canary:2"] / n - 0.1) < 0.01
    assert abs(counts["baseline"] / n - 0.1) < 0.01


def test_assignment_is_deterministic_and_the_same_in_every_process() -> None:
    plan = ServingPlan.parse("svc", three_arms())
    again = ServingPlan.parse("svc", three_arms())
    ids = [f"req-{i}" for i in range(200)]
    assert [plan.assign(i).name for i in ids] == [again.assign(i).name for i in ids]
    # sha256, not Python's salted hash(): these values hold on any machine and interpreter run.
    assert unit_interval("req-4") == pytest.approx(int("0x" + _sha("req-4")[:16], 16) / 2.0**64)
    expected = {0: "live", 4: "canary:2", 6: "baseline", 7: "live"}
    assert {i: plan.assign(f"req-{i}").name for i in expected} == expected


def _sha(text: str) -> str:
    import hashlib

    return hashlib.sha256(text.encode()).hexdigest()


def test_weights_need_not_sum_to_one_and_zero_weight_arms_never_serve() -> None:
    raw = three_arms()
    raw["arms"][0]["weight"], raw["arms"][1]["weight"], raw["arms"][2]["weight"] = 3.0, 0.0, 1.0
    plan = ServingPlan.parse("svc", raw)
    counts = Counter(plan.assign(str(i)).name for i in range(8000))
    assert counts["canary:2"] == 0
    # Deterministic: fixed ids (for random ids 0.02 is 4.1 sd of a 75 % share over 8,000: 4e-5).
    assert abs(counts["live"] / 8000 - 0.75) < 0.02


def test_flat_entry_is_one_implicit_arm() -> None:
    plan = ServingPlan.parse(
        "m", {"target_path": "t", "speculation": "ngram", "k": 4, "trace_sample_rate": 0.25}
    )
    assert [(a.name, a.weight) for a in plan.arms] == [("live", 1.0)]
    assert plan.arms[0].deployment.speculation == "ngram"
    assert plan.trace_sample_rate == 0.25 and plan.config_version is None
    assert ServingPlan.parse("m", {"target_path": "t", "arm": "baseline"}).assign("x").name == "baseline"


def test_arms_inherit_top_level_keys_and_can_override_them() -> None:
    raw = three_arms()
    raw["max_len"] = 128
    raw["arms"][1]["target_path"] = "other-target"
    plan = ServingPlan.parse("svc", raw)
    deps = {a.name: a.deployment for a in plan.arms}
    assert deps["live"].target_path == "t" and deps["canary:2"].target_path == "other-target"
    assert deps["canary:2"].k == 5 and deps["canary:2"].drafter_version == 2
    assert deps["baseline"].speculation == "disabled" and all(d.max_len == 128 for d in deps.values())
    assert plan.config_version == "7" and plan.model == "svc"


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda r: r.update(arms=[]), "no arms"),
        (lambda r: r["arms"][0].update(weight=-1), "negative"),
        (lambda r: [a.update(weight=0) for a in r["arms"]], "sum to zero"),
        (lambda r: r["arms"][1].update(arm="live"), "repeat"),
        (lambda r: r.update(trace_sample_rate=1.5), "trace_sample_rate"),
        (lambda r: r["arms"][0].update(drafter_path=None), "without a drafter_path"),
    ],
)
def test_bad_configs_are_refused(mutate: Any, message: str) -> None:
    raw = three_arms()
    mutate(raw)
    with pytest.raises(ValueError, match=message):
        ServingPlan.parse("svc", raw)


# ------------------------------------------------------------------------------- through the server


@pytest.fixture(scope="module")
def folders(
    target: Transformer, drafter: Transformer, tokenizer: Tokenizer, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, str]:
    root = tmp_path_factory.mktemp("arm-models")
    save_hf_folder(target, tokenizer, root / "target")
    save_hf_folder(drafter, tokenizer, root / "drafter")
    save_hf_folder(target, tokenizer, root / "canary")  # a perfect drafter: the target itself
    return {p.name: str(p) for p in Path(root).iterdir()}


def test_requests_are_served_by_their_arm_and_records_say_which(folders: dict[str, str]) -> None:
    config = three_arms(folders["target"], folders["drafter"], folders["canary"])
    config["trace_sample_rate"] = 0.5
    records: list[tuple[str, dict[str, Any]]] = []
    traces: list[tuple[str, str, str, str | None, str | None]] = []
    app = create_app(
        ServerConfig(
            serving_config={"svc": config},
            on_record=lambda m, r: records.append((m, r)),
            on_trace=lambda m, p, c, cat, doc: traces.append((m, p, c, cat, doc)),
        )
    )
    plan = ServingPlan.parse("svc", config)
    ids = [f"arm-test-{i}" for i in range(40)]
    texts: dict[str, set[str]] = {}
    with TestClient(app) as client:
        for rid in ids:
            resp = client.post(
                "/v1/completions",
                json={
                    "model": "svc",
                    "prompt": PROMPT,
                    "max_tokens": 10,
                    "temperature": 0,
                    "perf_metrics_in_response": True,
                    "category": "code",
                    "document": f"code:doc-{rid}",
                },
                headers={"x-request-id": rid},
            )
            assert resp.status_code == 200, resp.text
            body = resp.json()
            record = body["speculation_record"]
            assert record["arm"] == plan.assign(rid).name
            texts.setdefault(record["arm"], set()).add(body["choices"][0]["text"])
    assert set(texts) == {"live", "canary:2", "baseline"}  # 40 ids reach every arm (checked above)
    assert len({t for s in texts.values() for t in s}) == 1  # greedy: lossless on every arm
    by_arm = {r["arm"]: r for _, r in records}
    assert (by_arm["live"]["drafter_version"], by_arm["live"]["k"]) == (1, 3)
    assert (by_arm["canary:2"]["drafter_version"], by_arm["canary:2"]["k"]) == (2, 5)
    assert by_arm["baseline"]["drafter_version"] is None and by_arm["baseline"]["drafted_tokens"] == 0
    # The target drafting for itself accepts everything it drafts.
    assert by_arm["canary:2"]["accepted_tokens"] == by_arm["canary:2"]["drafted_tokens"] > 0
    assert all(r["category"] == "code" for _, r in records) and len(records) == len(ids)
    # Traces: exactly the ids whose trace hash falls under the rate, with prompt and completion.
    sampled = [rid for rid in ids if unit_interval("trace:" + rid) < 0.5]
    assert 5 < len(sampled) < 35 and len(traces) == len(sampled)
    assert all(t[0] == "svc" and t[1] == PROMPT and t[2] and t[3] == "code" for t in traces)
    assert sorted(t[4] for t in traces) == sorted(f"code:doc-{rid}" for rid in sampled)
    assert all("document" not in r for _, r in records)  # a trace's field, not an acceptance record's


@pytest.mark.parametrize("document", ["", "   ", "x" * 201, 7, ["doc"], "doc\x00"])
def test_a_malformed_document_is_the_clients_400(folders: dict[str, str], document: Any) -> None:
    entry = {"target_path": folders["target"], "speculation": "disabled"}
    traces: list[Any] = []
    app = create_app(
        ServerConfig(serving_config={"m": entry}, on_trace=lambda *t: traces.append(t), trace_sample_rate=1.0)
    )
    with TestClient(app) as client:
        for path, body in (
            ("/v1/completions", {"prompt": PROMPT}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ):
            resp = client.post(path, json={"model": "m", "max_tokens": 2, "document": document, **body})
            assert resp.status_code == 400, resp.text
            assert resp.json()["error"]["param"] == "document"
        resp = client.post(
            "/v1/completions", json={"model": "m", "prompt": PROMPT, "max_tokens": 2, "document": "d" * 200}
        )
        assert resp.status_code == 200, resp.text
    assert [t[4] for t in traces] == ["d" * 200]


def test_trace_rate_falls_back_to_the_server_default(folders: dict[str, str]) -> None:
    entry = {"target_path": folders["target"], "speculation": "disabled"}
    traces: list[Any] = []
    app = create_app(
        ServerConfig(serving_config={"m": entry}, on_trace=lambda *t: traces.append(t), trace_sample_rate=1.0)
    )
    with TestClient(app) as client:
        for _ in range(3):
            client.post("/v1/completions", json={"model": "m", "prompt": PROMPT, "max_tokens": 4})
    assert len(traces) == 3 and traces[0][3] is None and traces[0][4] is None


# ----------------------------------------------------------------------------- control-plane links


class FakeControlPlane:
    """An httpx handler standing in for the control plane: serving config, acceptance, traces."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        self.config = dict(config)
        self.posts: list[tuple[str, dict[str, Any], str | None]] = []
        self.config_gets = 0
        self.fail_next = 0
        self.down = False
        self.lock = threading.Lock()

    def __call__(self, request: httpx.Request) -> httpx.Response:
        import json

        if self.down:
            raise httpx.ConnectError("control plane down", request=request)
        path = request.url.path
        auth = request.headers.get("authorization")
        if path.endswith("/serving-config"):
            self.config_gets += 1
            if "/deployments/svc/" not in path:
                return httpx.Response(404, json={"error": {"message": "no such deployment"}})
            return httpx.Response(200, json=self.config)
        with self.lock:
            if self.fail_next:
                self.fail_next -= 1
                return httpx.Response(503, json={"error": {"message": "busy"}})
            if path.endswith("/traces") and any(
                not t.get("completion") for t in json.loads(request.content)["traces"]
            ):
                return httpx.Response(422, json={"error": {"message": "bad trace"}})
            self.posts.append((path, json.loads(request.content), auth))
        return httpx.Response(200, json={"stored": 1})


BASE = "http://cp.test/v1/accounts/acme/deployments/{model}"


def test_reporter_batches_records_and_traces_per_deployment() -> None:
    fake = FakeControlPlane({})
    reporter = ControlPlaneReporter(
        BASE,
        api_key="sekret",
        client=httpx.Client(transport=httpx.MockTransport(fake)),
        flush_interval_s=0.05,
    )
    for i in range(7):
        reporter.record("svc", {"request_id": f"r{i}"})
    reporter.record("other", {"request_id": "o1"})
    reporter.trace("svc", "p", "c", "prose")
    reporter.trace("svc", "p2", "c2", None, "structured:doc-9")
    assert reporter.flush(10)
    reporter.close()
    paths = Counter(p for p, _, _ in fake.posts)
    assert paths["/v1/accounts/acme/deployments/svc/acceptance"] >= 1
    assert paths["/v1/accounts/acme/deployments/other/acceptance"] == 1
    sent = [r["request_id"] for p, b, _ in fake.posts if p.endswith("svc/acceptance") for r in b["records"]]
    assert sent == [f"r{i}" for i in range(7)]
    trace_bodies = [b for p, b, _ in fake.posts if p.endswith("/traces")]
    assert trace_bodies == [
        {
            "traces": [
                {"prompt": "p", "completion": "c", "category": "prose"},
                {"prompt": "p2", "completion": "c2", "document": "structured:doc-9"},
            ]
        }
    ]
    assert all(auth == "Bearer sekret" for _, _, auth in fake.posts)
    assert reporter.stats.posted == {"acceptance": 8, "traces": 2} and reporter.stats.dropped_failed == 0


def test_reporter_retries_server_errors_and_drops_refused_batches() -> None:
    fake = FakeControlPlane({})
    fake.fail_next = 2
    sleeps: list[float] = []
    reporter = ControlPlaneReporter(
        BASE,
        client=httpx.Client(transport=httpx.MockTransport(fake)),
        flush_interval_s=0.05,
        sleep=sleeps.append,
    )
    reporter.record("svc", {"request_id": "a"})
    assert reporter.flush(10)
    assert reporter.stats.posted["acceptance"] == 1 and sleeps == [0.5, 1.0]
    reporter.trace("svc", "p", "")  # the fake refuses an empty completion with 422: no retry
    assert reporter.flush(10)
    reporter.close()
    assert reporter.stats.dropped_failed == 1 and "422" in (reporter.stats.last_error or "")


def test_reporter_never_blocks_when_its_queue_is_full() -> None:
    gate = threading.Event()

    def slow(request: httpx.Request) -> httpx.Response:
        gate.wait(10)
        return httpx.Response(200, json={})

    reporter = ControlPlaneReporter(
        BASE, client=httpx.Client(transport=httpx.MockTransport(slow)), max_queue=5, flush_interval_s=0.01
    )
    for i in range(200):  # the consumer is stuck in its first POST: at most a few fit
        reporter.record("svc", {"request_id": str(i)})
    assert reporter.stats.dropped_full >= 150
    gate.set()
    assert reporter.flush(10)
    reporter.close()


def test_server_posts_records_and_sampled_traces_through_the_reporter(folders: dict[str, str]) -> None:
    config = three_arms(folders["target"], folders["drafter"], folders["canary"])
    config["trace_sample_rate"] = 1.0
    fake = FakeControlPlane(config)
    transport = httpx.MockTransport(fake)
    reporter = ControlPlaneReporter(
        BASE, api_key="k", client=httpx.Client(transport=transport), flush_interval_s=0.05
    )
    source = http_serving_config(
        BASE + "/serving-config", "k", ttl_s=60, client=httpx.Client(transport=transport)
    )
    app = create_app(ServerConfig(serving_config=source, on_record=reporter.record, on_trace=reporter.trace))
    with TestClient(app) as client:
        for i in range(6):
            resp = client.post(
                "/v1/completions",
                json={"model": "svc", "prompt": PROMPT, "max_tokens": 6, "temperature": 0},
                headers={"x-request-id": f"post-{i}"},
            )
            assert resp.status_code == 200
        missing = client.post("/v1/completions", json={"model": "nope", "prompt": PROMPT})
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert reporter.flush(10)
    reporter.close()
    assert fake.config_gets == 2  # one per model name within the TTL
    records = [r for p, b, _ in fake.posts if p.endswith("/acceptance") for r in b["records"]]
    traces = [t for p, b, _ in fake.posts if p.endswith("/traces") for t in b["traces"]]
    assert sorted(r["request_id"] for r in records) == [f"post-{i}" for i in range(6)]
    assert {r["arm"] for r in records} <= {"live", "canary:2", "baseline"}
    assert len(traces) == 6 and all(t["prompt"] == PROMPT and t["completion"] for t in traces)


def test_serving_config_cache_expires_and_survives_a_control_plane_outage() -> None:
    fake = FakeControlPlane(three_arms())
    clock = [0.0]
    source = http_serving_config(
        BASE + "/serving-config",
        ttl_s=1.0,
        stale_s=30.0,
        client=httpx.Client(transport=httpx.MockTransport(fake)),
        clock=lambda: clock[0],
    )
    first = source("svc")
    clock[0] = 0.5
    assert source("svc") is first and fake.config_gets == 1
    fake.config["config_version"] = "8"  # a promotion
    clock[0] = 1.2
    assert source("svc")["config_version"] == "8" and fake.config_gets == 2  # type: ignore[index]
    fake.down = True
    clock[0] = 10.0
    assert source("svc")["config_version"] == "8"  # type: ignore[index]  # stale, still serving
    clock[0] = 40.0
    with pytest.raises(httpx.ConnectError):
        source("svc")
    fake.down = False
    assert source("missing") is None
