"""The reference server, driven by the real `openai` client against uvicorn on a free local port."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest

from controlplane.ingest.formats import parse_batch
from tests.engine.live_server import live_server
from workers.engine.eagle import HeadConfig, head_for_target
from workers.engine.head_io import save_head_folder
from workers.engine.hf_io import save_hf_folder
from workers.engine.metrics import NATIVE_KEYS
from workers.engine.model import Transformer
from workers.engine.tokenizer import Tokenizer, train_bpe

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from workers.serve.server import ServerConfig  # noqa: E402

PROMPT = "def add(a, b):\n    return"


@pytest.fixture(scope="module")
def folders(
    target: Transformer, drafter: Transformer, tokenizer: Tokenizer, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    save_hf_folder(target, tokenizer, root / "target")
    save_hf_folder(drafter, tokenizer, root / "drafter")
    other = train_bpe(["a different tokenizer for the same vocabulary size " * 4] * 8, vocab_size=320)
    save_hf_folder(drafter, other, root / "foreign-drafter")
    head = head_for_target(target, HeadConfig.for_target(target.config, 200)).eval()
    save_head_folder(head, tokenizer, root / "head", verifier="tiny-target")
    return {p.name: str(p) for p in Path(root).iterdir()}


@pytest.fixture(scope="module")
def live(folders: dict[str, str]) -> Iterator[dict[str, Any]]:
    entries: dict[str, dict[str, Any]] = {
        "tiny-plain": {"target_path": folders["target"], "speculation": "disabled"},
        "tiny-draft": {
            "target_path": folders["target"],
            "speculation": "draft_model",
            "drafter_path": folders["drafter"],
            "k": 3,
            "drafter_version": 2,
        },
        "tiny-ngram": {"target_path": folders["target"], "speculation": "ngram", "k": 4, "ngram_length": 2},
        # A head artifact in the drafter's place: the server drafts from the target's states.
        "tiny-head": {
            "target_path": folders["target"],
            "speculation": "draft_model",
            "drafter_path": folders["head"],
            "k": 3,
            "drafter_version": 3,
        },
        "tiny-foreign": {
            "target_path": folders["target"],
            "speculation": "draft_model",
            "drafter_path": folders["foreign-drafter"],
        },
    }
    records: list[tuple[str, dict[str, Any]]] = []

    def source(name: str) -> Mapping[str, Any] | None:  # a callable, like the control-plane hook
        return entries.get(name)

    config = ServerConfig(
        serving_config=source, model_names=sorted(entries), on_record=lambda m, r: records.append((m, r))
    )
    with live_server(config) as base_url:
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
        yield {"client": client, "entries": entries, "records": records}


def _extra(obj: Any) -> dict[str, Any]:
    return dict(obj.model_extra or {})


def test_greedy_completion_is_identical_with_and_without_speculation(live: dict[str, Any]) -> None:
    client = live["client"]
    texts = {}
    for model in ("tiny-plain", "tiny-draft", "tiny-ngram", "tiny-head"):
        resp = client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0)
        choice = resp.choices[0]
        assert choice.finish_reason in ("stop", "length")
        assert resp.usage is not None and resp.usage.prompt_tokens > 0
        texts[model] = choice.text
        if model == "tiny-head":  # the head drafted (k per round) and the record names its version
            record = live["records"][-1][1]
            assert record["drafted_tokens"] > 0 and record["drafter_version"] == 3
    assert texts["tiny-draft"] == texts["tiny-plain"] == texts["tiny-ngram"] == texts["tiny-head"]
    assert live["records"] and set(live["records"][-1][1]) == set(NATIVE_KEYS)


def test_perf_metrics_in_response(live: dict[str, Any]) -> None:
    resp = live["client"].completions.create(
        model="tiny-draft",
        prompt=PROMPT,
        max_tokens=20,
        temperature=0,
        extra_body={"perf_metrics_in_response": True},
    )
    perf = _extra(resp)["perf_metrics"]
    # Exactly Fireworks' spelling: one "position:hits/total" string; G = tokens the verify steps
    # emitted = completion tokens less the prefill's one.
    assert isinstance(perf["speculation-acceptance"], str)
    assert [p.split(":")[0] for p in perf["speculation-acceptance"].split(",")] == ["0", "1", "2"]
    assert resp.usage is not None
    assert perf["speculation-generated-tokens"] == resp.usage.completion_tokens - 1
    assert 0 < perf["server-time-to-first-token"] <= perf["server-processing-time"]
    record = _extra(resp)["speculation_record"]
    assert tuple(record) == NATIVE_KEYS
    assert record["k"] == 3 and record["drafter_version"] == 2 and record["arm"] == "live"
    assert record["request_id"] == resp.id
    # Round trip: the Fireworks body through the ingest adapter gives the engine's own counts.
    (parsed,) = parse_batch({"format": "fireworks", "records": [resp.model_dump()]})
    counts = (
        "drafted_tokens",
        "accepted_tokens",
        "verify_steps",
        "generated_tokens",
        "accepted_per_position",
        "k",
    )
    assert {c: getattr(parsed, c) for c in counts} == {c: record[c] for c in counts}
    assert parsed.accepted_per_position == record["accepted_per_position"]


def test_streaming_matches_and_ends_with_perf_metrics(live: dict[str, Any]) -> None:
    client = live["client"]
    whole = client.completions.create(model="tiny-draft", prompt=PROMPT, max_tokens=30, temperature=0)
    chunks = list(
        client.completions.create(
            model="tiny-draft",
            prompt=PROMPT,
            max_tokens=30,
            temperature=0,
            stream=True,
            extra_body={"perf_metrics_in_response": True},
        )
    )
    assert len(chunks) > 2
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert "perf_metrics" in _extra(chunks[-1]) and "perf_metrics" not in _extra(chunks[0])


def test_stop_strings_cut_plain_and_streamed_completions(live: dict[str, Any]) -> None:
    client = live["client"]
    full = client.completions.create(model="tiny-draft", prompt=PROMPT, max_tokens=30, temperature=0)
    text = full.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip() and stop in text
    want = text[: text.find(stop)]
    settings: dict[str, Any] = {"model": "tiny-draft", "prompt": PROMPT, "max_tokens": 30, "temperature": 0}
    cut = client.completions.create(**settings, stop=stop)
    assert cut.choices[0].text == want and cut.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(**settings, stop=[stop, "zzzz"], stream=True))
    # No chunk ever carried text past the cut, not even a prefix of the stop string held back.
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_predicted_output(live: dict[str, Any]) -> None:
    client = live["client"]
    first = client.completions.create(model="tiny-plain", prompt=PROMPT, max_tokens=30, temperature=0)
    resp = client.completions.create(
        model="tiny-plain",
        prompt=PROMPT,
        max_tokens=30,
        temperature=0,
        extra_body={
            "prediction": {"type": "content", "content": first.choices[0].text},
            "perf_metrics_in_response": True,
        },
    )
    assert resp.choices[0].text == first.choices[0].text
    perf = _extra(resp)["perf_metrics"]
    assert perf["speculation-prompt-tokens"] > 0
    assert perf["speculation-prompt-matched-tokens"] > 0


def test_seeded_sampling_is_reproducible(live: dict[str, Any]) -> None:
    client = live["client"]

    def run(seed: int) -> str:
        r = client.completions.create(
            model="tiny-draft", prompt=PROMPT, max_tokens=20, temperature=1.0, seed=seed
        )
        return str(r.choices[0].text)

    assert run(5) == run(5)


def test_serving_config_is_read_per_request(live: dict[str, Any]) -> None:
    client, entries = live["client"], live["entries"]
    kwargs: dict[str, Any] = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    kwargs["extra_body"] = {"perf_metrics_in_response": True}
    before = _extra(client.completions.create(model="tiny-draft", **kwargs))["speculation_record"]
    entries["tiny-draft"] = {**entries["tiny-draft"], "k": 5, "drafter_version": 3}
    try:
        after = _extra(client.completions.create(model="tiny-draft", **kwargs))["speculation_record"]
    finally:
        entries["tiny-draft"] = {**entries["tiny-draft"], "k": 3, "drafter_version": 2}
    assert (before["k"], before["drafter_version"]) == (3, 2)
    assert (after["k"], after["drafter_version"]) == (5, 3)


def test_models_listing(live: dict[str, Any]) -> None:
    ids = [m.id for m in live["client"].models.list()]
    assert ids == sorted(live["entries"])


def _error(exc: Any) -> dict[str, Any]:
    body = exc.response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return dict(body["error"])


def test_openai_style_errors(live: dict[str, Any]) -> None:
    client = live["client"]
    with pytest.raises(openai.NotFoundError) as nf:
        client.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=4)
    assert nf.value.status_code == 404 and _error(nf.value)["code"] == "model_not_found"

    with pytest.raises(openai.BadRequestError) as long:
        client.completions.create(model="tiny-plain", prompt=PROMPT, max_tokens=10_000)
    err = _error(long.value)
    assert err["code"] == "context_length_exceeded" and err["param"] == "max_tokens"

    with pytest.raises(openai.BadRequestError) as stream_long:
        client.completions.create(model="tiny-plain", prompt=PROMPT, max_tokens=10_000, stream=True)
    assert _error(stream_long.value)["code"] == "context_length_exceeded"

    bad_params: list[dict[str, Any]] = [
        {"temperature": 5.0},
        {"top_p": 0.0},
        {"max_tokens": 0},
        {"n": 2},
        {"stop": ["a", "b", "c", "d", "e"]},
        {"stop": ""},
    ]
    for bad in bad_params:
        with pytest.raises(openai.BadRequestError) as exc:
            client.completions.create(model="tiny-plain", prompt=PROMPT, **{"max_tokens": 4, **bad})
        err = _error(exc.value)
        assert err["type"] == "invalid_request_error" and err["param"] == next(iter(bad))

    with pytest.raises(openai.InternalServerError) as foreign:
        client.completions.create(model="tiny-foreign", prompt=PROMPT, max_tokens=4)
    assert "does not share the tokenizer" in _error(foreign.value)["message"]


def test_generator_default_is_unseeded(live: dict[str, Any]) -> None:
    # Without a seed two sampled completions are independent draws (here: not all identical).
    client = live["client"]
    outs = {
        client.completions.create(model="tiny-plain", prompt=PROMPT, max_tokens=12, temperature=1.5)
        .choices[0]
        .text
        for _ in range(4)
    }
    assert len(outs) > 1


@pytest.fixture(scope="module")
def vllm_style(folders: dict[str, str]) -> Iterator[str]:
    """The server as a vLLM-style backend: a canary split, and a fixed one-arm candidate backend."""
    draft = {"speculation": "draft_model", "drafter_path": folders["drafter"], "k": 3}
    entries: dict[str, dict[str, Any]] = {
        "split": {
            "target_path": folders["target"],
            "arms": [
                {"arm": "live", "weight": 0.5, **draft, "drafter_version": 2},
                {"arm": "baseline", "weight": 0.5, "speculation": "disabled"},
            ],
        },
        "candidate": {
            "target_path": folders["target"],
            "arms": [{"arm": "canary:5", "weight": 1.0, **draft, "drafter_version": 5}],
        },
    }
    config = ServerConfig(serving_config=entries, metrics_style="vllm")
    with live_server(config) as base_url:
        yield base_url


def _post(base_url: str, path: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> Any:
    return httpx.post(f"{base_url}{path}", json=body, headers=headers or {}, timeout=30)


def test_vllm_style_replies_carry_only_vllm_metrics(vllm_style: str) -> None:
    # docs.vllm.ai features/speculative_decoding/acceptance_metrics: a top-level `metrics` object
    # whose `speculative_decoding` (summary level) has exactly these keys.
    summary_keys = {
        "num_spec_steps",
        "num_draft_tokens",
        "num_accepted_draft_tokens",
        "draft_acceptance_rate",
        "mean_acceptance_length",
        "acceptance_histogram",
    }
    body = {"model": "candidate", "prompt": PROMPT, "max_tokens": 16, "temperature": 0}
    for path, extra in (
        ("/v1/completions", {"perf_metrics_in_response": True}),  # asked for, still not sent
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ):
        req = {**body, **extra}
        if "messages" in req:
            del req["prompt"]
        resp = _post(vllm_style, path, req)
        assert resp.status_code == 200, resp.text
        data = resp.json()
        assert "perf_metrics" not in data and "speculation_record" not in data
        sd = data["metrics"]["speculative_decoding"]
        assert set(sd) == summary_keys
        assert sum(sd["acceptance_histogram"]) == sd["num_spec_steps"] > 0
        (parsed,) = parse_batch({"format": "vllm", "records": [data]})
        assert parsed.accepted_tokens == sd["num_accepted_draft_tokens"]
        assert parsed.generated_tokens == data["usage"]["completion_tokens"]
        assert resp.headers["x-speculation-arm"] == "canary:5"
        assert resp.headers["x-drafter-version"] == "5"


def test_vllm_style_streaming_puts_metrics_in_the_final_chunk(vllm_style: str) -> None:
    body = {"model": "candidate", "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{vllm_style}/v1/completions", json=body, timeout=30) as resp:
        assert resp.headers["x-speculation-arm"] == "canary:5"
        assert resp.headers["x-drafter-version"] == "5"
        lines = [ln[6:] for ln in resp.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(ln) for ln in lines[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] is not None
    assert chunks[-1]["metrics"]["speculative_decoding"]["num_spec_steps"] > 0
    assert all("metrics" not in c and "perf_metrics" not in c for c in chunks[:-1])


def test_arm_header_pins_an_existing_arm_and_replies_name_what_served(vllm_style: str) -> None:
    body = {"model": "split", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    for i in range(4):
        rid = {"x-request-id": f"pin-{i}"}
        base = _post(vllm_style, "/v1/completions", body, {**rid, "x-speculation-arm": "baseline"})
        assert base.headers["x-speculation-arm"] == "baseline"
        assert "x-drafter-version" not in base.headers
        assert base.json()["metrics"]["speculative_decoding"] is None  # the arm does not speculate
        live = _post(vllm_style, "/v1/completions", body, {**rid, "x-speculation-arm": "live"})
        assert live.headers["x-speculation-arm"] == "live" and live.headers["x-drafter-version"] == "2"
    # An arm the config does not list: the usual hash, the same arm as without the header.
    rid = {"x-request-id": "pin-unknown"}
    plain = _post(vllm_style, "/v1/completions", body, rid)
    unknown = _post(vllm_style, "/v1/completions", body, {**rid, "x-speculation-arm": "canary:9"})
    assert unknown.headers["x-speculation-arm"] == plain.headers["x-speculation-arm"]
