"""Sha256 manifests on a real folder: a one-byte change to any file, a missing file, an unlisted
weights file and a manifest naming paths are all refused, each with the file's name."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from controlplane.artifacts.manifest import (
    MANIFEST_NAME,
    ArtifactVerificationError,
    read_manifest,
    sha256_of_file,
    verify_artifact_folder,
    verify_files,
    write_manifest,
)

FILES = {
    "config.json": b'{"hidden_size": 8}\n',
    "model.safetensors": bytes(range(256)) * 4,
    "tokenizer.json": b'{"model": {"vocab": {"a": 0}}}\n',
    "README.md": b"not a model file, hashed all the same\n",
}


@pytest.fixture
def artifact(tmp_path: Path) -> tuple[Path, str]:
    folder = tmp_path / "drafter"
    folder.mkdir()
    for name, data in FILES.items():
        (folder / name).write_bytes(data)
    return folder, write_manifest(folder, metadata={"base": "tiny"})


def flip_one_byte(path: Path, at: int = 0) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def test_written_manifest_lists_every_file_and_returns_its_own_digest(artifact: tuple[Path, str]) -> None:
    folder, digest = artifact
    manifest = read_manifest(folder)
    assert set(manifest["files"]) == set(FILES)
    assert manifest["files"]["model.safetensors"] == sha256_of_file(folder / "model.safetensors")
    assert manifest["model_sha256"] == manifest["files"]["model.safetensors"]
    assert manifest["metadata"] == {"base": "tiny"}
    assert digest == sha256_of_file(folder / MANIFEST_NAME)
    assert verify_artifact_folder(folder, digest) == manifest
    assert verify_artifact_folder(folder, None) == manifest


@pytest.mark.parametrize("name", [*FILES, MANIFEST_NAME])
def test_a_one_byte_change_to_any_file_is_refused_naming_it(artifact: tuple[Path, str], name: str) -> None:
    folder, digest = artifact
    path = folder / name
    if name == MANIFEST_NAME:
        # The last hex digit of model_sha256: the manifest stays valid JSON, so the recorded
        # digest, not the parser, is what refuses it.
        flip_one_byte(path, at=path.read_bytes().rindex(b'"') - 1)
        json.loads(path.read_bytes())
    else:
        flip_one_byte(path, at=path.stat().st_size - 1)
    with pytest.raises(ArtifactVerificationError, match=name.replace(".", r"\.")):
        verify_artifact_folder(folder, digest)


def test_a_changed_file_is_refused_by_the_file_check_alone(artifact: tuple[Path, str]) -> None:
    folder, _ = artifact
    files = read_manifest(folder)["files"]
    flip_one_byte(folder / "tokenizer.json", at=3)
    with pytest.raises(ArtifactVerificationError, match=r"tokenizer\.json has sha256"):
        verify_files(folder, files)
    with pytest.raises(ArtifactVerificationError, match=r"tokenizer\.json"):
        verify_artifact_folder(folder, None)


def test_a_missing_file_is_refused(artifact: tuple[Path, str]) -> None:
    folder, digest = artifact
    (folder / "config.json").unlink()
    with pytest.raises(ArtifactVerificationError, match=r"config\.json is missing"):
        verify_artifact_folder(folder, digest)


def test_a_missing_manifest_is_refused(artifact: tuple[Path, str]) -> None:
    folder, digest = artifact
    (folder / MANIFEST_NAME).unlink()
    with pytest.raises(ArtifactVerificationError, match=f"has no {MANIFEST_NAME}"):
        verify_artifact_folder(folder, digest)


@pytest.mark.parametrize("name", ["model-00002-of-00002.safetensors", "chat_template.jinja"])
def test_an_unlisted_file_that_loading_reads_is_refused(artifact: tuple[Path, str], name: str) -> None:
    # A chat template slipped in after registration changes every prompt the model is served.
    folder, digest = artifact
    (folder / name).write_bytes(b"\0" * 16)
    with pytest.raises(ArtifactVerificationError, match=re.escape(f"{name} not in the manifest")):
        verify_artifact_folder(folder, digest)


def test_an_unlisted_file_that_loading_never_reads_is_tolerated(artifact: tuple[Path, str]) -> None:
    folder, digest = artifact
    (folder / "NOTES.md").write_text("added after the manifest\n")
    verify_artifact_folder(folder, digest)


def test_a_manifest_swapped_for_one_over_changed_files_is_refused_by_its_digest(
    artifact: tuple[Path, str],
) -> None:
    folder, digest = artifact
    flip_one_byte(folder / "model.safetensors", at=100)
    rehashed = write_manifest(folder, metadata={"base": "tiny"})
    verify_artifact_folder(folder, None)  # consistent with itself...
    assert rehashed != digest
    with pytest.raises(ArtifactVerificationError, match=f"{MANIFEST_NAME} has sha256"):
        verify_artifact_folder(folder, digest)  # ...but not the manifest the registry recorded


@pytest.mark.parametrize("bad_name", ["../escape.json", "/etc/passwd", "sub/model.safetensors", "..", "a\\b"])
def test_path_like_names_in_a_manifest_are_refused(artifact: tuple[Path, str], bad_name: str) -> None:
    folder, _ = artifact
    manifest = read_manifest(folder)
    manifest["files"][bad_name] = "0" * 64
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(ArtifactVerificationError, match="not a file in the folder") as refused:
        read_manifest(folder)
    assert repr(bad_name) in str(refused.value)
    with pytest.raises(ArtifactVerificationError, match="not a file in the folder"):
        verify_artifact_folder(folder, None)
    with pytest.raises(ArtifactVerificationError, match="not a file in the folder"):
        verify_files(folder, manifest["files"])


@pytest.mark.parametrize(
    "content",
    [b"not json", b"[1, 2]", b'{"files": {}}', b'{"files": {"config.json": 7}}', b'{"files": []}'],
)
def test_a_malformed_manifest_is_refused(artifact: tuple[Path, str], content: bytes) -> None:
    folder, _ = artifact
    (folder / MANIFEST_NAME).write_bytes(content)
    with pytest.raises(ArtifactVerificationError, match=MANIFEST_NAME.replace(".", r"\.")):
        verify_artifact_folder(folder, None)


def test_a_missing_folder_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ArtifactVerificationError, match="does not exist"):
        verify_files(tmp_path / "nowhere", {"config.json": "0" * 64})
