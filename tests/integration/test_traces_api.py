"""Trace capture through the API on real databases: scrubbed before storage, all or nothing,
size limits, JSONL datasets (incl. OpenAI chat), paging, and retention per deployment.

Roles and other-account 404s for these routes are covered by test_access_control's MATRIX.
"""

from __future__ import annotations

import re
import shutil
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import orjson
from fastapi.testclient import TestClient
from sqlalchemy import func, select, update

from controlplane.config import Settings
from controlplane.db.models import Deployment, Role, Trace
from controlplane.models.service import ModelSource, find_model, register_model
from controlplane.traces.formats import MAX_DATASET_BYTES, MAX_TEXT_BYTES, TraceInput
from controlplane.traces.scrub import luhn_ok
from controlplane.traces.service import apply_retention, store_traces
from tests.conftest import Database, Tenant

NDJSON = {"Content-Type": "application/x-ndjson"}


def _deployment(client: TestClient, tenant: Tenant, name: str = "svc") -> str:
    response = client.post(
        f"/v1/accounts/{tenant.name}/deployments",
        json={"target_model": "reference-target", "deployment_id": name},
        headers=tenant.headers(Role.admin),
    )
    assert response.status_code == 201, response.text
    return f"/v1/accounts/{tenant.name}/deployments/{name}"


def _rows(db: Database) -> list[Trace]:
    session = db.new_session()
    try:
        return list(session.scalars(select(Trace).order_by(Trace.id)))
    finally:
        session.close()


def _count(db: Database) -> int:
    session = db.new_session()
    try:
        return int(session.scalar(select(func.count()).select_from(Trace)) or 0)
    finally:
        session.close()


def _jsonl(*records: Any) -> bytes:
    return b"".join(orjson.dumps(r) + b"\n" for r in records)


def test_batch_is_stored_scrubbed(client: TestClient, tenants: tuple[Tenant, Tenant], db: Database) -> None:
    acme, _ = tenants
    base = _deployment(client, acme)
    traces = [
        {
            "prompt": "My email is jane.doe@mailbox.org and my card 4111 1111 1111 1111.",
            "completion": "Thanks Jane, I will call +1 415 555 2671 or write to jane.doe@mailbox.org.",
            "category": "support",
        },
        {"prompt": "def connect():\n    password = 'hunter22'\n", "completion": "    return db(password)"},
        {"prompt": "server 81.2.69.142 and sk-proj-4fJ9kL2mN8pQ1rS5tU7vW3xY6zA0bC", "completion": "ok"},
        {"prompt": "version 1.2.3 released 2024-01-15", "completion": "order #123456789", "category": None},
    ]
    response = client.post(f"{base}/traces", json={"traces": traces}, headers=acme.headers(Role.ingest))
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["stored"] == 4
    assert body["scrubbed"] == {
        "email": 2,
        "credit_card": 1,
        "phone": 1,
        "secret": 2,
        "ip_address": 1,
        "iban": 0,
        "national_id": 0,
    }
    assert body["sample_rate"] == 0.1

    rows = _rows(db)
    # Surrogates of the same shape replace the values; the same address gets the same surrogate in
    # the prompt and the completion of a trace.
    first = re.fullmatch(
        r"My email is (\w+\.\w+@\w+\.org) and my card (4\d{3} \d{4} \d{4} \d{4})\.", rows[0].prompt
    )
    assert first is not None, rows[0].prompt
    email, card = first.groups()
    assert (
        email != "jane.doe@mailbox.org" and card != "4111 1111 1111 1111" and luhn_ok(card.replace(" ", ""))
    )
    reply = re.fullmatch(
        r"Thanks Jane, I will call (\+1 \d{3} \d{3} \d{4}) or write to (\S+)\.", rows[0].completion
    )
    assert reply is not None and reply[1] != "+1 415 555 2671" and reply[2] == email, rows[0].completion
    password = re.fullmatch(r"def connect\(\):\n    password = '(\w{8})'\n", rows[1].prompt)
    assert password is not None and password[1] != "hunter22", rows[1].prompt
    server = re.fullmatch(r"server (\d+\.\d+\.\d+\.\d+) and (sk-proj-\w{30})", rows[2].prompt)
    assert server is not None and server[1] != "81.2.69.142", rows[2].prompt
    assert server[2] != "sk-proj-4fJ9kL2mN8pQ1rS5tU7vW3xY6zA0bC"
    assert rows[3].prompt == "version 1.2.3 released 2024-01-15"
    assert rows[3].completion == "order #123456789"
    assert [r.category for r in rows] == ["support", None, None, None]
    assert {r.source.value for r in rows} == {"sampled"}

    page = client.get(f"{base}/traces", headers=acme.headers(Role.viewer)).json()
    assert [t["prompt"] for t in page["traces"]] == [r.prompt for r in rows]
    assert page["next_after_id"] is None
    assert "jane.doe@mailbox.org" not in orjson.dumps(page).decode()


def test_a_bad_trace_rejects_the_whole_batch(
    client: TestClient, tenants: tuple[Tenant, Tenant], db: Database
) -> None:
    acme, _ = tenants
    base = _deployment(client, acme)
    good = {"prompt": "p", "completion": "c"}
    traces: list[Any] = [
        good,
        {"prompt": "p"},
        {"prompt": 5, "completion": "c"},
        "not an object",
        {"prompt": "p", "completion": "c", "completon": "typo"},
        {"prompt": "p", "completion": "c", "category": "x" * 101},
        {"prompt": "p\x00", "completion": "c"},
        good,
    ]
    response = client.post(f"{base}/traces", json={"traces": traces}, headers=acme.headers(Role.ingest))
    assert response.status_code == 422, response.text
    problems = {(p["index"], p["field"]) for p in response.json()["error"]["details"]}
    assert problems == {
        (1, "completion"),
        (2, "prompt"),
        (3, ""),
        (4, "completon"),
        (5, "category"),
        (6, "prompt"),
    }
    assert "nothing was stored" in response.json()["error"]["message"]
    for body in (b"{not json", b'{"traces": 5}', b'{"traces": []}', b"[]"):
        response = client.post(f"{base}/traces", content=body, headers=acme.headers(Role.ingest))
        assert response.status_code == 422, (body, response.text)
    assert _count(db) == 0


def test_oversized_batches_and_texts_are_413(
    client: TestClient, tenants: tuple[Tenant, Tenant], db: Database
) -> None:
    acme, _ = tenants
    base = _deployment(client, acme)
    headers = acme.headers(Role.ingest)
    at_limit = "é" * (MAX_TEXT_BYTES // 2)  # two bytes each: exactly the limit
    response = client.post(
        f"{base}/traces", json={"traces": [{"prompt": at_limit, "completion": "c"}]}, headers=headers
    )
    assert response.status_code == 200, response.text
    over = {"prompt": "p", "completion": at_limit + "a"}
    response = client.post(
        f"{base}/traces", json={"traces": [{"prompt": "p", "completion": "c"}, over]}, headers=headers
    )
    assert response.status_code == 413, response.text
    assert response.json()["error"]["details"][0] == {
        "index": 1,
        "field": "completion",
        "message": f"{MAX_TEXT_BYTES + 1} bytes exceeds the {MAX_TEXT_BYTES}-byte limit",
    }
    too_many = {"traces": [{"prompt": "p", "completion": "c"}] * 1001}
    response = client.post(f"{base}/traces", json=too_many, headers=headers)
    assert response.status_code == 413 and "1001" in response.json()["error"]["message"]
    assert _count(db) == 1


def test_dataset_upload_in_every_line_shape(
    client: TestClient, tenants: tuple[Tenant, Tenant], db: Database
) -> None:
    acme, _ = tenants
    base = _deployment(client, acme)
    chat = {
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Mail bob@mailbox.org the report."},
            {"role": "assistant", "content": "Which report?"},
            {"role": "user", "content": [{"type": "text", "text": "The Q3 one."}]},
            {
                "role": "assistant",
                "content": [{"type": "text", "text": "Sent to "}, {"type": "text", "text": "Bob."}],
            },
        ],
        "id": "conv-1",
    }
    body = (
        b"\xef\xbb\xbf"
        + _jsonl(
            {"prompt": "2+2=", "completion": "4", "category": "math"}, {"input": "Hi", "output": "Hello!"}
        )
        + b"\n   \n"
        + _jsonl(chat)
    )
    url = f"{base}/datasets?name=support-v1"
    response = client.post(url, content=body, headers={**NDJSON, **acme.headers(Role.admin)})
    assert response.status_code == 200, response.text
    assert response.json() == {
        "dataset_name": "support-v1",
        "stored": 3,
        "replaced": 0,
        "scrubbed": {
            "email": 1,
            "phone": 0,
            "credit_card": 0,
            "ip_address": 0,
            "secret": 0,
            "iban": 0,
            "national_id": 0,
        },
    }
    rows = _rows(db)
    surrogate = re.search(r"Mail (\S+@\S+) the report", rows[2].prompt)
    assert surrogate is not None and surrogate[1] != "bob@mailbox.org"
    rows[2].prompt = rows[2].prompt.replace(surrogate[1], "<EMAIL>")
    assert [(r.prompt, r.completion, r.category) for r in rows] == [
        ("2+2=", "4", "math"),
        ("Hi", "Hello!", None),
        (
            # The reference target has no chat template: the plain rendering it is served with.
            "system: You are terse.\nuser: Mail <EMAIL> the report.\nassistant: Which report?\n"
            "user: The Q3 one.\nassistant: ",
            "Sent to Bob.",
            None,
        ),
    ]
    assert {(r.source.value, r.dataset_name) for r in rows} == {("dataset", "support-v1")}

    # Uploading under the same name replaces the dataset; text/plain is accepted too.
    again = _jsonl({"prompt": "a", "completion": "b"})
    response = client.post(
        url, content=again, headers={"Content-Type": "text/plain; charset=utf-8", **acme.headers(Role.ingest)}
    )
    assert response.status_code == 200, response.text
    assert (response.json()["stored"], response.json()["replaced"]) == (1, 3)
    assert [(r.prompt, r.dataset_name) for r in _rows(db)] == [("a", "support-v1")]


def test_malformed_dataset_line_is_422_and_stores_nothing(
    client: TestClient, tenants: tuple[Tenant, Tenant], db: Database
) -> None:
    acme, _ = tenants
    base = _deployment(client, acme)
    headers = {**NDJSON, **acme.headers(Role.ingest)}
    url = f"{base}/datasets?name=d1"
    assert (
        client.post(url, content=_jsonl({"prompt": "keep", "completion": "me"}), headers=headers).status_code
        == 200
    )
    body = (
        _jsonl({"prompt": "ok", "completion": "ok"})
        + b'{"prompt": "broken", "completion": \n'
        + b"\n"
        + _jsonl(
            ["not", "an", "object"],
            {"prompt": "only a prompt"},
            {"messages": [{"role": "user", "content": "no answer"}]},
            {"prompt": "a", "input": "b", "completion": "c"},
            {"text": "neither shape"},
        )
    )
    response = client.post(url, content=body, headers=headers)
    assert response.status_code == 422, response.text
    details = response.json()["error"]["details"]
    assert [(p["line"], p["field"]) for p in details] == [
        (2, ""),
        (4, ""),
        (5, "completion"),
        (6, "messages"),
        (7, "prompt"),
        (8, "prompt"),
    ]
    assert "line 2" in response.json()["error"]["message"]
    # The earlier upload of that name is untouched: the refused file replaced nothing.
    assert [r.prompt for r in _rows(db)] == ["keep"]

    for bad_body in (b"", b"\n\n"):
        assert client.post(url, content=bad_body, headers=headers).status_code == 422
    pdf = {"Content-Type": "application/pdf", **acme.headers(Role.ingest)}
    response = client.post(url, content=_jsonl({"prompt": "a", "completion": "b"}), headers=pdf)
    assert response.status_code == 415
    response = client.post(f"{base}/datasets?name=../etc", content=b"", headers=headers)
    assert response.status_code == 422
    assert [r.prompt for r in _rows(db)] == ["keep"]


def test_dataset_limits_are_413(client: TestClient, tenants: tuple[Tenant, Tenant], db: Database) -> None:
    acme, _ = tenants
    base = _deployment(client, acme)
    headers = {**NDJSON, **acme.headers(Role.ingest)}
    line = b'{"prompt":"a","completion":"b"}\n'
    response = client.post(f"{base}/datasets?name=big", content=line * 100_001, headers=headers)
    assert response.status_code == 413, response.text
    assert response.json()["error"]["details"][0]["line"] == 100_001
    response = client.post(
        f"{base}/datasets?name=huge", content=b" " * (MAX_DATASET_BYTES + 1), headers=headers
    )
    assert response.status_code == 413
    oversized = _jsonl(
        {"prompt": "p", "completion": "c"}, {"prompt": "x" * (MAX_TEXT_BYTES + 1), "completion": "c"}
    )
    response = client.post(f"{base}/datasets?name=long", content=oversized, headers=headers)
    assert response.status_code == 413
    assert response.json()["error"]["details"][0]["line"] == 2
    assert _count(db) == 0


def test_paging_by_id(client: TestClient, tenants: tuple[Tenant, Tenant]) -> None:
    acme, _ = tenants
    base = _deployment(client, acme)
    other = _deployment(client, acme, "other")
    batch = {"traces": [{"prompt": f"p{i}", "completion": "c"} for i in range(5)]}
    assert client.post(f"{base}/traces", json=batch, headers=acme.headers(Role.ingest)).status_code == 200
    assert client.post(f"{other}/traces", json=batch, headers=acme.headers(Role.ingest)).status_code == 200
    seen: list[str] = []
    after_id = 0
    while True:
        page = client.get(
            f"{base}/traces?limit=2&after_id={after_id}", headers=acme.headers(Role.viewer)
        ).json()
        seen += [t["prompt"] for t in page["traces"]]
        if page["next_after_id"] is None:
            break
        after_id = page["next_after_id"]
    assert seen == [f"p{i}" for i in range(5)]
    assert client.get(f"{base}/traces?limit=0", headers=acme.headers(Role.viewer)).status_code == 422
    assert client.get(f"{base}/traces?limit=1001", headers=acme.headers(Role.viewer)).status_code == 422


def test_retention_deletes_only_old_traces_of_each_deployment(
    client: TestClient, tenants: tuple[Tenant, Tenant], db: Database
) -> None:
    acme, globex = tenants
    _deployment(client, acme, "short")
    _deployment(client, acme, "long")
    _deployment(client, globex, "short")
    response = client.patch(
        f"/v1/accounts/{acme.name}/deployments/short",
        json={"trace_retention_days": 1},
        headers=acme.headers(Role.admin),
    )
    assert response.status_code == 200, response.text
    now = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
    session = db.new_session()
    ids = {
        (account_id, name): deployment_id
        for deployment_id, account_id, name in session.execute(
            select(Deployment.id, Deployment.account_id, Deployment.name)
        )
    }
    short, long_, globex_short = (
        ids[(acme.account_id, "short")],
        ids[(acme.account_id, "long")],
        ids[(globex.account_id, "short")],
    )
    for deployment_id, ages in ((short, (2, 0.5)), (long_, (2, 29, 31)), (globex_short, (2, 31))):
        for age in ages:
            store_traces(
                session=session,
                deployment_id=deployment_id,
                items=[TraceInput(f"{age} days old", "c")],
                now=now - timedelta(days=age),
            )
    session.commit()

    assert apply_retention(session=session, now=now) == {short: 1, long_: 1, globex_short: 1}
    session.commit()
    remaining = sorted((t.deployment_id, t.prompt) for t in session.scalars(select(Trace)))
    session.close()
    assert remaining == sorted(
        [(short, "0.5 days old"), (long_, "2 days old"), (long_, "29 days old"), (globex_short, "2 days old")]
    )


def test_retention_is_bounded_and_one_stored_outlier_cannot_stop_the_cleanup(
    client: TestClient, tenants: tuple[Tenant, Tenant], db: Database
) -> None:
    acme, globex = tenants
    _deployment(client, acme, "forever")
    _deployment(client, globex, "short")
    for days in (0, 3_651, 1_000_000):
        response = client.patch(
            f"/v1/accounts/{acme.name}/deployments/forever",
            json={"trace_retention_days": days},
            headers=acme.headers(Role.admin),
        )
        assert response.status_code == 422 and "3650" in response.text, (days, response.text)
    session = db.new_session()
    deployments = {
        name: (d_id, account)
        for d_id, name, account in session.execute(
            select(Deployment.id, Deployment.name, Deployment.account_id)
        )
    }
    forever, short = deployments["forever"][0], deployments["short"][0]
    # A value written before the bound existed (straight to the database).
    session.execute(update(Deployment).where(Deployment.id == forever).values(trace_retention_days=1_000_000))
    session.execute(update(Deployment).where(Deployment.id == short).values(trace_retention_days=1))
    now = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
    for deployment_id in (forever, short):
        store_traces(
            session=session,
            deployment_id=deployment_id,
            items=[TraceInput("old", "c")],
            now=now - timedelta(days=5),
        )
    session.commit()
    assert apply_retention(session=session, now=now) == {short: 1}  # the other account's cleanup still runs
    session.commit()
    session.close()


CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_traced_chat_is_stored_as_the_prompt_its_target_was_given(
    client: TestClient, tenants: tuple[Tenant, Tenant], db: Database, settings: Settings, tmp_path: Path
) -> None:
    """A chat trace (the router sends its messages) is rendered with the deployment's target chat
    template before scrubbing, in batches and datasets alike; a target without a template keeps
    the plain rendering the reference server uses; prompt and messages together are refused."""
    acme, _ = tenants
    session = db.new_session()
    try:
        reference = find_model(session=session, account_id=acme.account_id, name="reference-target")
        assert reference is not None
        folder = tmp_path / "chatty"
        shutil.copytree(reference.location, folder)
        (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)
        register_model(
            session=session,
            account_id=acme.account_id,
            name="chatty",
            source=ModelSource(path=str(folder)),
            settings=settings,
            roots=[tmp_path],
        )
        session.commit()
    finally:
        session.close()
    response = client.post(
        f"/v1/accounts/{acme.name}/deployments",
        json={"target_model": "chatty", "deployment_id": "chat"},
        headers=acme.headers(Role.admin),
    )
    assert response.status_code == 201, response.text
    chat = f"/v1/accounts/{acme.name}/deployments/chat"
    plain = _deployment(client, acme, "plain")
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Write to jane.doe@mailbox.org"},
    ]
    for base in (chat, plain):
        response = client.post(
            f"{base}/traces",
            json={"traces": [{"messages": messages, "completion": "Done.", "category": "chat"}]},
            headers=acme.headers(Role.ingest),
        )
        assert response.status_code == 200, response.text
    dataset = _jsonl({"messages": [*messages, {"role": "assistant", "content": "Sent."}]})
    response = client.post(
        f"{chat}/datasets?name=chats", content=dataset, headers={**NDJSON, **acme.headers(Role.admin)}
    )
    assert response.status_code == 200, response.text

    rows = _rows(db)
    assert len(rows) == 3
    for row in rows:
        # The address is scrubbed in the rendered prompt like any other text.
        assert "jane.doe@mailbox.org" not in row.prompt
    templated = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWrite to "
    assert rows[0].prompt.startswith(templated) and rows[0].prompt.endswith(
        "<|im_end|>\n<|im_start|>assistant\n"
    )
    assert rows[1].prompt.startswith("system: Be brief.\nuser: Write to ")
    assert rows[1].prompt.endswith("\nassistant: ")
    assert rows[2].prompt.startswith(templated) and rows[2].completion == "Sent."

    both = {"traces": [{"prompt": "p", "messages": messages, "completion": "c"}]}
    response = client.post(f"{chat}/traces", json=both, headers=acme.headers(Role.ingest))
    assert response.status_code == 422 and "not both" in response.text
    response = client.post(
        f"{chat}/traces",
        json={"traces": [{"messages": [{"role": "user", "content": 3}], "completion": "c"}]},
        headers=acme.headers(Role.ingest),
    )
    assert response.status_code == 422 and "messages[0].content" in response.text
    assert _count(db) == 3
