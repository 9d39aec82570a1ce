"""Loading a model a worker or server was handed (a ``ModelLocation``): verify, then load.

A registered model is loaded only from inside the allowed roots (the operator's model roots, the
bundled reference models and the Hugging Face cache), after every file it records matches its
sha256. A drafter artifact is fetched through the verified artifact cache (``file://`` in place,
``s3://`` into a local copy), which checks its MANIFEST.json against the recorded digest and then
every file the manifest lists. Nothing falls back to another model: a location that does not
verify raises ``ArtifactVerificationError`` (or ``ModelSourceError`` for a folder outside the roots).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from controlplane.artifacts.manifest import verify_files
from controlplane.artifacts.store import VerifiedArtifactCache
from controlplane.config import Settings
from controlplane.models.location import ModelLocation
from controlplane.models.service import allowed_roots
from controlplane.models.sources import resolve_local_folder


def _file_path(uri: str) -> str:
    parsed = urlparse(uri)
    if parsed.scheme == "file":
        return unquote(parsed.path)
    if parsed.scheme == "":
        return uri
    raise ValueError(f"a registered model must be a local folder, not {uri!r}")


class VerifiedModels:
    """Local, verified folders for model locations, each verified once per identity per process
    (a server asks for the same models on every request; a worker once per job)."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._artifacts = VerifiedArtifactCache(
            settings.artifact_cache_dir, s3_endpoint_url=settings.s3_endpoint_url
        )
        self._verified: dict[tuple[str, str], Path] = {}
        self._lock = threading.Lock()

    def folder(self, location: ModelLocation, *, reverify: bool = False) -> Path:
        key = (location.uri, location.identity)
        with self._lock:
            if not reverify and key in self._verified:
                return self._verified[key]
        if location.files:
            folder = resolve_local_folder(_file_path(location.uri), allowed_roots(self._settings))
            verify_files(folder, location.files)
        else:
            folder = self._artifacts.local_folder(location.uri, location.manifest_sha256)
        with self._lock:
            self._verified[key] = folder
        return folder

    def path_of(self, ref: Mapping[str, Any]) -> str:
        """For the serving config's model refs (``ModelLocation.to_dict`` shape)."""
        return str(self.folder(ModelLocation.from_dict(dict(ref))))
