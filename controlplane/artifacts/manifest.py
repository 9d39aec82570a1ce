"""Sha256 manifests: what a model folder held when it was written or registered, and the check
that it still holds exactly that before anything loads it.

A drafter artifact carries its manifest as ``MANIFEST.json`` (``{"files": {name: sha256}, ...}``)
and the database records the sha256 of that file, so a changed manifest is caught as surely as a
changed weight file. A registered model's manifest lives in the registry instead (its folder may
be read-only, a Hugging Face cache snapshot for one).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

MANIFEST_NAME = "MANIFEST.json"
# The files a model folder needs to be loaded; everything else (READMEs, licences, pickled
# originals under original/) is neither hashed nor read. The chat template (chat_template.jinja,
# where transformers 4.43+ saves it) decides what the served model sees, so it is hashed too.
MODEL_FILE_SUFFIXES = (".json", ".safetensors", ".model", ".txt", ".tiktoken", ".jinja")


class ArtifactVerificationError(ValueError):
    """A folder that no longer matches its manifest: a file is missing, changed or unexpected."""


def sha256_of_file(path: str | Path, chunk_size: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk_size):
            digest.update(block)
    return digest.hexdigest()


def model_files(folder: Path) -> list[str]:
    """The top-level files of a model folder that loading reads (see MODEL_FILE_SUFFIXES)."""
    return sorted(
        p.name
        for p in folder.iterdir()
        if p.is_file() and p.name != MANIFEST_NAME and p.name.endswith(MODEL_FILE_SUFFIXES)
    )


def hash_files(folder: Path, names: Iterable[str]) -> dict[str, str]:
    return {name: sha256_of_file(folder / name) for name in sorted(names)}


def write_manifest(folder: str | Path, *, metadata: Mapping[str, Any] | None = None) -> str:
    """Hash every file in ``folder`` into MANIFEST.json and return the manifest's own sha256."""
    path = Path(folder)
    files = hash_files(path, [p.name for p in path.iterdir() if p.is_file() and p.name != MANIFEST_NAME])
    manifest: dict[str, Any] = {"files": files, "metadata": dict(metadata or {})}
    if "model.safetensors" in files:
        manifest["model_sha256"] = files["model.safetensors"]
    (path / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return sha256_of_file(path / MANIFEST_NAME)


def read_manifest(folder: str | Path) -> dict[str, Any]:
    path = Path(folder) / MANIFEST_NAME
    return _parse_manifest(_read_manifest_bytes(path), path)


def _read_manifest_bytes(path: Path) -> bytes:
    if not path.is_file():
        raise ArtifactVerificationError(
            f"{path.parent} has no {MANIFEST_NAME}: refusing an unverifiable artifact"
        )
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ArtifactVerificationError(f"{path} is not a readable manifest: {exc}") from exc


def _parse_manifest(raw: bytes, path: Path) -> dict[str, Any]:
    """The manifest in ``raw`` (the bytes of ``path``), refused unless it maps plain file names to
    sha256 digests: callers use the names as paths and object keys before any file is hashed."""
    try:
        manifest = json.loads(raw)
    except ValueError as exc:
        raise ArtifactVerificationError(f"{path} is not a readable manifest: {exc}") from exc
    if not isinstance(manifest, dict):
        raise ArtifactVerificationError(f"{path} is not a manifest (a JSON object)")
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        raise ArtifactVerificationError(f"{path} lists no files")
    for name, digest in files.items():
        _check_file_name(name, path.parent)
        if not isinstance(digest, str) or not _is_sha256(digest):
            raise ArtifactVerificationError(f"{path} records {digest!r} for {name}, not a sha256 digest")
    return manifest


def _is_sha256(digest: str) -> bool:
    return len(digest) == 64 and all(c in "0123456789abcdef" for c in digest)


def _check_file_name(name: object, folder: Path) -> None:
    if not isinstance(name, str) or name in ("", ".", "..") or any(c in name for c in "/\\\0"):
        raise ArtifactVerificationError(f"manifest of {folder} names {name!r}, not a file in the folder")


def verify_files(folder: str | Path, files: Mapping[str, str]) -> None:
    """Raise ArtifactVerificationError unless every listed file exists with its recorded sha256.

    A model file (see MODEL_FILE_SUFFIXES) that the manifest does not list is refused as well: a
    weights shard slipped in beside the listed ones would otherwise be loaded unverified.
    """
    path = Path(folder)
    if not path.is_dir():
        raise ArtifactVerificationError(f"artifact folder {path} does not exist")
    for name, expected in sorted(files.items()):
        _check_file_name(name, path)
        if not isinstance(expected, str):
            raise ArtifactVerificationError(f"manifest of {path} records {expected!r} for {name}")
        file = path / name
        if not file.is_file():
            raise ArtifactVerificationError(f"{path}: {name} is missing (it is in the manifest)")
        actual = sha256_of_file(file)
        if actual != expected:
            raise ArtifactVerificationError(
                f"{path}: {name} has sha256 {actual[:16]}…, the manifest records {expected[:16]}…; "
                "refusing a changed artifact"
            )
    unexpected = sorted(set(model_files(path)) - set(files))
    if unexpected:
        raise ArtifactVerificationError(
            f"{path}: {', '.join(unexpected)} not in the manifest; refusing to load"
        )


def verify_artifact_folder(folder: str | Path, manifest_sha256: str | None) -> dict[str, Any]:
    """Verify a drafter artifact: its MANIFEST.json (against the recorded digest when one is
    given), then every file it lists. Returns the manifest."""
    path = Path(folder)
    manifest_path = path / MANIFEST_NAME
    # Hash and parse the same bytes: reading the file twice would let a manifest swapped in
    # between be trusted on the strength of its predecessor's digest.
    raw = _read_manifest_bytes(manifest_path)
    if manifest_sha256 is not None:
        actual = hashlib.sha256(raw).hexdigest()
        if actual != manifest_sha256:
            raise ArtifactVerificationError(
                f"{path}: {MANIFEST_NAME} has sha256 {actual[:16]}…, the registry records "
                f"{manifest_sha256[:16]}…; refusing a changed artifact"
            )
    manifest = _parse_manifest(raw, manifest_path)
    verify_files(path, manifest["files"])
    return manifest
