"""The model registry through the REST API: registration from model roots, isolation between
accounts, deployments that name registered models only, tokenizer pairing (padded vocabularies
allowed), default drafters, and deletion rules. Real databases, real model folders."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient
from safetensors.numpy import load_file, save_file

from controlplane.config import Settings
from controlplane.db.models import Job, Role
from tests.conftest import TEST_SECRET, Database, Tenant

REFERENCE = Path(__file__).resolve().parents[2] / "workers" / "models" / "reference"


@pytest.fixture
def model_root(tmp_path: Path) -> Path:
    root = tmp_path / "models"
    root.mkdir()
    return root


@pytest.fixture
def settings(db: Database, model_root: Path, tmp_path: Path) -> Settings:
    # Overrides the shared fixture: this module's models live under its own model root.
    return Settings(
        database_url=db.url,
        environment="test",
        secret_key=TEST_SECRET,
        drift_enqueue_on_ingest=False,
        api_gc_freeze=False,
        model_roots=[model_root],
        hf_cache_dir=tmp_path / "hf-cache",
    )


def _url(tenant: Tenant, suffix: str = "") -> str:
    return f"/v1/accounts/{tenant.name}/models{suffix}"


def _padded_copy(source: Path, dest: Path, rows: int, extra_tokens: list[str]) -> Path:
    """The same model with its embedding padded to ``rows`` and tokens appended to its tokenizer:
    what a larger sibling of a model family looks like next to a smaller one."""
    shutil.copytree(source, dest)
    tensors = load_file(str(dest / "model.safetensors"))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in tensors:
            weight = tensors[name]
            pad = np.zeros((rows - weight.shape[0], weight.shape[1]), dtype=weight.dtype)
            tensors[name] = np.concatenate([weight, pad])
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dest / "config.json").read_text())
    config["vocab_size"] = rows
    (dest / "config.json").write_text(json.dumps(config))
    tokenizer = json.loads((dest / "tokenizer.json").read_text())
    ids = [*tokenizer["model"]["vocab"].values(), *(t["id"] for t in tokenizer.get("added_tokens", []))]
    next_id = max(ids) + 1
    for offset, token in enumerate(extra_tokens):
        tokenizer["added_tokens"].append(
            {
                "id": next_id + offset,
                "content": token,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
        )
    (dest / "tokenizer.json").write_text(json.dumps(tokenizer))
    return dest


def test_platform_pair_is_listed_and_account_models_stay_private(
    client: TestClient, tenants: tuple[Tenant, Tenant], model_root: Path
) -> None:
    acme, globex = tenants
    listed = client.get(_url(acme), headers=acme.headers(Role.viewer)).json()["models"]
    platform = {m["name"]: m for m in listed if m["scope"] == "platform"}
    assert set(platform) == {"reference-target", "reference-drafter"}
    target = platform["reference-target"]
    assert target["family"] == "llama" and target["parameter_count"] > 10_000_000
    assert target["default_drafter"] == "reference-drafter"
    assert platform["reference-drafter"]["drafter_for"] == ["reference-target"]
    assert "model.safetensors" in target["files"] and len(target["manifest_sha256"]) == 64

    shutil.copytree(REFERENCE / "target", model_root / "acme-target")
    created = client.post(
        _url(acme), json={"name": "acme-target", "path": "acme-target"}, headers=acme.headers(Role.admin)
    )
    assert created.status_code == 201, created.text
    assert created.json()["scope"] == "account" and created.json()["source"] == "path"
    assert client.get(_url(acme, "/acme-target"), headers=acme.headers(Role.viewer)).status_code == 200
    # Another account neither sees nor uses it, nor can it delete it.
    assert client.get(_url(globex, "/acme-target"), headers=globex.headers(Role.viewer)).status_code == 404
    names = [
        m["name"] for m in client.get(_url(globex), headers=globex.headers(Role.viewer)).json()["models"]
    ]
    assert "acme-target" not in names
    refused = client.post(
        f"/v1/accounts/{globex.name}/deployments",
        json={"target_model": "acme-target"},
        headers=globex.headers(Role.admin),
    )
    assert refused.status_code == 422
    assert client.delete(_url(globex, "/acme-target"), headers=globex.headers(Role.admin)).status_code == 404
    # Names are unique per account, and a platform name cannot be taken.
    again = client.post(
        _url(acme), json={"name": "acme-target", "path": "acme-target"}, headers=acme.headers(Role.admin)
    )
    assert again.status_code == 409
    shadow = client.post(
        _url(acme), json={"name": "reference-target", "path": "acme-target"}, headers=acme.headers(Role.admin)
    )
    assert shadow.status_code == 409 and "platform model" in shadow.json()["error"]["message"]


def test_paths_outside_the_model_roots_are_refused_alike(
    client: TestClient, tenants: tuple[Tenant, Tenant], model_root: Path, tmp_path: Path
) -> None:
    acme, _ = tenants
    outside = tmp_path / "elsewhere"
    shutil.copytree(REFERENCE / "generic-drafter", outside)
    messages = []
    for path in (str(outside), "../elsewhere", str(tmp_path / "does-not-exist"), "/etc"):
        response = client.post(
            _url(acme), json={"name": "stolen", "path": path}, headers=acme.headers(Role.admin)
        )
        assert response.status_code == 422, (path, response.text)
        messages.append(response.json()["error"]["message"].replace(path, "<path>"))
    # An existing folder and a missing one outside the roots get the same answer: the API does
    # not reveal what exists on the server's disk.
    assert len(set(messages)) == 1, messages
    assert "model root" in messages[0]
    (model_root / "escape").symlink_to(outside)
    linked = client.post(
        _url(acme), json={"name": "stolen", "path": "escape"}, headers=acme.headers(Role.admin)
    )
    assert linked.status_code == 422


def test_hub_ids_resolve_only_through_the_cache_when_offline(
    client: TestClient, tenants: tuple[Tenant, Tenant], monkeypatch: pytest.MonkeyPatch
) -> None:
    acme, _ = tenants
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    response = client.post(
        _url(acme), json={"name": "qwen", "hf_id": "Qwen/Qwen2.5-0.5B@main"}, headers=acme.headers(Role.admin)
    )
    assert response.status_code == 422
    assert "offline" in response.json()["error"]["message"].lower()
    bad = client.post(
        _url(acme), json={"name": "qwen", "hf_id": "../../etc"}, headers=acme.headers(Role.admin)
    )
    assert bad.status_code == 422


def test_deployments_name_registered_models_only_and_no_job_starts(
    client: TestClient, tenants: tuple[Tenant, Tenant], db: Database
) -> None:
    acme, _ = tenants
    url = f"/v1/accounts/{acme.name}/deployments"
    admin = acme.headers(Role.admin)
    for body, named in (
        ({"target_model": "llama-3.1-8b", "deployment_id": "svc"}, "llama-3.1-8b"),
        (
            {
                "target_model": "reference-target",
                "draft_model": "my-drafter",
                "draft_token_count": 4,
                "deployment_id": "svc",
            },
            "my-drafter",
        ),
        ({"target_model": "/work/main/workers/models/reference/target", "deployment_id": "svc"}, "target"),
    ):
        response = client.post(url, json=body, headers=admin)
        assert response.status_code == 422, response.text
        message = response.json()["error"]["message"]
        assert named in message and "controlplane model register" in message
    assert client.get(url, headers=admin).json()["deployments"] == []
    session = db.new_session()
    assert session.query(Job).count() == 0
    session.close()
    created = client.post(
        url, json={"target_model": "reference-target", "deployment_id": "svc"}, headers=admin
    )
    assert created.status_code == 201
    # An update cannot point it at an unregistered model either, and changes nothing.
    moved = client.patch(f"{url}/svc", json={"target_model": "llama-3.1-8b"}, headers=admin)
    assert moved.status_code == 422
    assert client.get(f"{url}/svc", headers=admin).json()["target_model"] == "reference-target"


def test_default_drafters_and_what_a_deployment_says_about_them(
    client: TestClient, tenants: tuple[Tenant, Tenant], model_root: Path
) -> None:
    acme, _ = tenants
    admin = acme.headers(Role.admin)
    deployments = f"/v1/accounts/{acme.name}/deployments"
    inherit = client.post(
        deployments, json={"target_model": "reference-target", "deployment_id": "inherit"}, headers=admin
    )
    body = inherit.json()
    assert body["speculation_mode"] == "default"
    assert (body["registered_drafter"], body["registered_drafter_source"]) == (
        "reference-drafter",
        "target_default",
    )
    config = client.get(f"{deployments}/inherit/serving-config", headers=acme.headers(Role.serving)).json()
    assert config["arms"][0]["speculation"] == "draft_model"
    assert config["arms"][0]["drafter"]["name"] == "reference-drafter"

    shutil.copytree(REFERENCE / "target", model_root / "plain")
    client.post(_url(acme), json={"name": "plain", "path": "plain"}, headers=admin)
    bare = client.post(
        deployments, json={"target_model": "plain", "deployment_id": "bare"}, headers=admin
    ).json()
    assert bare["registered_drafter"] is None and bare["registered_drafter_source"] == "none"
    assert "running without speculation" in bare["speculation_note"]
    config = client.get(f"{deployments}/bare/serving-config", headers=acme.headers(Role.serving)).json()
    assert config["arms"][0]["speculation"] == "disabled" and config["arms"][0]["drafter"] is None

    # A drafter serves only the targets it was registered for.
    refused = client.post(
        deployments,
        json={"target_model": "plain", "draft_model": "reference-drafter", "draft_token_count": 4},
        headers=admin,
    )
    assert refused.status_code == 422 and "not registered as a drafter for 'plain'" in refused.text
    shutil.copytree(REFERENCE / "generic-drafter", model_root / "small")
    small = client.post(
        _url(acme), json={"name": "small", "path": "small", "default_for": ["plain"]}, headers=admin
    )
    assert small.status_code == 201, small.text
    assert small.json()["drafter_for"] == ["plain"]
    now = client.get(f"{deployments}/bare", headers=admin).json()
    assert (now["registered_drafter"], now["registered_drafter_source"]) == ("small", "target_default")
    # Clearing the default turns speculation off again; the platform's defaults are not ours to set.
    cleared = client.patch(_url(acme, "/plain"), json={"default_drafter": None}, headers=admin)
    assert cleared.status_code == 200 and cleared.json()["default_drafter"] is None
    forbidden = client.patch(
        _url(acme, "/reference-target"), json={"default_drafter": "small"}, headers=admin
    )
    assert forbidden.status_code in (403, 422)


def test_tokenizers_must_agree_over_their_shared_range(
    client: TestClient, tenants: tuple[Tenant, Tenant], model_root: Path
) -> None:
    acme, _ = tenants
    admin = acme.headers(Role.admin)
    # A bigger sibling: 64 padding rows and two extra special tokens. Same tokens below 4096.
    _padded_copy(REFERENCE / "target", model_root / "padded", rows=4160, extra_tokens=["<|a|>", "<|b|>"])
    target = client.post(_url(acme), json={"name": "padded", "path": "padded"}, headers=admin)
    assert target.status_code == 201, target.text
    assert (target.json()["embedding_rows"], target.json()["tokenizer_size"]) == (4160, 4098)
    shutil.copytree(REFERENCE / "generic-drafter", model_root / "small")
    drafter = client.post(
        _url(acme), json={"name": "small", "path": "small", "drafter_for": ["padded"]}, headers=admin
    )
    assert drafter.status_code == 201, drafter.text
    created = client.post(
        f"/v1/accounts/{acme.name}/deployments",
        json={"target_model": "padded", "draft_model": "small", "draft_token_count": 4},
        headers=admin,
    )
    assert created.status_code == 201, created.text

    # A drafter whose tokenizer maps two tokens the other way round is refused, naming them.
    swapped = model_root / "swapped"
    shutil.copytree(REFERENCE / "generic-drafter", swapped)
    tokenizer = json.loads((swapped / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[300:302]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (swapped / "tokenizer.json").write_text(json.dumps(tokenizer))
    refused = client.post(
        _url(acme), json={"name": "swapped", "path": "swapped", "drafter_for": ["padded"]}, headers=admin
    )
    assert refused.status_code == 422, refused.text
    message = refused.json()["error"]["message"]
    assert "tokenize differently" in message and "id 300" in message
    assert client.get(_url(acme, "/swapped"), headers=admin).status_code == 404


def test_deleting_models_in_use_or_the_platforms_is_refused(
    client: TestClient, tenants: tuple[Tenant, Tenant], model_root: Path
) -> None:
    acme, _ = tenants
    admin = acme.headers(Role.admin)
    shutil.copytree(REFERENCE / "target", model_root / "mine")
    client.post(_url(acme), json={"name": "mine", "path": "mine"}, headers=admin)
    client.post(
        f"/v1/accounts/{acme.name}/deployments",
        json={"target_model": "mine", "deployment_id": "svc"},
        headers=admin,
    )
    in_use = client.delete(_url(acme, "/mine"), headers=admin)
    assert in_use.status_code == 409 and "svc" in in_use.json()["error"]["message"]
    assert client.delete(_url(acme, "/reference-target"), headers=admin).status_code == 403
    assert client.delete(_url(acme, "/mine"), headers=acme.headers(Role.viewer)).status_code == 403
    assert client.delete(f"/v1/accounts/{acme.name}/deployments/svc", headers=admin).status_code == 204
    assert client.delete(_url(acme, "/mine"), headers=admin).status_code == 204
    assert (model_root / "mine" / "model.safetensors").is_file()  # files are the operator's
    audit = client.get(f"/v1/accounts/{acme.name}/audit", headers=admin).json()["entries"]
    assert {"model.register", "model.delete"} <= {e["action"] for e in audit}
