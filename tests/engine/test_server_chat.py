"""POST /v1/chat/completions on the reference server, driven by the real `openai` client against
uvicorn on a free local port, and the chat-template rendering of workers.serve.chat."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.engine.live_server import live_server
from workers.engine.hf_io import save_hf_folder
from workers.engine.model import Transformer
from workers.engine.tokenizer import Tokenizer
from workers.serve.chat import InvalidMessages, chat_messages, render_chat
from workers.serve.server import ServerConfig, ServingPlan

MESSAGES = [
    {"role": "system", "content": "You write Python."},
    {"role": "user", "content": "def add(a, b):"},
]
# A small template in the style of the Hugging Face ones: special tokens, a role check, the generation prompt.
TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('bad role') }}{% endif %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
ALTERNATING = (
    "{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{{ message['content'] }}\n{% endfor %}"
)


def _with_template(src: Path, dst: Path, template: str) -> str:
    shutil.copytree(src, dst)
    config_path = dst / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = template
    config_path.write_text(json.dumps(config))
    return str(dst)


@pytest.fixture(scope="module")
def folders(
    target: Transformer, drafter: Transformer, tokenizer: Tokenizer, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, str]:
    root = tmp_path_factory.mktemp("chat-models")
    save_hf_folder(target, tokenizer, root / "target")
    save_hf_folder(drafter, tokenizer, root / "drafter")
    _with_template(root / "target", root / "templated", TEMPLATE)
    _with_template(root / "target", root / "alternating", ALTERNATING)
    return {p.name: str(p) for p in Path(root).iterdir()}


@pytest.fixture(scope="module")
def live(folders: dict[str, str]) -> Iterator[dict[str, Any]]:
    entries: dict[str, dict[str, Any]] = {
        "plain": {"target_path": folders["target"], "speculation": "disabled"},
        "templated": {"target_path": folders["templated"], "speculation": "disabled"},
        "alternating": {"target_path": folders["alternating"], "speculation": "disabled"},
        "canary": {
            "target_path": folders["target"],
            "trace_sample_rate": 1.0,
            "arms": [
                {"arm": "live", "weight": 0.5, "speculation": "draft_model",
                 "drafter_path": folders["drafter"], "drafter_version": 1, "k": 3},
                {"arm": "baseline", "weight": 0.5, "speculation": "disabled"},
            ],
        },
    }  # fmt: skip
    records: list[tuple[str, dict[str, Any]]] = []
    traces: list[tuple[str, str, str, str | None, str | None]] = []
    config = ServerConfig(
        serving_config=entries,
        on_record=lambda m, r: records.append((m, r)),
        on_trace=lambda m, p, c, cat, doc: traces.append((m, p, c, cat, doc)),
    )
    with live_server(config) as base_url:
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0)
        yield {"client": client, "entries": entries, "records": records, "traces": traces}


def _extra(obj: Any) -> dict[str, Any]:
    return dict(obj.model_extra or {})


def test_chat_completion_and_its_stream_agree_under_greedy_decoding(live: dict[str, Any]) -> None:
    client = live["client"]
    settings: dict[str, Any] = {"model": "plain", "messages": MESSAGES, "max_tokens": 24, "temperature": 0}
    whole = client.chat.completions.create(**settings)
    assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-")
    message = whole.choices[0].message
    assert message.role == "assistant" and message.content
    assert whole.choices[0].finish_reason in ("stop", "length")
    assert whole.usage is not None and whole.usage.prompt_tokens > 0
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens

    chunks = list(
        client.chat.completions.create(**settings, stream=True, stream_options={"include_usage": True})
    )
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    with_choices = [c for c in chunks if c.choices]
    assert len(with_choices) > 2
    assert "".join(c.choices[0].delta.content or "" for c in with_choices) == message.content
    assert with_choices[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in with_choices[:-1])
    # The usage chunk comes last, with no choices, and only because it was asked for.
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    unasked = list(client.chat.completions.create(**settings, stream=True))
    assert all(c.choices for c in unasked)


def test_max_completion_tokens_wins_and_stop_strings_cut(live: dict[str, Any]) -> None:
    client = live["client"]
    base: dict[str, Any] = {"model": "plain", "messages": MESSAGES, "temperature": 0}
    resp = client.chat.completions.create(**base, max_tokens=30, max_completion_tokens=5)
    assert resp.usage is not None and resp.usage.completion_tokens <= 5
    full = client.chat.completions.create(**base, max_tokens=30).choices[0].message.content
    assert full
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    cut = client.chat.completions.create(**base, max_tokens=30, stop=stop)
    assert cut.choices[0].message.content == full[: full.find(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_fallback_prompt_without_a_chat_template(live: dict[str, Any], folders: dict[str, str]) -> None:
    prompt = render_chat(folders["target"], MESSAGES)
    assert prompt == "system: You write Python.\nuser: def add(a, b):\nassistant: "
    # The same text through /v1/completions: the chat route generated from exactly that prompt.
    chat = live["client"].chat.completions.create(
        model="plain", messages=MESSAGES, max_tokens=6, temperature=0
    )
    same = live["client"].completions.create(model="plain", prompt=prompt, max_tokens=6, temperature=0)
    assert chat.choices[0].message.content == same.choices[0].text


def test_the_folders_chat_template_renders_the_prompt(live: dict[str, Any], folders: dict[str, str]) -> None:
    prompt = render_chat(folders["templated"], MESSAGES)
    assert prompt == (
        "<|endoftext|><|system|>\nYou write Python.<|endoftext|>\n"
        "<|user|>\ndef add(a, b):<|endoftext|>\n<|assistant|>\n"
    )
    resp = live["client"].chat.completions.create(
        model="templated",
        messages=MESSAGES,
        max_tokens=6,
        temperature=0,
        extra_body={"perf_metrics_in_response": True},
    )
    record = _extra(resp)["speculation_record"]
    # The same text through /v1/completions: the chat route generated from exactly that prompt.
    same = live["client"].completions.create(model="templated", prompt=prompt, max_tokens=6, temperature=0)
    assert resp.choices[0].message.content == same.choices[0].text
    assert resp.usage is not None and record["prompt_tokens"] == resp.usage.prompt_tokens


def test_records_and_traces_carry_the_arm_and_the_rendered_prompt(live: dict[str, Any]) -> None:
    client, records, traces = live["client"], live["records"], live["traces"]
    plan = ServingPlan.parse("canary", live["entries"]["canary"])
    ids = [f"chat-arm-{i}" for i in range(6)]
    arms = {plan.assign(rid).name for rid in ids}
    assert arms == {"live", "baseline"}
    records.clear()
    traces.clear()
    for rid in ids:
        client.chat.completions.create(
            model="canary",
            messages=MESSAGES,
            max_tokens=6,
            temperature=0,
            extra_body={"category": "code", "document": "code:add"},
            extra_headers={"x-request-id": rid},
        )
    assert [(m, r["request_id"], r["arm"]) for m, r in records] == [
        ("canary", rid, plan.assign(rid).name) for rid in ids
    ]
    assert all(r["category"] == "code" for _, r in records)
    by_arm = {r["arm"]: r for _, r in records}
    assert by_arm["live"]["drafter_version"] == 1 and by_arm["live"]["drafted_tokens"] > 0
    assert by_arm["baseline"]["drafted_tokens"] == 0
    rendered = "system: You write Python.\nuser: def add(a, b):\nassistant: "
    assert len(traces) == len(ids) and all(t[1] == rendered and t[3] == "code" for t in traces)
    assert all(t[4] == "code:add" for t in traces)


def _error(exc: Any) -> dict[str, Any]:
    body = exc.response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return dict(body["error"])


@pytest.mark.parametrize(
    ("messages", "extra", "param"),
    [
        ([], {}, "messages"),
        ([{"role": "wizard", "content": "hi"}], {}, "messages[0].role"),
        ([{"role": "user", "content": "hi"}, {"role": "user", "content": 3}], {}, "messages[1].content"),
        ([{"role": "user", "content": [{"type": "text", "text": "hi"}]}], {}, "messages[0].content"),
        (["hello"], {}, "messages"),
        (MESSAGES, {"n": 2}, "n"),
        (MESSAGES, {"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        (MESSAGES, {"temperature": 5.0}, "temperature"),
        (MESSAGES, {"max_completion_tokens": 0}, "max_completion_tokens"),
    ],
)
def test_bad_requests_get_openai_shaped_400s(
    live: dict[str, Any], messages: list[Any], extra: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        live["client"].chat.completions.create(model="plain", messages=messages, max_tokens=4, **extra)
    err = _error(exc.value)
    assert err["type"] == "invalid_request_error" and err["param"] == param


def test_context_overflow_and_template_refusals_are_400s(live: dict[str, Any]) -> None:
    client = live["client"]
    with pytest.raises(openai.BadRequestError) as long:
        client.chat.completions.create(model="plain", messages=MESSAGES, max_tokens=10_000, stream=True)
    assert _error(long.value)["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="alternating", messages=MESSAGES, max_tokens=4)
    err = _error(refused.value)
    assert err["param"] == "messages" and "alternate" in err["message"]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=MESSAGES, max_tokens=4)


def test_without_max_tokens_the_reply_may_fill_the_context(live: dict[str, Any]) -> None:
    resp = live["client"].chat.completions.create(model="plain", messages=MESSAGES, temperature=0)
    assert resp.usage is not None and resp.usage.completion_tokens > 16
    assert resp.choices[0].finish_reason in ("stop", "length")


def test_chat_messages_keeps_only_role_and_content() -> None:
    raw = [{"role": "user", "content": "hi", "name": "ada"}]
    assert chat_messages(raw) == [{"role": "user", "content": "hi"}]
    with pytest.raises(InvalidMessages) as exc:
        chat_messages([{"role": "tool", "content": "x"}])
    assert exc.value.param == "messages[0].role"
