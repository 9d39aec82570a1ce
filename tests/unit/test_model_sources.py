"""Where a registered model may come from: folders inside the configured model roots only (no
escape by '..', absolute paths or links, and no telling which outside paths exist), holding a
config, a tokenizer and safetensors weights; Hugging Face ids checked like the Hub checks them and
resolved through the cache, offline included."""

from __future__ import annotations

import shutil
from pathlib import Path
from unittest import mock

import huggingface_hub
import pytest
from huggingface_hub import constants
from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

from controlplane.models.sources import (
    ModelSourceError,
    hf_cache_root,
    parse_hf_id,
    resolve_hf_snapshot,
    resolve_local_folder,
    safetensors_weight_files,
)

REFERENCE_DRAFTER = (
    Path(__file__).resolve().parents[2] / "workers" / "models" / "reference" / "generic-drafter"
)
MODEL_FILES = ("config.json", "tokenizer.json", "model.safetensors")
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def make_model(folder: Path) -> Path:
    """A loadable model folder: the reference drafter's config, tokenizer and weights."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in MODEL_FILES:
        shutil.copyfile(REFERENCE_DRAFTER / name, folder / name)
    return folder


@pytest.fixture()
def root(tmp_path: Path) -> Path:
    path = tmp_path / "models"
    path.mkdir()
    return path


def outside_message(error: pytest.ExceptionInfo[ModelSourceError], raw: str) -> str:
    return str(error.value).replace(repr(raw), "<path>")


def test_an_absolute_folder_inside_a_root_resolves(root: Path) -> None:
    folder = make_model(root / "team" / "llama")
    assert resolve_local_folder(str(folder), [root]) == folder.resolve()


def test_a_relative_path_is_tried_under_each_root_in_order(tmp_path: Path) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    make_model(second / "llama")
    assert resolve_local_folder("llama", [first, second]) == (second / "llama").resolve()
    make_model(first / "llama")
    assert resolve_local_folder("llama", [first, second]) == (first / "llama").resolve()


def test_dot_dot_cannot_leave_the_roots(tmp_path: Path, root: Path) -> None:
    make_model(tmp_path / "elsewhere")
    with pytest.raises(ModelSourceError, match="not an existing folder inside the configured model roots"):
        resolve_local_folder("../elsewhere", [root])
    with pytest.raises(ModelSourceError, match="not an existing folder inside"):
        resolve_local_folder(str(root / ".." / "elsewhere"), [root])


def test_an_outside_path_is_refused_alike_whether_or_not_it_exists(tmp_path: Path, root: Path) -> None:
    existing = str(make_model(tmp_path / "elsewhere"))
    missing = str(tmp_path / "nowhere")
    with pytest.raises(ModelSourceError) as refused_existing:
        resolve_local_folder(existing, [root])
    with pytest.raises(ModelSourceError) as refused_missing:
        resolve_local_folder(missing, [root])
    assert outside_message(refused_existing, existing) == outside_message(refused_missing, missing)
    assert str(root) in str(refused_existing.value)
    assert "CONTROLPLANE_MODEL_ROOTS" in str(refused_existing.value)


def test_a_link_leading_out_of_the_roots_is_refused(tmp_path: Path, root: Path) -> None:
    (root / "linked").symlink_to(make_model(tmp_path / "elsewhere"), target_is_directory=True)
    with pytest.raises(ModelSourceError, match="not an existing folder inside"):
        resolve_local_folder("linked", [root])


def test_a_link_between_folders_inside_the_roots_is_followed(root: Path) -> None:
    real = make_model(root / "real")
    (root / "alias").symlink_to(real, target_is_directory=True)
    assert resolve_local_folder("alias", [root]) == real.resolve()


def test_a_model_file_linking_out_of_the_roots_is_refused(tmp_path: Path, root: Path) -> None:
    outside = make_model(tmp_path / "elsewhere")
    folder = make_model(root / "llama")
    (folder / "config.json").unlink()
    (folder / "config.json").symlink_to(outside / "config.json")
    with pytest.raises(ModelSourceError, match="config.json .* link that does not resolve"):
        resolve_local_folder("llama", [root])


def test_a_folder_of_pickled_weights_only_is_refused(root: Path) -> None:
    folder = make_model(root / "pickled")
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    with pytest.raises(ModelSourceError, match="pickles can execute code") as refused:
        resolve_local_folder("pickled", [root])
    assert "pytorch_model.bin" in str(refused.value)


def test_pickles_beside_safetensors_weights_are_ignored(root: Path) -> None:
    folder = make_model(root / "both")
    (folder / "pytorch_model.bin").write_bytes(b"never read")
    assert resolve_local_folder("both", [root]) == folder.resolve()


def test_a_folder_without_a_tokenizer_is_refused(root: Path) -> None:
    (make_model(root / "untokenized") / "tokenizer.json").unlink()
    with pytest.raises(ModelSourceError, match="has no tokenizer.json"):
        resolve_local_folder("untokenized", [root])


def test_a_folder_without_a_config_or_weights_is_refused(root: Path) -> None:
    (make_model(root / "unconfigured") / "config.json").unlink()
    with pytest.raises(ModelSourceError, match="has no config.json"):
        resolve_local_folder("unconfigured", [root])
    (make_model(root / "weightless") / "model.safetensors").unlink()
    with pytest.raises(ModelSourceError, match="holds no safetensors weights"):
        resolve_local_folder("weightless", [root])


def test_a_file_is_not_a_model_folder(root: Path) -> None:
    make_model(root / "llama")
    with pytest.raises(ModelSourceError, match="is a file, not a model folder"):
        resolve_local_folder("llama/config.json", [root])


def test_sharded_weights_are_read_through_their_index(root: Path) -> None:
    folder = make_model(root / "sharded")
    (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
    (folder / "model.safetensors.index.json").write_text(
        '{"weight_map": {"model.embed_tokens.weight": "model-00001-of-00001.safetensors"}}'
    )
    assert resolve_local_folder("sharded", [root]) == folder.resolve()
    assert safetensors_weight_files(folder) == ["model-00001-of-00001.safetensors"]
    (folder / "model.safetensors.index.json").write_text('{"weight_map": {"x": "../escape.safetensors"}}')
    with pytest.raises(ModelSourceError, match="not a safetensors file in the folder"):
        resolve_local_folder("sharded", [root])


@pytest.mark.parametrize("raw", ["", "   ", "llama\x00/etc"])
def test_empty_paths_and_nul_bytes_are_refused(root: Path, raw: str) -> None:
    with pytest.raises(ModelSourceError, match="empty|NUL byte"):
        resolve_local_folder(raw, [root])


def test_no_configured_roots_means_nothing_can_be_registered(tmp_path: Path) -> None:
    with pytest.raises(ModelSourceError, match="no model roots are configured"):
        resolve_local_folder(str(make_model(tmp_path / "llama")), [])


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("meta-llama/Llama-3.2-1B", ("meta-llama/Llama-3.2-1B", None)),
        ("Qwen/Qwen2.5-0.5B-Instruct@main", ("Qwen/Qwen2.5-0.5B-Instruct", "main")),
        (f"org_1/name.v2@{COMMIT}", ("org_1/name.v2", COMMIT)),
        ("org/name@refs/pr/1", ("org/name", "refs/pr/1")),
    ],
)
def test_hub_ids_parse(spec: str, expected: tuple[str, str | None]) -> None:
    assert parse_hf_id(spec) == expected


@pytest.mark.parametrize(
    "spec",
    [
        "",
        "name-only",
        "a/b/c",
        "org/../name",
        "../name",
        "org/.name",
        "org/name.",
        "-org/name",
        "org/name-",
        "org/na--me",
        "org/na me",
        "org/name.git",
        "org/näme",
        "org/" + "x" * 100,
        "org/name@",
        "org/name@../../etc",
        "org/name@/abs",
        "org/name@main//x",
        "org/name@ma in",
        "org/name@main.lock",
    ],
)
def test_malformed_hub_ids_are_refused(spec: str) -> None:
    with pytest.raises(ModelSourceError, match="is not a Hugging Face repository id|is not a revision"):
        parse_hf_id(spec)


@pytest.fixture()
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """HF_HUB_OFFLINE=1 as a process started with it sees it (huggingface_hub reads it at import)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


def fake_cached_snapshot(cache: Path, repo_id: str, commit: str = COMMIT) -> Path:
    """The cache layout snapshot_download leaves behind: blobs, a snapshot of links, refs/main."""
    storage = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = storage / "snapshots" / commit
    (storage / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for index, name in enumerate(MODEL_FILES):
        blob = storage / "blobs" / f"blob{index}"
        shutil.copyfile(REFERENCE_DRAFTER / name, blob)
        (snapshot / name).symlink_to(Path("..", "..", "blobs", blob.name))
    (storage / "refs").mkdir()
    (storage / "refs" / "main").write_text(commit)
    return snapshot


def test_offline_and_not_cached_says_so_and_how_to_fill_the_cache(offline: None, tmp_path: Path) -> None:
    with pytest.raises(ModelSourceError) as refused:
        resolve_hf_snapshot("org/missing", None, cache_dir=tmp_path / "hf")
    message = str(refused.value)
    assert "HF_HUB_OFFLINE" in message
    assert "not in the Hugging Face cache" in message
    assert "hf download org/missing" in message


def test_offline_resolves_a_cached_snapshot(offline: None, tmp_path: Path) -> None:
    cache = tmp_path / "hf"
    snapshot = fake_cached_snapshot(cache, "org/tiny-llama")
    for revision in (None, "main", COMMIT):
        folder = resolve_hf_snapshot("org/tiny-llama", revision, cache_dir=cache)
        assert folder == snapshot.resolve()
        assert folder.name == COMMIT
    with pytest.raises(ModelSourceError, match="not in the Hugging Face cache"):
        resolve_hf_snapshot("org/tiny-llama", "v2", cache_dir=cache)


def test_a_cached_snapshot_is_checked_like_a_folder(offline: None, tmp_path: Path) -> None:
    cache = tmp_path / "hf"
    (fake_cached_snapshot(cache, "org/untokenized") / "tokenizer.json").unlink()
    with pytest.raises(ModelSourceError, match="has no tokenizer.json"):
        resolve_hf_snapshot("org/untokenized", None, cache_dir=cache)


def test_resolve_hf_snapshot_rechecks_the_id(tmp_path: Path) -> None:
    with pytest.raises(ModelSourceError, match="not a Hugging Face repository id"):
        resolve_hf_snapshot("../escape", None, cache_dir=tmp_path)
    with pytest.raises(ModelSourceError, match="is not a revision"):
        resolve_hf_snapshot("org/name", "../../x", cache_dir=tmp_path)


def hub_error(error_type: type[Exception]) -> Exception:
    response = mock.Mock(status_code=404, headers={}, request=None)
    return error_type("refused", response=response)


@pytest.mark.parametrize(
    ("raised", "expected"),
    [
        (hub_error(GatedRepoError), "gated repository"),
        (hub_error(RepositoryNotFoundError), "no repository org/name on the Hugging Face Hub"),
        (hub_error(RevisionNotFoundError), "has no revision 'v9'"),
        (ConnectionError("no route to host"), "could not be reached"),
    ],
)
def test_hub_failures_become_source_errors(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, raised: Exception, expected: str
) -> None:
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    download = mock.Mock(side_effect=raised)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", download)
    with pytest.raises(ModelSourceError, match=expected):
        resolve_hf_snapshot("org/name", "v9", cache_dir=tmp_path)
    kwargs = download.call_args.kwargs
    assert kwargs["local_files_only"] is False
    assert kwargs["allow_patterns"] == [
        "*.json",
        "*.safetensors",
        "tokenizer.model",
        "*.txt",
        "*.tiktoken",
        "*.jinja",
    ]


def test_the_cache_root_defaults_to_huggingface_hubs(tmp_path: Path) -> None:
    assert hf_cache_root(None) == Path(constants.HF_HUB_CACHE)
    assert hf_cache_root(tmp_path) == tmp_path
