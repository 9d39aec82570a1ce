"""End-to-end: a very small reference pair built from the corpora, and the committed pair's manifest."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from workers.engine.hf_io import load_hf_folder, sha256_of_file
from workers.training import build_reference

REFERENCE = Path(__file__).resolve().parents[2] / "workers" / "models" / "reference"


@pytest.mark.slow
def test_quick_build_end_to_end(tmp_path: Path) -> None:
    work, out = tmp_path / "work", tmp_path / "out"
    manifest = build_reference.main(["--quick", "--work", str(work), "--out", str(out)])
    assert manifest is not None

    target, tok_t = load_hf_folder(out / "target")
    drafter, tok_d = load_hf_folder(out / "generic-drafter")
    assert tok_t.fingerprint == tok_d.fingerprint == manifest["tokenizer_fingerprint"]
    assert drafter.num_params() < target.num_params()
    for rel, digest in manifest["files"].items():
        assert sha256_of_file(out / rel) == digest
    for model in ("target", "generic-drafter"):
        assert set(manifest["validation_loss_nats_per_token"][model]) == {"prose", "code", "structured"}
    recipe = manifest["recipe"]
    assert recipe["seed"] == 0 and recipe["target"]["steps_run"] == recipe["target"]["config"]["steps"]
    assert recipe["traces"]["domain"] == "prose"
    assert all(len(v) == build_reference.SAMPLE_PROMPTS_PER_DOMAIN for v in manifest["samples"].values())

    # --resume reuses every finished stage: same weights, no retraining.
    again = build_reference.main(["--quick", "--resume", "--work", str(work), "--out", str(out)])
    assert again is not None and again["files"] == manifest["files"]


def test_committed_reference_matches_its_manifest() -> None:
    # The reference pair is committed so that demos and tests start in seconds: it must be there.
    manifest_file = REFERENCE / "MANIFEST.json"
    assert manifest_file.is_file(), "workers/models/reference is missing: run `controlplane models build`"
    manifest = json.loads(manifest_file.read_text())
    for rel, digest in manifest["files"].items():
        assert sha256_of_file(REFERENCE / rel) == digest, rel
    size = sum((REFERENCE / rel).stat().st_size for rel in manifest["files"])
    assert size < 30 * 2**20
    _, tok_t = load_hf_folder(REFERENCE / "target")
    _, tok_d = load_hf_folder(REFERENCE / "generic-drafter")
    assert tok_t.fingerprint == tok_d.fingerprint == manifest["tokenizer_fingerprint"]
