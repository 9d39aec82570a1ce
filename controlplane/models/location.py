"""What a worker or a server is handed to load one model: where its files are and how to verify them.

Two kinds: a registered model (a folder under a model root or the Hugging Face cache, verified
against the registry's per-file sha256 list) and a drafter artifact (a ``file://`` or ``s3://`` URI,
verified against the sha256 of its MANIFEST.json, then every file the manifest lists), and what
kind of drafter a trained version is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from controlplane.db.models import DrafterVersion


@dataclass(frozen=True, slots=True)
class ModelLocation:
    name: str
    uri: str
    # A registered model: the sha256 of each file loading reads.
    files: dict[str, str] = field(default_factory=dict)
    # A drafter artifact: the sha256 of its MANIFEST.json.
    manifest_sha256: str | None = None
    # What identifies these exact bytes (a cache key): the manifest digest either way.
    identity: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "uri": self.uri,
            "files": dict(self.files),
            "manifest_sha256": self.manifest_sha256,
            "identity": self.identity,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelLocation:
        return cls(
            name=str(data["name"]),
            uri=str(data["uri"]),
            files={str(k): str(v) for k, v in (data.get("files") or {}).items()},
            manifest_sha256=data.get("manifest_sha256"),
            identity=str(data.get("identity") or ""),
        )


def drafter_kind_of(version: DrafterVersion) -> str:
    """What the version is: "draft_model" (a small causal LM) or "eagle3" (a head over the target's
    states), as the job that trained it recorded; versions from before heads are small models."""
    kind = (version.training_metrics or {}).get("drafter_kind")
    return kind if kind in ("draft_model", "eagle3") else "draft_model"


def location_of_version(version: DrafterVersion) -> ModelLocation:
    """Where a trained version's artifact is (its URI; rows from before the store hold a bare
    path) and the manifest digest every load checks."""
    uri = version.artifact_path
    if "://" not in uri:
        uri = Path(uri).resolve().as_uri()
    return ModelLocation(
        name=f"drafter-v{version.version}",
        uri=uri,
        manifest_sha256=version.manifest_sha256,
        identity=version.manifest_sha256 or version.artifact_sha256,
    )
