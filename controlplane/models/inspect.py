"""What a model folder holds, read without loading its weights: its family and architecture from
config.json, its parameter count, dtype and embedding rows from the safetensors headers, its
tokenizer's size and fingerprint, and the sha256 of every file loading reads.
"""

from __future__ import annotations

import json
import math
import os
import struct
import threading
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from controlplane.artifacts.manifest import model_files, sha256_of_file
from controlplane.models.sources import ModelSourceError, safetensors_weight_files
from controlplane.models.vocabulary import load_vocabulary, vocabulary_fingerprint

SUPPORTED_FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
EMBEDDING_TENSOR = "model.embed_tokens.weight"
# A base model saved without its language-model head names the table without the "model." prefix.
EMBEDDING_TENSOR_SUFFIX = "embed_tokens.weight"
# The safetensors format's own limit on a header; a larger length field is a corrupt file.
MAX_HEADER_BYTES = 100 * 1024 * 1024
HEADER_LENGTH_BYTES = 8
# safetensors dtype code → (torch-style name, bits per element).
SAFETENSORS_DTYPES: dict[str, tuple[str, int]] = {
    "F64": ("float64", 64),
    "F32": ("float32", 32),
    "F16": ("float16", 16),
    "BF16": ("bfloat16", 16),
    "F8_E4M3": ("float8_e4m3fn", 8),
    "F8_E5M2": ("float8_e5m2", 8),
    "F8_E8M0": ("float8_e8m0fnu", 8),
    "F6_E2M3": ("float6_e2m3", 6),
    "F6_E3M2": ("float6_e3m2", 6),
    "F4": ("float4_e2m1", 4),
    "C64": ("complex64", 64),
    "I64": ("int64", 64),
    "I32": ("int32", 32),
    "I16": ("int16", 16),
    "I8": ("int8", 8),
    "U64": ("uint64", 64),
    "U32": ("uint32", 32),
    "U16": ("uint16", 16),
    "U8": ("uint8", 8),
    "BOOL": ("bool", 8),
}
HASH_CACHE_ENTRIES = 4096


@dataclass(frozen=True)
class ModelFacts:
    family: str
    architecture: str | None
    parameter_count: int
    dtype: str
    vocab_size: int
    embedding_rows: int
    tokenizer_size: int
    tokenizer_fingerprint: str
    # hash=False: a dict cannot be hashed, and the digests are covered by equality anyway.
    files: dict[str, str] = field(hash=False)
    total_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class TensorHeader:
    """One tensor's entry in a safetensors header (its safetensors dtype code and shape)."""

    dtype: str
    shape: tuple[int, ...]

    @property
    def elements(self) -> int:
        return math.prod(self.shape)


# (resolved folder, file name, size, mtime_ns, inode) → sha256. Hashing is what makes inspecting a
# large folder slow, and the same folder is often inspected more than once (registering the
# reference pair in every test's fresh database); any change to a file changes its key.
_hash_cache: OrderedDict[tuple[str, str, int, int, int], str] = OrderedDict()
_hash_cache_lock = threading.Lock()


def _hash_model_files(folder: Path) -> tuple[dict[str, str], int]:
    """What ``hash_files(folder, model_files(folder))`` returns, remembered per file version, and
    the files' total size."""
    resolved = str(folder.resolve())
    digests: dict[str, str] = {}
    total_bytes = 0
    for name in model_files(folder):
        path = folder / name
        stat = os.stat(path)
        key = (resolved, name, stat.st_size, stat.st_mtime_ns, stat.st_ino)
        with _hash_cache_lock:
            digest = _hash_cache.get(key)
            if digest is not None:
                _hash_cache.move_to_end(key)
        if digest is None:
            digest = sha256_of_file(path)
            with _hash_cache_lock:
                _hash_cache[key] = digest
                while len(_hash_cache) > HASH_CACHE_ENTRIES:
                    _hash_cache.popitem(last=False)
        digests[name] = digest
        total_bytes += stat.st_size
    return dict(sorted(digests.items())), total_bytes


def _invalid_weights(path: Path, problem: str) -> ModelSourceError:
    return ModelSourceError(
        f"{path} is not a valid safetensors file ({problem}); save the weights again (for example "
        "model.save_pretrained(folder) with transformers)"
    )


def read_safetensors_header(path: Path) -> dict[str, TensorHeader]:
    """Tensor name → dtype and shape from a safetensors file's header, checked against the file's
    size; the weights themselves are never read."""
    try:
        file_size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(HEADER_LENGTH_BYTES)
            if len(prefix) < HEADER_LENGTH_BYTES:
                raise _invalid_weights(path, "shorter than its 8-byte header length")
            (header_length,) = struct.unpack("<Q", prefix)
            if header_length > min(MAX_HEADER_BYTES, file_size - HEADER_LENGTH_BYTES):
                raise _invalid_weights(path, f"header length {header_length} exceeds the file or the limit")
            raw_header = f.read(header_length)
    except OSError as exc:
        raise ModelSourceError(f"{path} cannot be read ({exc}); make it readable by the service") from exc
    try:
        header = json.loads(raw_header.decode("utf-8"))
    except ValueError as exc:
        raise _invalid_weights(path, f"its header is not JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise _invalid_weights(path, "its header is not a JSON object")
    data_size = file_size - HEADER_LENGTH_BYTES - header_length
    tensors: dict[str, TensorHeader] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        tensors[name] = _tensor_header(path, name, entry, data_size)
    return tensors


def _tensor_header(path: Path, name: str, entry: Any, data_size: int) -> TensorHeader:
    if not isinstance(entry, dict):
        raise _invalid_weights(path, f"tensor {name!r} has no header entry")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in SAFETENSORS_DTYPES:
        raise _invalid_weights(path, f"tensor {name!r} has unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise _invalid_weights(path, f"tensor {name!r} has shape {shape!r}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1] <= data_size
    ):
        raise _invalid_weights(path, f"tensor {name!r} has data offsets {offsets!r} outside the file")
    tensor = TensorHeader(dtype=dtype, shape=tuple(shape))
    bits = tensor.elements * SAFETENSORS_DTYPES[dtype][1]
    if bits % 8 == 0 and offsets[1] - offsets[0] != bits // 8:
        raise _invalid_weights(
            path, f"tensor {name!r} spans {offsets[1] - offsets[0]} bytes, its shape needs {bits // 8}"
        )
    return tensor


def _read_config(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelSourceError(
            f"{path} is not readable JSON ({exc}); save the model's config again (save_pretrained)"
        ) from exc
    if not isinstance(config, dict):
        raise ModelSourceError(
            f"{path} is not a JSON object; save the model's config again (save_pretrained)"
        )
    return config


def inspect_folder(folder: Path) -> ModelFacts:
    """Everything the registry records about a model folder, or ModelSourceError saying what is
    wrong with it: an unsupported family, invalid weights headers, or fewer vocabulary rows than
    the tokenizer has tokens."""
    folder = Path(folder)
    config = _read_config(folder)
    family = config.get("model_type")
    if family not in SUPPORTED_FAMILIES:
        raise ModelSourceError(
            f"{folder} holds a model of type {family!r} (config.json's model_type); the supported "
            f"families are {', '.join(SUPPORTED_FAMILIES)}: register a model of one of them"
        )
    architectures = config.get("architectures")
    architecture = str(architectures[0]) if isinstance(architectures, list) and architectures else None
    vocab_size = config.get("vocab_size")
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size <= 0:
        raise ModelSourceError(
            f"{folder}/config.json has vocab_size {vocab_size!r}, not a positive integer; fix the config"
        )

    parameters_by_dtype: dict[str, int] = {}
    embedding_tensor: str | None = None
    embedding_rows = 0
    for weights_file in safetensors_weight_files(folder):
        for name, tensor in read_safetensors_header(folder / weights_file).items():
            dtype_name = SAFETENSORS_DTYPES[tensor.dtype][0]
            parameters_by_dtype[dtype_name] = parameters_by_dtype.get(dtype_name, 0) + tensor.elements
            is_embedding = name == EMBEDDING_TENSOR or (
                embedding_tensor is None and name.endswith(EMBEDDING_TENSOR_SUFFIX)
            )
            if is_embedding and tensor.shape:
                embedding_tensor, embedding_rows = name, tensor.shape[0]
    parameter_count = sum(parameters_by_dtype.values())
    if parameter_count == 0:
        raise ModelSourceError(f"{folder}'s safetensors files hold no parameters; save the weights again")
    # Most parameters first; ties by name, so the answer never depends on file order.
    dtype = min(parameters_by_dtype, key=lambda name: (-parameters_by_dtype[name], name))
    if embedding_tensor is None:
        raise ModelSourceError(
            f"{folder}'s weights have no {EMBEDDING_TENSOR_SUFFIX} tensor, so its vocabulary rows are "
            f"unknown; save the whole causal language model (a *ForCausalLM), not a part of it"
        )

    vocabulary = load_vocabulary(folder)
    tokenizer_size = len(vocabulary)
    for what, rows in (("config.json's vocab_size", vocab_size), (embedding_tensor, embedding_rows)):
        if rows < tokenizer_size:
            raise ModelSourceError(
                f"{folder}: {what} gives {rows} vocabulary rows but the tokenizer has {tokenizer_size} "
                "tokens, so some token ids have no embedding; resize the embeddings to the tokenizer "
                "(model.resize_token_embeddings(len(tokenizer))) and save again"
            )
    if embedding_rows != vocab_size:
        raise ModelSourceError(
            f"{folder}: config.json's vocab_size is {vocab_size} but {embedding_tensor} has "
            f"{embedding_rows} rows, so the weights do not load into the model the config describes; "
            "save the model again"
        )

    files, total_bytes = _hash_model_files(folder)
    return ModelFacts(
        family=family,
        architecture=architecture,
        parameter_count=parameter_count,
        dtype=dtype,
        vocab_size=vocab_size,
        embedding_rows=embedding_rows,
        tokenizer_size=tokenizer_size,
        tokenizer_fingerprint=vocabulary_fingerprint(vocabulary),
        files=files,
        total_bytes=total_bytes,
    )
