"""Where a model's files come from: a folder under an operator-configured model root, or a Hugging
Face Hub id resolved to a snapshot in huggingface_hub's cache, and the checks that such a folder
holds a loadable model (config, tokenizer, safetensors weights) and nothing reached by escaping
the allowed roots.

Every refusal is a ModelSourceError whose message says what was wrong and what to do about it;
the API hands it back as the body of a 422.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from controlplane.artifacts.manifest import model_files

# The files a snapshot needs to be loaded (the Hub-side counterpart of MODEL_FILE_SUFFIXES):
# pickled weights are never fetched.
HF_ALLOW_PATTERNS = ("*.json", "*.safetensors", "tokenizer.model", "*.txt", "*.tiktoken", "*.jinja")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
SINGLE_WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
REQUIRED_FILES = ("config.json", "tokenizer.json")

# The Hub's repository id rules: ORG/NAME, each part letters, digits, '-', '_' or '.', starting
# and ending with a letter or digit; no '--' or '..' anywhere; at most 96 characters.
_HF_ID_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?"
HF_REPO_ID_PATTERN = re.compile(rf"{_HF_ID_PART}/{_HF_ID_PART}")
HF_REPO_ID_MAX_LENGTH = 96
# A branch, tag or commit. The revision becomes a path under the cache's refs/ folder, so
# anything that could step out of it ('..', a leading '/', empty components) is refused.
HF_REVISION_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(?:/[A-Za-z0-9][A-Za-z0-9._-]*)*")
HF_REVISION_MAX_LENGTH = 100


class ModelSourceError(ValueError):
    """A model source that cannot be registered; the message says why and what to do."""


def _describe_roots(roots: Sequence[Path]) -> str:
    return ", ".join(str(root) for root in roots)


def _outside_roots_error(raw: str, roots: Sequence[Path]) -> ModelSourceError:
    # One message for "does not exist" and "exists but lies outside": telling them apart would let
    # a caller probe which paths exist anywhere on the machine.
    return ModelSourceError(
        f"model path {raw!r} is not an existing folder inside the configured model roots "
        f"({_describe_roots(roots)}); copy the model folder under one of them (links leading out of "
        "them are not followed), or have an operator add its location to CONTROLPLANE_MODEL_ROOTS"
    )


def _resolved_roots(roots: Sequence[Path]) -> list[Path]:
    # A configured root need not exist yet (var/models on a fresh install): it then holds nothing.
    return [Path(root).expanduser().resolve() for root in roots]


def _inside_any(path: Path, resolved_roots: Sequence[Path]) -> bool:
    return any(path == root or path.is_relative_to(root) for root in resolved_roots)


def resolve_local_folder(raw: str, roots: Sequence[Path]) -> Path:
    """The checked, fully resolved model folder that ``raw`` names.

    ``raw`` is an absolute path, or a path relative to a model root (tried in order). After
    resolving symlinks it must lie inside one of the roots and hold a loadable model (see
    check_model_folder).
    """
    if not roots:
        raise ModelSourceError(
            "no model roots are configured, so no folder can be registered; an operator must set "
            "CONTROLPLANE_MODEL_ROOTS to the folders models may be registered from"
        )
    if "\x00" in raw:
        raise ModelSourceError("model path contains a NUL byte; give a plain folder path")
    if not raw.strip():
        raise ModelSourceError(
            f"model path is empty; give a folder inside a model root ({_describe_roots(roots)})"
        )
    resolved_roots = _resolved_roots(roots)
    given = Path(raw)
    candidates = [given] if given.is_absolute() else [Path(root) / given for root in roots]
    for candidate in candidates:
        try:
            resolved = candidate.expanduser().resolve(strict=True)
        except (OSError, RuntimeError):
            # Missing, a dangling or looping link, a name too long: all read as "not there".
            continue
        if _inside_any(resolved, resolved_roots):
            check_model_folder(resolved, roots, shown_as=raw)
            return resolved
    raise _outside_roots_error(raw, roots)


def safetensors_weight_files(folder: Path) -> list[str]:
    """The safetensors files a loader reads from ``folder``, by name.

    model.safetensors when present, else the shards its index lists, else every top-level
    ``*.safetensors`` file. Refused when there are none, and a folder holding only pickled weights
    is refused saying why.
    """
    if (folder / SINGLE_WEIGHTS_FILE).is_file():
        return [SINGLE_WEIGHTS_FILE]
    index = folder / WEIGHTS_INDEX_FILE
    if index.is_file():
        return _shards_of_index(folder, index)
    shards = sorted(p.name for p in folder.iterdir() if p.is_file() and p.name.endswith(".safetensors"))
    if shards:
        return shards
    pickles = sorted(p.name for p in folder.iterdir() if p.is_file() and p.name.endswith(PICKLE_SUFFIXES))
    if pickles:
        raise ModelSourceError(
            f"{folder} holds only pickled weights ({', '.join(pickles[:3])}); pickles can execute code "
            "when loaded, so only safetensors weights are accepted: convert them (for example "
            "model.save_pretrained(folder, safe_serialization=True) with transformers) and register again"
        )
    raise ModelSourceError(
        f"{folder} holds no safetensors weights ({SINGLE_WEIGHTS_FILE}, {WEIGHTS_INDEX_FILE} with its "
        "shards, or *.safetensors); save the model's weights in safetensors format into the folder"
    )


def _shards_of_index(folder: Path, index: Path) -> list[str]:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
    except (OSError, ValueError, AttributeError) as exc:
        raise ModelSourceError(
            f"{index} is not a readable safetensors index ({exc}); re-save the model's weights"
        ) from exc
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelSourceError(f"{index} has no weight_map; re-save the model's weights")
    shards = sorted({str(shard) for shard in weight_map.values()})
    for shard in shards:
        if "/" in shard or "\\" in shard or shard in ("", ".", "..") or not shard.endswith(".safetensors"):
            raise ModelSourceError(
                f"{index} names {shard!r}, not a safetensors file in the folder; re-save the model's weights"
            )
        if not (folder / shard).is_file():
            raise ModelSourceError(
                f"{folder} is missing {shard}, which {WEIGHTS_INDEX_FILE} lists; copy every shard"
            )
    return shards


def check_model_folder(folder: Path, roots: Sequence[Path], *, shown_as: str | None = None) -> None:
    """Refuse a folder that does not hold a loadable model, or whose files link out of ``roots``.

    A loadable model has config.json, tokenizer.json and safetensors weights. Every file loading
    reads must resolve inside one of ``roots`` (a Hugging Face snapshot's links into the cache's
    blobs/ are fine when the cache is a root).
    """
    label = shown_as if shown_as is not None else str(folder)
    if not folder.is_dir():
        raise ModelSourceError(
            f"{label!r} is a file, not a model folder; give the folder holding config.json"
        )
    missing = [name for name in REQUIRED_FILES if not (folder / name).is_file()]
    if "config.json" in missing:
        raise ModelSourceError(
            f"{label!r} has no config.json, so it is not a Hugging Face model folder; save the model "
            "with save_pretrained (transformers) into it"
        )
    if "tokenizer.json" in missing:
        raise ModelSourceError(
            f"{label!r} has no tokenizer.json; save the model's fast tokenizer into the folder "
            "(AutoTokenizer.from_pretrained(...).save_pretrained(folder) writes one)"
        )
    weight_files = safetensors_weight_files(folder)
    resolved_roots = _resolved_roots(roots)
    loaded = sorted({*REQUIRED_FILES, *weight_files, *model_files(folder)})
    for name in loaded:
        try:
            target = (folder / name).resolve(strict=True)
        except (OSError, RuntimeError):
            target = None
        if target is None or not _inside_any(target, resolved_roots):
            raise ModelSourceError(
                f"{name} in {label!r} is a link that does not resolve to a file inside the allowed "
                f"model roots ({_describe_roots(roots)}); copy the file itself into the folder"
            )


def _check_repo_id(repo_id: str) -> None:
    if (
        len(repo_id) > HF_REPO_ID_MAX_LENGTH
        or not HF_REPO_ID_PATTERN.fullmatch(repo_id)
        or ".." in repo_id
        or "--" in repo_id
        or repo_id.endswith(".git")
    ):
        raise ModelSourceError(
            f"{repo_id!r} is not a Hugging Face repository id; give ORG/NAME (letters, digits, '-', "
            "'_' or '.', each part starting and ending with a letter or digit, no '..' or '--', at "
            f"most {HF_REPO_ID_MAX_LENGTH} characters), optionally followed by @REVISION"
        )


def _check_revision(revision: str) -> None:
    if (
        len(revision) > HF_REVISION_MAX_LENGTH
        or not HF_REVISION_PATTERN.fullmatch(revision)
        or ".." in revision
        or revision.endswith((".", ".lock"))
    ):
        raise ModelSourceError(
            f"{revision!r} is not a revision; give a branch, tag or commit hash (letters, digits, "
            f"'-', '_', '.', '/' between parts, no '..', at most {HF_REVISION_MAX_LENGTH} characters)"
        )


def parse_hf_id(spec: str) -> tuple[str, str | None]:
    """``ORG/NAME`` or ``ORG/NAME@REVISION`` as (repo id, revision or None), checked."""
    repo_id, at, revision = spec.partition("@")
    _check_repo_id(repo_id)
    if not at:
        return repo_id, None
    _check_revision(revision)
    return repo_id, revision


def hf_cache_root(cache_dir: Path | None) -> Path:
    """The Hugging Face cache a snapshot is looked up in (huggingface_hub's default when None)."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def _network_error_types() -> tuple[type[BaseException], ...]:
    # huggingface_hub's HTTP client has changed between releases (requests, httpx, httpx2); take
    # the transport errors of whichever it has loaded rather than importing one it does not use.
    found: list[type[BaseException]] = [ConnectionError, TimeoutError]
    for module_name, attribute in (
        ("httpx2", "TransportError"),
        ("httpx", "TransportError"),
        ("requests", "RequestException"),
    ):
        module = sys.modules.get(module_name)
        error_type = getattr(module, attribute, None) if module is not None else None
        if isinstance(error_type, type) and issubclass(error_type, BaseException):
            found.append(error_type)
    return tuple(found)


def resolve_hf_snapshot(repo_id: str, revision: str | None, *, cache_dir: Path | None) -> Path:
    """The checked, resolved snapshot folder of ``repo_id`` at ``revision`` (the default branch
    when None) in the Hugging Face cache, downloading its model files unless HF_HUB_OFFLINE is set.

    Only the files loading reads are fetched (HF_ALLOW_PATTERNS); pickled weights never are.
    """
    _check_repo_id(repo_id)
    if revision is not None:
        _check_revision(revision)
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        DisabledRepoError,
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    cache = hf_cache_root(cache_dir)
    shown = f"{repo_id}@{revision}" if revision is not None else repo_id
    # Read now, not at import: a process started with HF_HUB_OFFLINE=1 (or a test that sets it)
    # must never reach the network.
    offline = bool(constants.HF_HUB_OFFLINE)
    prepopulate = (
        f"pre-populate the cache on a machine with network access (hf download {repo_id}"
        + (f" --revision {revision}" if revision is not None else "")
        + f" --cache-dir {cache}, or huggingface_hub.snapshot_download) and copy it here"
    )
    try:
        downloaded = snapshot_download(
            repo_id=repo_id,
            revision=revision,
            cache_dir=cache_dir,
            allow_patterns=list(HF_ALLOW_PATTERNS),
            local_files_only=offline,
        )
    except LocalEntryNotFoundError as exc:
        if offline:
            raise ModelSourceError(
                f"{shown} is not in the Hugging Face cache at {cache} (or only partly), and HF_HUB_OFFLINE "
                f"is set, so nothing is downloaded; {prepopulate}, or unset HF_HUB_OFFLINE"
            ) from exc
        raise ModelSourceError(
            f"{shown} could not be fetched from the Hugging Face Hub and is not (completely) in the "
            f"cache at {cache}; check the network connection and proxy settings, or {prepopulate}"
        ) from exc
    except GatedRepoError as exc:
        raise ModelSourceError(
            f"{repo_id} is a gated repository; accept its terms on huggingface.co and give the service "
            "a token with access (HF_TOKEN)"
        ) from exc
    except RepositoryNotFoundError as exc:
        raise ModelSourceError(
            f"no repository {repo_id} on the Hugging Face Hub, or it is private and no token with "
            "access was given; check the id, or set HF_TOKEN"
        ) from exc
    except RevisionNotFoundError as exc:
        raise ModelSourceError(
            f"{repo_id} has no revision {revision!r}; give an existing branch, tag or commit hash"
        ) from exc
    except DisabledRepoError as exc:
        raise ModelSourceError(
            f"{repo_id} has been disabled on the Hugging Face Hub; choose another repository"
        ) from exc
    except HFValidationError as exc:
        raise ModelSourceError(f"{shown} was refused by huggingface_hub: {exc}") from exc
    except HfHubHTTPError as exc:
        raise ModelSourceError(
            f"the Hugging Face Hub refused or failed the request for {shown} ({exc}); try again later, "
            f"or {prepopulate}"
        ) from exc
    except _network_error_types() as exc:
        raise ModelSourceError(
            f"the Hugging Face Hub could not be reached for {shown} ({exc.__class__.__name__}: {exc}); "
            f"check the network connection and proxy settings, or {prepopulate} and set HF_HUB_OFFLINE=1"
        ) from exc
    except OSError as exc:
        raise ModelSourceError(
            f"the Hugging Face cache at {cache} could not be used for {shown} ({exc}); make it "
            "readable and writable by the service, or point CONTROLPLANE_HF_CACHE_DIR elsewhere"
        ) from exc
    if not isinstance(downloaded, str):
        raise ModelSourceError(f"huggingface_hub returned no folder for {shown}; try again")
    folder = Path(downloaded).resolve()
    check_model_folder(folder, [cache], shown_as=f"{shown} (snapshot {folder.name})")
    return folder
