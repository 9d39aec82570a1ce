"""The artifact store against a real S3-compatible server (moto's, as a child process) and a
directory: what is uploaded comes back byte for byte through the verified cache, and a changed,
missing or re-manifested object, a tampered file on the shared volume and a bad URI are refused."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from controlplane.artifacts.manifest import MANIFEST_NAME, ArtifactVerificationError, write_manifest
from controlplane.artifacts.store import (
    ArtifactStoreError,
    FileArtifactStore,
    S3ArtifactStore,
    VerifiedArtifactCache,
    artifact_uri_is_supported,
    check_artifact_uri,
    open_store,
)
from tests import s3_server
from tests.s3_server import checking_credentials, s3_client

# The real S3 server's fixtures, bound here so pytest finds them for this module's tests.
s3_endpoint = s3_server.s3_endpoint
s3_bucket = s3_server.s3_bucket

ARTIFACT_FILES = {
    "config.json": b'{"architectures": ["LlamaForCausalLM"], "hidden_size": 16}\n',
    "model.safetensors": bytes(range(256)) * 64,
    "tokenizer.json": b'{"model": {"type": "BPE", "vocab": {"a": 0, "b": 1}}}\n',
    "speculative_config.json": b'{"method": "draft_model", "num_speculative_tokens": 4}\n',
}
KEY = "acme/chat/v1"


def make_artifact(root: Path, name: str = "drafter") -> tuple[Path, str]:
    folder = root / name
    folder.mkdir(parents=True)
    for file_name, data in ARTIFACT_FILES.items():
        (folder / file_name).write_bytes(data)
    return folder, write_manifest(folder, metadata={"job": "test"})


def object_key(uri: str, name: str) -> tuple[str, str]:
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    return bucket, f"{prefix}/{name}"


def read_object(endpoint: str, uri: str, name: str) -> bytes:
    bucket, key = object_key(uri, name)
    body: bytes = s3_client(endpoint).get_object(Bucket=bucket, Key=key)["Body"].read()
    return body


def put_object(endpoint: str, uri: str, name: str, data: bytes) -> None:
    bucket, key = object_key(uri, name)
    s3_client(endpoint).put_object(Bucket=bucket, Key=key, Body=data)


def flipped(data: bytes, at: int = 0) -> bytes:
    changed = bytearray(data)
    changed[at] ^= 0x01
    return bytes(changed)


def cache_entries(cache_dir: Path) -> list[str]:
    return sorted(p.name for p in cache_dir.iterdir()) if cache_dir.exists() else []


@pytest.fixture
def uploaded(s3_bucket: str, s3_endpoint: str, tmp_path: Path) -> tuple[str, str]:
    """An artifact uploaded to the test bucket: (its URI, its manifest's sha256)."""
    folder, digest = make_artifact(tmp_path / "local")
    store = open_store(s3_bucket, s3_endpoint_url=s3_endpoint)
    return store.upload_folder(folder, KEY), digest


# -- s3:// ------------------------------------------------------------------------------------


def test_an_uploaded_artifact_comes_back_byte_for_byte_through_the_cache(
    s3_bucket: str,
    s3_endpoint: str,
    tmp_path: Path,
) -> None:
    folder, digest = make_artifact(tmp_path / "local")
    store = open_store(s3_bucket, s3_endpoint_url=s3_endpoint)
    assert isinstance(store, S3ArtifactStore) and store.base_uri == s3_bucket
    uri = store.upload_folder(folder, KEY)
    assert uri == f"{s3_bucket}/{KEY}" == store.uri_for(KEY)

    bucket, _ = object_key(uri, "")
    listed = s3_client(s3_endpoint).list_objects_v2(Bucket=bucket)["Contents"]
    assert sorted(item["Key"] for item in listed) == sorted(
        f"artifacts/{KEY}/{name}" for name in [*ARTIFACT_FILES, MANIFEST_NAME]
    )

    cache_dir = tmp_path / "cache"
    local = VerifiedArtifactCache(cache_dir, s3_endpoint_url=s3_endpoint).local_folder(uri, digest)
    assert local.parent == cache_dir
    assert sorted(p.name for p in local.iterdir()) == sorted([*ARTIFACT_FILES, MANIFEST_NAME])
    for name in [*ARTIFACT_FILES, MANIFEST_NAME]:
        assert (local / name).read_bytes() == (folder / name).read_bytes(), name
    assert cache_entries(cache_dir) == [local.name]  # no temporary folder left behind


def test_the_manifest_is_uploaded_last_so_a_broken_upload_never_looks_complete(
    s3_bucket: str,
    s3_endpoint: str,
    tmp_path: Path,
) -> None:
    folder, digest = make_artifact(tmp_path / "local")
    real = s3_client(s3_endpoint)

    class RecordingClient:
        """The real client, recording upload order and able to lose the network mid-upload."""

        def __init__(self) -> None:
            self.uploaded_keys: list[str] = []
            self.fail_on_upload: int | None = None

        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def upload_file(self, filename: str, bucket: str, key: str) -> None:
            self.uploaded_keys.append(key)
            if len(self.uploaded_keys) == self.fail_on_upload:
                raise ConnectionError("network gone mid-upload")
            real.upload_file(filename, bucket, key)

    client = RecordingClient()
    bucket, _ = object_key(s3_bucket, "")
    store = S3ArtifactStore(bucket, "artifacts", endpoint_url=s3_endpoint, client=client)
    uri = store.upload_folder(folder, KEY)
    assert client.uploaded_keys[-1] == f"artifacts/{KEY}/{MANIFEST_NAME}"
    assert len(client.uploaded_keys) == len(ARTIFACT_FILES) + 1

    # A second upload under the same key dies half-way: the old manifest was withdrawn first and
    # the new one never written, so readers see an incomplete artifact, not a mix of two.
    client.uploaded_keys, client.fail_on_upload = [], 3
    with pytest.raises(ConnectionError):
        store.upload_folder(folder, KEY)
    with pytest.raises(ArtifactVerificationError, match=f"{MANIFEST_NAME} is missing"):
        VerifiedArtifactCache(tmp_path / "cache", s3_endpoint_url=s3_endpoint).local_folder(uri, digest)


def test_a_one_byte_change_to_an_object_is_refused_and_not_cached(
    uploaded: tuple[str, str],
    s3_endpoint: str,
    tmp_path: Path,
) -> None:
    uri, digest = uploaded
    put_object(s3_endpoint, uri, "model.safetensors", flipped(ARTIFACT_FILES["model.safetensors"], at=1000))
    cache_dir = tmp_path / "cache"
    cache = VerifiedArtifactCache(cache_dir, s3_endpoint_url=s3_endpoint)
    with pytest.raises(ArtifactVerificationError, match=r"model\.safetensors has sha256") as refused:
        cache.local_folder(uri, digest)
    assert uri in str(refused.value)
    assert cache_entries(cache_dir) == []  # the bad download is gone
    assert not cache.cached_path(uri).exists()

    # Put right in the store, the same cache serves it.
    put_object(s3_endpoint, uri, "model.safetensors", ARTIFACT_FILES["model.safetensors"])
    assert (cache.local_folder(uri, digest) / "model.safetensors").read_bytes() == ARTIFACT_FILES[
        "model.safetensors"
    ]


def test_a_deleted_object_is_refused(uploaded: tuple[str, str], s3_endpoint: str, tmp_path: Path) -> None:
    uri, digest = uploaded
    bucket, key = object_key(uri, "tokenizer.json")
    s3_client(s3_endpoint).delete_object(Bucket=bucket, Key=key)
    cache_dir = tmp_path / "cache"
    with pytest.raises(ArtifactVerificationError, match=r"tokenizer\.json is missing") as refused:
        VerifiedArtifactCache(cache_dir, s3_endpoint_url=s3_endpoint).local_folder(uri, digest)
    assert uri in str(refused.value)
    assert cache_entries(cache_dir) == []


def test_a_manifest_rehashed_over_tampered_files_is_refused_by_the_recorded_digest(
    uploaded: tuple[str, str],
    s3_endpoint: str,
    tmp_path: Path,
) -> None:
    uri, digest = uploaded
    forged, forged_digest = make_artifact(tmp_path / "forged")
    (forged / "model.safetensors").write_bytes(flipped(ARTIFACT_FILES["model.safetensors"]))
    forged_digest = write_manifest(forged, metadata={"job": "test"})
    assert forged_digest != digest
    for name in ("model.safetensors", MANIFEST_NAME):
        put_object(s3_endpoint, uri, name, (forged / name).read_bytes())

    cache_dir = tmp_path / "cache"
    cache = VerifiedArtifactCache(cache_dir, s3_endpoint_url=s3_endpoint)
    with pytest.raises(ArtifactVerificationError, match=f"{MANIFEST_NAME} has sha256") as refused:
        cache.local_folder(uri, digest)
    assert uri in str(refused.value)
    assert cache_entries(cache_dir) == []
    # Self-consistent, so only the digest the registry recorded tells it apart.
    assert (cache.local_folder(uri, forged_digest) / "model.safetensors").read_bytes() != ARTIFACT_FILES[
        "model.safetensors"
    ]


def test_a_verified_copy_is_reused_and_still_checked_on_every_call(
    uploaded: tuple[str, str],
    s3_endpoint: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    uri, digest = uploaded
    downloads: list[str] = []
    real_download = S3ArtifactStore.download_folder

    def counting_download(self: S3ArtifactStore, uri: str, into: Path) -> None:
        downloads.append(uri)
        real_download(self, uri, into)

    monkeypatch.setattr(S3ArtifactStore, "download_folder", counting_download)
    cache = VerifiedArtifactCache(tmp_path / "cache", s3_endpoint_url=s3_endpoint)
    first = cache.local_folder(uri, digest)
    second = cache.local_folder(uri, digest)
    assert first == second and downloads == [uri]
    # Another process sharing the cache directory reuses it as well.
    assert (
        VerifiedArtifactCache(tmp_path / "cache", s3_endpoint_url=s3_endpoint).local_folder(uri, digest)
        == first
    )
    assert downloads == [uri]

    # A copy damaged on the local disk is noticed on the next call and fetched afresh.
    (first / "config.json").write_bytes(flipped(ARTIFACT_FILES["config.json"]))
    again = cache.local_folder(uri, digest)
    assert again == first and downloads == [uri, uri]
    assert (again / "config.json").read_bytes() == ARTIFACT_FILES["config.json"]


def test_processes_racing_for_one_artifact_share_one_verified_copy(
    uploaded: tuple[str, str],
    s3_endpoint: str,
    tmp_path: Path,
) -> None:
    uri, digest = uploaded
    cache_dir = tmp_path / "cache"
    start = threading.Barrier(4)
    results: list[Path] = []
    errors: list[BaseException] = []

    def fetch() -> None:
        cache = VerifiedArtifactCache(cache_dir, s3_endpoint_url=s3_endpoint)
        start.wait()
        try:
            results.append(cache.local_folder(uri, digest))
        except BaseException as exc:  # reported below, with the others
            errors.append(exc)

    threads = [threading.Thread(target=fetch) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert errors == [] and len(results) == 4 and len(set(results)) == 1
    assert cache_entries(cache_dir) == [results[0].name]


def test_delete_removes_every_object_and_is_idempotent(
    uploaded: tuple[str, str],
    s3_bucket: str,
    s3_endpoint: str,
    tmp_path: Path,
) -> None:
    uri, digest = uploaded
    store = open_store(s3_bucket, s3_endpoint_url=s3_endpoint)
    store.delete(uri)
    store.delete(uri)
    bucket, _ = object_key(uri, "")
    assert s3_client(s3_endpoint).list_objects_v2(Bucket=bucket).get("Contents", []) == []
    with pytest.raises(ArtifactVerificationError, match=MANIFEST_NAME):
        VerifiedArtifactCache(tmp_path / "cache", s3_endpoint_url=s3_endpoint).local_folder(uri, digest)
    with pytest.raises(ArtifactStoreError, match="not inside the store"):
        store.delete(s3_bucket)


def test_a_missing_bucket_and_refused_or_missing_credentials_are_named(
    s3_bucket: str,
    s3_endpoint: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    folder, digest = make_artifact(tmp_path / "local")
    store = open_store("s3://no-such-bucket/artifacts", s3_endpoint_url=s3_endpoint)
    with pytest.raises(ArtifactStoreError, match="bucket 'no-such-bucket' .*does not exist"):
        store.upload_folder(folder, KEY)
    cache = VerifiedArtifactCache(tmp_path / "cache", s3_endpoint_url=s3_endpoint)
    with pytest.raises(ArtifactStoreError, match="bucket 'no-such-bucket' .*does not exist"):
        cache.local_folder(f"s3://no-such-bucket/artifacts/{KEY}", digest)

    with (
        checking_credentials(s3_endpoint),
        pytest.raises(ArtifactStoreError, match="refused the credentials"),
    ):
        open_store(s3_bucket, s3_endpoint_url=s3_endpoint).upload_folder(folder, KEY)

    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(ArtifactStoreError, match="no S3 credentials"):
        open_store(s3_bucket, s3_endpoint_url=s3_endpoint).upload_folder(folder, KEY)


def test_an_upload_refuses_a_folder_that_does_not_match_its_manifest(
    s3_bucket: str,
    s3_endpoint: str,
    tmp_path: Path,
) -> None:
    folder, _ = make_artifact(tmp_path / "local")
    (folder / "config.json").write_bytes(b"{}")
    with pytest.raises(ArtifactVerificationError, match=r"config\.json"):
        open_store(s3_bucket, s3_endpoint_url=s3_endpoint).upload_folder(folder, KEY)
    bucket, _ = object_key(s3_bucket, "")
    assert s3_client(s3_endpoint).list_objects_v2(Bucket=bucket).get("Contents", []) == []


# -- file:// ----------------------------------------------------------------------------------


def test_the_file_store_publishes_whole_folders_and_verifies_them_in_place(tmp_path: Path) -> None:
    folder, digest = make_artifact(tmp_path / "local")
    root = tmp_path / "shared"
    store = open_store(root.as_uri())
    assert isinstance(store, FileArtifactStore)
    uri = store.upload_folder(folder, KEY)
    assert uri == (root / KEY).as_uri() == store.uri_for(KEY)
    published = root / KEY
    assert sorted(p.name for p in published.parent.iterdir()) == ["v1"]  # no temporary sibling

    cache_dir = tmp_path / "cache"
    cache = VerifiedArtifactCache(cache_dir)
    assert cache.local_folder(uri, digest) == published
    assert cache.local_folder(str(published), digest) == published  # a bare path, as old rows hold
    assert not cache_dir.exists()  # verified where it lies, never copied

    # An upload over an existing key replaces it whole.
    (folder / "config.json").write_bytes(b'{"hidden_size": 32}\n')
    new_digest = write_manifest(folder)
    assert store.upload_folder(folder, KEY) == uri
    assert cache.local_folder(uri, new_digest) == published
    assert sorted(p.name for p in published.parent.iterdir()) == ["v1"]
    with pytest.raises(ArtifactVerificationError, match=f"{MANIFEST_NAME} has sha256"):
        cache.local_folder(uri, digest)

    (published / "model.safetensors").write_bytes(flipped(ARTIFACT_FILES["model.safetensors"], at=7))
    with pytest.raises(ArtifactVerificationError, match=r"model\.safetensors has sha256") as refused:
        cache.local_folder(uri, new_digest)
    assert str(published) in str(refused.value)


def test_the_file_store_downloads_listed_files_only_and_deletes(tmp_path: Path) -> None:
    folder, digest = make_artifact(tmp_path / "local")
    store = FileArtifactStore(tmp_path / "shared")
    uri = store.upload_folder(folder, KEY)
    (tmp_path / "shared" / KEY / "stray.bin").write_bytes(b"not in the manifest")
    into = tmp_path / "copy"
    store.download_folder(uri, into)
    assert sorted(p.name for p in into.iterdir()) == sorted([*ARTIFACT_FILES, MANIFEST_NAME])
    store.delete(uri)
    store.delete(uri)
    assert not (tmp_path / "shared" / KEY).exists()
    with pytest.raises(ArtifactStoreError, match="not inside the store"):
        store.delete((tmp_path / "elsewhere").as_uri())
    with pytest.raises(ArtifactVerificationError, match=f"has no {MANIFEST_NAME}"):
        VerifiedArtifactCache(tmp_path / "cache").local_folder(uri, digest)


# -- bad URIs and keys ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("uri", "reason"),
    [
        ("http://example.com/artifacts", "http://"),
        ("ftp://host/dir", "ftp://"),
        ("relative/dir", "relative path"),
        ("", "non-empty"),
        ("s3://", "no bucket"),
        ("s3:///prefix", "no bucket"),
        ("s3://bucket/a/../b", r"'\.\.'"),
        ("file://otherhost/dir", "host"),
        ("file:relative", "not an absolute path"),
        ("/srv/../etc", r"'\.\.'"),
    ],
)
def test_unsupported_locations_are_refused_clearly(uri: str, reason: str, tmp_path: Path) -> None:
    assert not artifact_uri_is_supported(uri)
    with pytest.raises(ValueError, match=reason):
        check_artifact_uri(uri)
    with pytest.raises(ValueError, match=reason):
        open_store(uri)
    with pytest.raises(ValueError, match=reason):
        VerifiedArtifactCache(tmp_path / "cache").local_folder(uri, None)


def test_supported_locations(tmp_path: Path) -> None:
    for uri in (
        "file:///srv/artifacts",
        "/srv/artifacts",
        "s3://bucket",
        "s3://bucket/a/b",
        tmp_path.as_uri(),
    ):
        assert artifact_uri_is_supported(uri), uri


@pytest.mark.parametrize("key", ["../escape", "a/../../b", "/absolute", "a//b", "a/", "", ".", "a\\b"])
def test_keys_that_could_leave_the_store_are_refused(key: str, tmp_path: Path) -> None:
    folder, _ = make_artifact(tmp_path / "local")
    store = FileArtifactStore(tmp_path / "shared")
    with pytest.raises(ValueError, match="key"):
        store.upload_folder(folder, key)
    with pytest.raises(ValueError, match="key"):
        S3ArtifactStore("bucket", "artifacts").uri_for(key)
    assert not (tmp_path / "shared").exists() or list((tmp_path / "shared").iterdir()) == []
