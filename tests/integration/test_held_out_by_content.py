"""Held out by content, on real databases: a trace's source ``document`` through the trace API
(stored, read back, validated), and the canary's shadow replay choosing only requests whose
normalised prompt and document never reached the candidate's training, in agreement with the
trainer's own split of the same traces."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import orjson
from fastapi.testclient import TestClient
from sqlalchemy import select, update

from controlplane.canary.service import start_canary
from controlplane.canary.shadow import claim_replay, held_out_requests
from controlplane.db.models import Canary, Deployment, DrafterState, DrafterVersion, Role, Trace
from controlplane.jobs.realign import realign_inputs, trained_content
from controlplane.jobs.service import request_realign
from controlplane.traces.formats import MAX_DOCUMENT_CHARS, TraceInput
from controlplane.traces.holdout import REALIGN_HOLDOUT_SHARE, content_key, is_held_out, prompt_hash
from controlplane.traces.service import store_traces
from tests.conftest import Database, Tenant, add_deployment
from workers.engine.tokenizer import Tokenizer
from workers.training.realign import RealignConfig, TraceText, build_dataset

REFERENCE_TARGET = Path(__file__).resolve().parents[2] / "workers" / "models" / "reference" / "target"
NDJSON = {"Content-Type": "application/x-ndjson"}
BASE = datetime(2026, 6, 1, 12, tzinfo=UTC)


def _deployment(client: TestClient, tenant: Tenant) -> str:
    response = client.post(
        f"/v1/accounts/{tenant.name}/deployments",
        json={"target_model": "reference-target", "deployment_id": "svc"},
        headers=tenant.headers(Role.admin),
    )
    assert response.status_code == 201, response.text
    return f"/v1/accounts/{tenant.name}/deployments/svc"


def test_a_traces_document_is_stored_read_back_and_validated(
    client: TestClient, tenants: tuple[Tenant, Tenant], db: Database
) -> None:
    acme, _ = tenants
    base = _deployment(client, acme)
    ingest = acme.headers(Role.ingest)
    longest = "d" * MAX_DOCUMENT_CHARS
    batch = [
        {"prompt": "p1", "completion": "c1", "document": "structured:doc-123"},
        {"prompt": "p2", "completion": "c2", "category": "prose", "document": longest},
        {"prompt": "p3", "completion": "c3"},
        {"prompt": "p4", "completion": "c4", "document": None},
        # A label holding personal data is kept as one digest per label, never as the value.
        {"prompt": "p5", "completion": "c5", "document": "notes-jane.doe@mailbox.org"},
        {"prompt": "p6", "completion": "c6", "document": "notes-jane.doe@mailbox.org"},
    ]
    response = client.post(f"{base}/traces", json={"traces": batch}, headers=ingest)
    assert response.status_code == 200, response.text
    assert response.json()["scrubbed"]["email"] == 2
    dataset = orjson.dumps({"prompt": "p7", "completion": "c7", "document": "prose:doc-9"}) + b"\n"
    response = client.post(f"{base}/datasets?name=docs", content=dataset, headers={**ingest, **NDJSON})
    assert response.status_code == 200, response.text

    page = client.get(f"{base}/traces", headers=acme.headers(Role.viewer)).json()
    documents = [t["document"] for t in page["traces"]]
    assert documents[:4] == ["structured:doc-123", longest, None, None]
    assert documents[4] == documents[5] and documents[4].startswith("sha256:") and len(documents[4]) == 71
    assert documents[6] == "prose:doc-9"
    assert "jane.doe" not in orjson.dumps(page).decode()
    with db.new_session() as session:
        stored = list(session.scalars(select(Trace.document).order_by(Trace.id)))
    assert stored == documents

    bad: list[Any] = ["", "   ", "x" * (MAX_DOCUMENT_CHARS + 1), 7, ["doc"], "doc\x00"]
    response = client.post(
        f"{base}/traces",
        json={"traces": [{"prompt": "p", "completion": "c", "document": d} for d in bad]},
        headers=ingest,
    )
    assert response.status_code == 422, response.text
    problems = {(p["index"], p["field"]) for p in response.json()["error"]["details"]}
    assert problems == {(i, "document") for i in range(len(bad))}
    lines = b"".join(orjson.dumps({"prompt": "p", "completion": "c", "document": d}) + b"\n" for d in bad)
    response = client.post(f"{base}/datasets?name=bad", content=lines, headers={**ingest, **NDJSON})
    assert response.status_code == 422, response.text
    assert {p["field"] for p in response.json()["error"]["details"]} == {"document"}
    with db.new_session() as session:
        assert len(list(session.scalars(select(Trace.id)))) == 7  # nothing of the refused bodies


def _documents(prefix: str, held: bool, n: int) -> list[str]:
    """``n`` document labels that the seed-0 split holds out (``held``) or trains on."""
    names = (f"{prefix}:doc-{i}" for i in itertools.count())
    return list(
        itertools.islice(
            (d for d in names if is_held_out(content_key("", d), 0, REALIGN_HOLDOUT_SHARE) == held), n
        )
    )


def _store(db: Database, deployment_id: int, at: datetime, items: list[TraceInput]) -> None:
    with db.new_session() as session:
        store_traces(session=session, deployment_id=deployment_id, items=items, now=at)
        session.commit()


def test_the_replay_selects_only_requests_whose_prompt_and_document_never_reached_training(
    db: Database,
) -> None:
    with db.new_session() as session:
        deployment_id = add_deployment(session, "acme", "svc").id
        session.commit()
    trained_docs, held_docs = _documents("win", False, 12), _documents("win", True, 4)
    older_docs = _documents("old", False, 4)
    since, end = BASE - timedelta(hours=1), BASE
    # Older traffic (the replay pool), then the training window.
    older = [TraceInput(f"Old question {i}", f"old answer {i}", None, older_docs[i % 4]) for i in range(12)]
    _store(db, deployment_id, since - timedelta(hours=1), older)
    window = [
        TraceInput(f"Window question {i}", f"answer {i}", None, trained_docs[i % 12]) for i in range(36)
    ]
    window += [TraceInput(f"Held question {i}", f"held answer {i}", None, held_docs[i % 4]) for i in range(8)]
    # A prompt of a held-out document that was also sent from a trained one: held out by its key,
    # yet its text reached training, so it is neither scored nor replayed.
    window += [
        TraceInput("Shared question", "shared answer x", None, held_docs[0]),
        TraceInput("shared   QUESTION", "shared answer y", None, trained_docs[0]),
    ]
    _store(db, deployment_id, end, window)
    with db.new_session() as session:
        deployment = session.get_one(Deployment, deployment_id)
        job_id = request_realign(
            session=session, deployment=deployment, params={"since": since.isoformat()}
        ).job.id
        session.commit()
        inputs = realign_inputs(session=session, job_id=job_id)
    # Traffic after the window: repeats of what was trained on, and new requests.
    fresh = [
        TraceInput("  WINDOW question 5\n", "repeat", None, None),  # a trained prompt, respelled
        TraceInput("A new question", "new doc text", None, trained_docs[3]),  # a trained document
        TraceInput("old QUESTION 2", "old repeat", None, None),  # a prompt of the replay pool
        *(TraceInput(f"Fresh question {i}", f"fresh {i}", None, f"fresh:doc-{i}") for i in range(5)),
    ]
    _store(db, deployment_id, end + timedelta(hours=1), fresh)
    with db.new_session() as session:
        version = DrafterVersion(
            deployment_id=deployment_id,
            version=1,
            training_job_id=job_id,
            traffic_window_start=end,
            traffic_window_end=end,
            artifact_path="/artifacts/v1",
            artifact_sha256=f"{1:064d}",
            state=DrafterState.candidate,
            training_metrics={"seed": 0},
            eval_metrics={},
        )
        session.add(version)
        session.commit()
        chosen = held_out_requests(session=session, deployment_id=deployment_id, candidate=version, n=100)
        trained = trained_content(session=session, version=version)
        # The canary's replay plans exactly this selection and keeps its figures on the canary.
        session.execute(
            update(Deployment)
            .where(Deployment.id == deployment_id)
            .values(canary_policy={"shadow_prompts": 100})
        )
        canary, replay_job = start_canary(session=session, version=version)
        session.commit()
        plan = claim_replay(session=session, job_id=replay_job.id, delivery_id=None).plan
        session.commit()
        assert plan is not None and plan.requests == chosen.requests and plan.selection == chosen.figures
        assert session.get_one(Canary, canary.id).arms["shadow_selection"] == chosen.figures

    prompts = {p for p, _ in chosen.requests}
    assert prompts == {f"Fresh question {i}" for i in range(5)} | {f"Held question {i}" for i in range(8)}
    assert chosen.figures == {
        "requests": 13,
        "fresh": 5,
        "window_held_out": 8,
        "skipped_as_trained": 4,  # the respelled prompt, the trained document, the pool's, the shared one
        "heldout_prompt_overlap": 0,
    }
    # The trainer, given the same traces, trains on none of the replayed prompts or documents.
    recent_texts = [TraceText(t.key, t.prompt, t.completion, t.category, t.document) for t in inputs.recent]
    older_texts = [TraceText(t.key, t.prompt, t.completion, t.category, t.document) for t in inputs.older]
    assert len(recent_texts) == len(window) and len(older_texts) == len(older)
    tokenizer = Tokenizer.from_file(REFERENCE_TARGET)
    cfg = RealignConfig(seed=0, replay_share=0.5, max_holdout_rows=100)
    data = build_dataset(recent_texts, older_texts, tokenizer, cfg, max_len=256)
    assert data.split["heldout_prompt_overlap"] == 0 and data.split["held_out_dropped_as_trained"] == 1
    assert len(data.held_out) == 8  # the held documents' own prompts, as the replay chose them
    by_prompt = {t.prompt: t for t in recent_texts + older_texts}
    trained_rows = [
        by_prompt[tokenizer.decode(ids[:start].tolist())]
        for ids, start in zip(data.train.ids, data.train.starts, strict=True)
    ]
    assert len(trained_rows) == 36 + 1 + len(older)  # the window's trained share, and the whole pool replayed
    assert all(trained.overlaps(t.content) for t in trained_rows)  # the replay's reckoning covers them
    replayed = [t for t in recent_texts if t.prompt in prompts]
    assert not {prompt_hash(p) for p in prompts} & {prompt_hash(t.prompt) for t in trained_rows}
    assert not {t.document for t in replayed} & {t.document for t in trained_rows}
