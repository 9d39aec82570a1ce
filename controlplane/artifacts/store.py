"""The artifact store: where drafter folders live once written, addressed by URI, and the verified
local copy every loader reads.

A store is a ``file://`` directory (a volume every process mounts at the same path) or an
``s3://bucket/prefix`` (AWS S3, MinIO, any S3-compatible service). An artifact is a flat folder
with its ``MANIFEST.json`` stored under ``<base>/<key>/``; the manifest is written last, so an
artifact whose upload stopped half-way never looks complete, and read first, so a download fetches
exactly the files it names. ``VerifiedArtifactCache`` turns an artifact URI into a local folder
whose every file has just been checked against the manifest (and the manifest against the digest
the database records): the one guard between shared bytes and a model load.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
import uuid
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import unquote, urlsplit

from controlplane.artifacts.manifest import (
    MANIFEST_NAME,
    ArtifactVerificationError,
    read_manifest,
    verify_artifact_folder,
    verify_files,
)


class ArtifactStoreError(RuntimeError):
    """The store could not do what was asked: bucket missing, credentials refused, unreachable..."""


class ArtifactObjectMissingError(ArtifactStoreError):
    """An object the artifact needs (its manifest, or a file the manifest lists) is not in the store."""


class ArtifactStore(Protocol):
    """Moves flat artifact folders to and from one base location."""

    @property
    def base_uri(self) -> str: ...

    def uri_for(self, key: str) -> str:
        """The URI an artifact uploaded under ``key`` gets."""
        ...

    def upload_folder(self, folder: Path, key: str) -> str:
        """Copy every file of ``folder`` to ``<base>/<key>/`` (MANIFEST.json last); return its URI."""
        ...

    def download_folder(self, uri: str, into: Path) -> None:
        """Copy the artifact at ``uri`` into ``into``: MANIFEST.json, then each file it lists."""
        ...

    def delete(self, uri: str) -> None:
        """Remove the artifact at ``uri`` (its manifest first); nothing there is not an error."""
        ...


def open_store(base_uri: str, *, s3_endpoint_url: str | None = None) -> ArtifactStore:
    """The store at ``base_uri``: ``file:///dir`` (or an absolute path) or ``s3://bucket/prefix``."""
    scheme = _scheme(base_uri)
    if scheme == "file":
        return FileArtifactStore(_file_path(base_uri))
    bucket, prefix = _s3_location(base_uri)
    return S3ArtifactStore(bucket, prefix, endpoint_url=s3_endpoint_url)


def check_artifact_uri(uri: str) -> None:
    """Raise ValueError, saying why, unless ``uri`` names a location a store can read."""
    if _scheme(uri) == "file":
        _file_path(uri)
    else:
        _s3_location(uri)


def artifact_uri_is_supported(uri: str) -> bool:
    try:
        check_artifact_uri(uri)
    except ValueError:
        return False
    return True


def check_artifact_key(key: str) -> list[str]:
    """The parts of a relative key such as ``acme/chat/v3``; ValueError for anything that could
    name a place outside the store's base or that two stores would spell differently."""
    if not isinstance(key, str) or not key:
        raise ValueError("an artifact key must be a non-empty relative path such as 'account/model/v1'")
    if key.startswith("/"):
        raise ValueError(f"artifact key {key!r} is absolute; keys are relative to the store's base")
    if "\\" in key or "\0" in key:
        raise ValueError(f"artifact key {key!r} holds a backslash or NUL")
    parts = key.split("/")
    for part in parts:
        if part in ("", ".", ".."):
            raise ValueError(f"artifact key {key!r} has an empty, '.' or '..' part")
    return parts


# -- URIs -------------------------------------------------------------------------------------


def _scheme(uri: str) -> str:
    if not isinstance(uri, str) or not uri:
        raise ValueError("an artifact URI must be a non-empty string")
    if uri.startswith("/"):
        return "file"  # a bare absolute path, as older rows hold
    scheme = urlsplit(uri).scheme.lower()
    if scheme in ("file", "s3"):
        return scheme
    if not scheme:
        raise ValueError(
            f"artifact location {uri!r} is a relative path; use file:///absolute/dir or s3://bucket/prefix"
        )
    raise ValueError(
        f"artifact location {uri!r} has scheme {scheme}://, which no store reads; "
        "use file:///absolute/dir or s3://bucket/prefix"
    )


def _file_path(uri: str) -> Path:
    if uri.startswith("/"):
        path = uri
    else:
        parts = urlsplit(uri)
        if parts.netloc not in ("", "localhost"):
            raise ValueError(f"{uri!r} names host {parts.netloc!r}; a file:// store is local (file:///dir)")
        if parts.query or parts.fragment:
            raise ValueError(f"{uri!r} has a query or fragment; a file:// URI is a path only")
        path = unquote(parts.path)
    if not path.startswith("/"):
        raise ValueError(f"{uri!r} is not an absolute path")
    if "\0" in path or ".." in path.split("/"):
        raise ValueError(f"{uri!r} holds '..' or NUL; refusing a path that can climb out")
    return Path(os.path.normpath(path))


def _s3_location(uri: str) -> tuple[str, str]:
    """(bucket, key prefix without slashes at either end) of ``s3://bucket/prefix``."""
    parts = urlsplit(uri)
    if parts.scheme.lower() != "s3":
        raise ValueError(f"{uri!r} is not an s3:// URI")
    bucket = parts.netloc
    if not bucket or "@" in bucket or ":" in bucket:
        raise ValueError(f"{uri!r} names no bucket; use s3://bucket/prefix")
    if parts.query or parts.fragment:
        raise ValueError(f"{uri!r} has a query or fragment; an s3:// URI is a bucket and a prefix only")
    prefix = parts.path.strip("/")
    if prefix:
        try:
            check_artifact_key(prefix)
        except ValueError as exc:
            raise ValueError(f"{uri!r}: {exc}") from exc
    return bucket, prefix


def _relative_key(uri_path: str, base_path: str, uri: str, base_uri: str) -> str:
    """The key of ``uri`` under the store's base, refusing URIs elsewhere or the base itself."""
    if base_path and not uri_path.startswith(base_path + "/"):
        raise ArtifactStoreError(f"{uri} is not inside the store {base_uri}")
    key = uri_path[len(base_path) + 1 :] if base_path else uri_path
    try:
        check_artifact_key(key)
    except ValueError as exc:
        raise ArtifactStoreError(f"{uri} names no artifact inside the store {base_uri}: {exc}") from exc
    return key


def _upload_order(folder: Path) -> list[str]:
    """The folder's files, MANIFEST.json last; refuses a folder that does not match its manifest,
    so a damaged local artifact is never published under a URI others trust."""
    if not folder.is_dir():
        raise ArtifactStoreError(f"cannot upload {folder}: not a folder")
    verify_files(folder, read_manifest(folder)["files"])
    names = sorted(p.name for p in folder.iterdir() if p.is_file() and p.name != MANIFEST_NAME)
    return [*names, MANIFEST_NAME]


# -- file:// ----------------------------------------------------------------------------------


class FileArtifactStore:
    """A directory every process mounts at the same path (a shared volume or network file system).

    Uploads are written to a hidden temporary sibling and renamed into place, so readers see a
    whole artifact or none.
    """

    def __init__(self, root: Path) -> None:
        if not root.is_absolute():
            raise ValueError(f"a file artifact store needs an absolute directory, not {str(root)!r}")
        self.root = Path(os.path.normpath(root))

    @property
    def base_uri(self) -> str:
        return self.root.as_uri()

    def uri_for(self, key: str) -> str:
        return (self.root.joinpath(*check_artifact_key(key))).as_uri()

    def upload_folder(self, folder: Path, key: str) -> str:
        final = self.root.joinpath(*check_artifact_key(key))
        names = _upload_order(folder)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.with_name(f".{final.name}.tmp-{uuid.uuid4().hex}")
        tmp.mkdir()
        try:
            for name in names:
                _copy_durably(folder / name, tmp / name)
            _fsync_dir(tmp)
            if final.exists():
                # Move the previous upload aside rather than delete it in place, so the key is
                # missing for one rename, never half-deleted.
                old = final.with_name(f".{final.name}.old-{uuid.uuid4().hex}")
                final.rename(old)
                shutil.rmtree(old, ignore_errors=True)
            tmp.rename(final)
            _fsync_dir(final.parent)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return final.as_uri()

    def download_folder(self, uri: str, into: Path) -> None:
        source = self._folder_of(uri)
        if not (source / MANIFEST_NAME).is_file():
            raise ArtifactObjectMissingError(f"{uri} has no {MANIFEST_NAME}: no complete artifact there")
        into.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source / MANIFEST_NAME, into / MANIFEST_NAME)
        for name in sorted(read_manifest(into)["files"]):
            if not (source / name).is_file():
                raise ArtifactObjectMissingError(f"{uri}: {name} is missing (it is in the manifest)")
            shutil.copyfile(source / name, into / name)

    def delete(self, uri: str) -> None:
        folder = self._folder_of(uri)
        # The manifest goes first, so a delete that stops half-way leaves an incomplete artifact
        # that every reader refuses, never a complete-looking one missing a file.
        (folder / MANIFEST_NAME).unlink(missing_ok=True)
        _discard(folder)

    def _folder_of(self, uri: str) -> Path:
        try:
            path = _file_path(uri) if _scheme(uri) == "file" else None
        except ValueError as exc:
            raise ArtifactStoreError(str(exc)) from exc
        if path is None:
            raise ArtifactStoreError(f"{uri} is not a file:// URI; this store is {self.base_uri}")
        if not path.is_relative_to(self.root):
            raise ArtifactStoreError(f"{uri} is not inside the store {self.base_uri}")
        try:
            check_artifact_key(path.relative_to(self.root).as_posix())
        except ValueError as exc:
            raise ArtifactStoreError(f"{uri} names no artifact inside the store {self.base_uri}") from exc
        return path


def _copy_durably(source: Path, target: Path) -> None:
    shutil.copyfile(source, target)
    with open(target, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- s3:// ------------------------------------------------------------------------------------


class S3ArtifactStore:
    """A bucket and key prefix of AWS S3 or any S3-compatible service, through boto3.

    Credentials come from boto3's usual chain (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, a profile,
    an instance role); ``endpoint_url`` points it at MinIO, Ceph or moto instead of AWS.
    """

    def __init__(
        self, bucket: str, prefix: str = "", *, endpoint_url: str | None = None, client: Any = None
    ) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        if self.prefix:
            check_artifact_key(self.prefix)
        self.endpoint_url = endpoint_url or None  # an empty setting means AWS itself
        self._client = client
        self._client_lock = threading.Lock()

    @property
    def base_uri(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"

    def uri_for(self, key: str) -> str:
        return f"s3://{self.bucket}/{self._object_prefix(key)}"

    @property
    def client(self) -> Any:
        # boto3 is imported and the client built on first use: a process that never touches S3
        # (the API, the CLI) pays for neither.
        with self._client_lock:
            if self._client is None:
                import boto3
                from botocore.config import Config

                session = boto3.session.Session()
                self._client = session.client(
                    "s3",
                    endpoint_url=self.endpoint_url,
                    config=Config(
                        connect_timeout=10, read_timeout=120, retries={"max_attempts": 5, "mode": "standard"}
                    ),
                )
            return self._client

    def upload_folder(self, folder: Path, key: str) -> str:
        object_prefix = self._object_prefix(key)
        names = _upload_order(folder)
        with self._errors(f"uploading {folder} to {self.uri_for(key)}"):
            self.client.head_bucket(Bucket=self.bucket)
            # A re-upload first withdraws the old manifest: until the new one lands the artifact
            # reads as incomplete, never as old manifest over new files.
            self.client.delete_object(Bucket=self.bucket, Key=f"{object_prefix}/{MANIFEST_NAME}")
            for name in names:
                self.client.upload_file(str(folder / name), self.bucket, f"{object_prefix}/{name}")
        return self.uri_for(key)

    def download_folder(self, uri: str, into: Path) -> None:
        object_prefix = self._object_prefix_of(uri)
        into.mkdir(parents=True, exist_ok=True)
        with self._errors(f"downloading {uri}", uri=uri, name=MANIFEST_NAME):
            response = self.client.get_object(Bucket=self.bucket, Key=f"{object_prefix}/{MANIFEST_NAME}")
            (into / MANIFEST_NAME).write_bytes(response["Body"].read())
        for name in sorted(read_manifest(into)["files"]):
            with self._errors(f"downloading {uri}", uri=uri, name=name):
                self.client.download_file(self.bucket, f"{object_prefix}/{name}", str(into / name))

    def delete(self, uri: str) -> None:
        object_prefix = self._object_prefix_of(uri)
        with self._errors(f"deleting {uri}"):
            self.client.delete_object(Bucket=self.bucket, Key=f"{object_prefix}/{MANIFEST_NAME}")
            paginator = self.client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=self.bucket, Prefix=f"{object_prefix}/"):
                objects = [{"Key": item["Key"]} for item in page.get("Contents", [])]
                if objects:
                    self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": objects, "Quiet": True})

    def _object_prefix(self, key: str) -> str:
        parts = check_artifact_key(key)
        return "/".join([self.prefix, *parts]) if self.prefix else "/".join(parts)

    def _object_prefix_of(self, uri: str) -> str:
        try:
            bucket, key = _s3_location(uri)
        except ValueError as exc:
            raise ArtifactStoreError(str(exc)) from exc
        if bucket != self.bucket:
            raise ArtifactStoreError(f"{uri} is not in bucket {self.bucket} ({self.base_uri})")
        return self._object_prefix(_relative_key(key, self.prefix, uri, self.base_uri))

    def _errors(self, action: str, *, uri: str | None = None, name: str | None = None) -> _S3Errors:
        return _S3Errors(self, action, uri, name)


class _S3Errors:
    """Turns botocore's exceptions into ArtifactStoreErrors that say what went wrong and where."""

    def __init__(self, store: S3ArtifactStore, action: str, uri: str | None, name: str | None) -> None:
        self.store = store
        self.action = action
        self.uri = uri
        self.name = name

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if exc is None or not isinstance(exc, Exception) or isinstance(exc, ArtifactStoreError):
            return
        error = self._translate(exc)
        if error is not None:
            raise error from exc

    def _translate(self, exc: Exception) -> ArtifactStoreError | None:
        from boto3.exceptions import S3UploadFailedError
        from botocore.exceptions import (
            BotoCoreError,
            ClientError,
            EndpointConnectionError,
            NoCredentialsError,
        )

        store = self.store
        where = f"bucket {store.bucket!r}" + (f" at {store.endpoint_url}" if store.endpoint_url else "")
        if isinstance(exc, NoCredentialsError):
            return ArtifactStoreError(
                f"{self.action}: no S3 credentials found; set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)"
            )
        if isinstance(exc, EndpointConnectionError):
            return ArtifactStoreError(f"{self.action}: cannot reach the S3 endpoint ({exc})")
        if isinstance(exc, ClientError):
            error = exc.response.get("Error", {})
            code = str(error.get("Code", ""))
            if code == "NoSuchBucket" or (code in ("404", "NotFound") and self.name is None):
                return ArtifactStoreError(f"{self.action}: {where} does not exist")
            if code in ("NoSuchKey", "404", "NotFound"):
                return ArtifactObjectMissingError(
                    f"{self.uri}: {self.name} is missing from the store"
                    + (" (it is in the manifest)" if self.name != MANIFEST_NAME else "")
                )
            if code in _REFUSED_CREDENTIAL_CODES:
                return ArtifactStoreError(
                    f"{self.action}: {where} refused the credentials ({code}: {error.get('Message', '')})"
                )
            return ArtifactStoreError(f"{self.action}: {where} answered {code}: {error.get('Message', exc)}")
        if isinstance(exc, S3UploadFailedError | BotoCoreError):
            return ArtifactStoreError(f"{self.action}: {exc}")
        return None


_REFUSED_CREDENTIAL_CODES = frozenset(
    {
        "403",
        "AccessDenied",
        "Forbidden",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
        "TokenRefreshRequired",
    }
)


# -- the verified local copy ------------------------------------------------------------------


class VerifiedArtifactCache:
    """Local folders of artifacts, each verified against its manifest on every request.

    A ``file://`` artifact (or a bare absolute path, as older rows hold) is verified where it lies.
    An ``s3://`` one is copied once under ``cache_dir/<sha256(uri)[:32]>``: downloaded into a
    private temporary folder, verified, then renamed into place, so processes sharing the cache
    never see each other's half-written copies. A copy that fails verification is deleted.
    """

    def __init__(self, cache_dir: Path, *, s3_endpoint_url: str | None = None) -> None:
        self.cache_dir = Path(cache_dir)
        self.s3_endpoint_url = s3_endpoint_url
        self._stores: dict[str, S3ArtifactStore] = {}
        self._stores_lock = threading.Lock()

    def local_folder(self, uri: str, manifest_sha256: str | None) -> Path:
        """A folder holding the artifact at ``uri``, every manifest file verified on this call.

        Raises ArtifactVerificationError (naming the file and the URI) when the artifact does not
        match its manifest or ``manifest_sha256``, ArtifactStoreError when the store cannot be
        read, ValueError for a URI no store reads.
        """
        if _scheme(uri) == "file":
            folder = _file_path(uri)
            verify_artifact_folder(folder, manifest_sha256)
            return folder
        return self._s3_copy(uri, manifest_sha256)

    def cached_path(self, uri: str) -> Path:
        """Where the verified copy of an ``s3://`` artifact lives in this cache."""
        return self.cache_dir / hashlib.sha256(uri.encode()).hexdigest()[:32]

    def _s3_copy(self, uri: str, manifest_sha256: str | None) -> Path:
        bucket, _ = _s3_location(uri)
        target = self.cached_path(uri)
        if target.is_dir():
            try:
                verify_artifact_folder(target, manifest_sha256)
                return target
            except ArtifactVerificationError:
                # A copy damaged on this disk, or one of a manifest the registry no longer
                # records: fetch it afresh rather than refuse what the store may hold intact.
                _discard(target)
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.cache_dir / f".{target.name}.tmp-{uuid.uuid4().hex}"
        try:
            try:
                self._store(bucket).download_folder(uri, tmp)
            except ArtifactObjectMissingError as exc:
                raise ArtifactVerificationError(f"{exc}; refusing an incomplete artifact") from exc
            try:
                verify_artifact_folder(tmp, manifest_sha256)
            except ArtifactVerificationError as exc:
                raise ArtifactVerificationError(str(exc).replace(str(tmp), uri)) from None
            try:
                tmp.rename(target)
                return target
            except OSError:
                if not target.is_dir():
                    raise
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        # Another process renamed its copy into place first: use that one once it verifies here.
        verify_artifact_folder(target, manifest_sha256)
        return target

    def _store(self, bucket: str) -> S3ArtifactStore:
        with self._stores_lock:
            store = self._stores.get(bucket)
            if store is None:
                store = S3ArtifactStore(bucket, endpoint_url=self.s3_endpoint_url)
                self._stores[bucket] = store
            return store


def _discard(folder: Path) -> None:
    """Remove ``folder`` by first renaming it to a unique name, so the name is free at once for
    a good copy and two processes discarding the same folder do not trip over each other."""
    doomed = folder.with_name(f".{folder.name}.discard-{uuid.uuid4().hex}")
    try:
        folder.rename(doomed)
    except FileNotFoundError:
        return
    shutil.rmtree(doomed, ignore_errors=True)
