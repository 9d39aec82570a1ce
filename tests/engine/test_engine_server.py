"""The reference server, driven by the real `openai` client against uvicorn on a free local port."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from tests.engine.live_server import live_server
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
    for model in ("tiny-plain", "tiny-draft", "tiny-ngram"):
        resp = client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0)
        choice = resp.choices[0]
        assert choice.finish_reason in ("stop", "length")
        assert resp.usage is not None and resp.usage.prompt_tokens > 0
        texts[model] = choice.text
    assert texts["tiny-draft"] == texts["tiny-plain"] == texts["tiny-ngram"]
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
    assert perf["speculation-generated-tokens"] > 0
    assert len(perf["speculation-acceptance"]) == 3
    assert 0 < perf["server-time-to-first-token"] <= perf["server-processing-time"]
    record = _extra(resp)["speculation_record"]
    assert tuple(record) == NATIVE_KEYS
    assert record["k"] == 3 and record["drafter_version"] == 2 and record["arm"] == "live"
    assert record["drafted_tokens"] == perf["speculation-generated-tokens"]
    assert record["request_id"] == resp.id


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
