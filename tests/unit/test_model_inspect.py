"""What inspecting a model folder reports (family, parameter count, dtype, vocabulary rows,
tokenizer, file digests) from its config and safetensors headers alone, and the folders it refuses:
unsupported families, broken weights headers, fewer vocabulary rows than tokens."""

from __future__ import annotations

import json
import math
import shutil
import struct
from pathlib import Path
from typing import Any

import pytest

from controlplane.artifacts.manifest import hash_files, model_files, sha256_of_file
from controlplane.models import inspect as model_inspect
from controlplane.models.inspect import SUPPORTED_FAMILIES, ModelFacts, inspect_folder
from controlplane.models.sources import ModelSourceError

REFERENCE = Path(__file__).resolve().parents[2] / "workers" / "models" / "reference"
BYTES_PER_ELEMENT = {"F32": 4, "F16": 2, "BF16": 2}


def header_of(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header: dict[str, Any] = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return header


def parameters_in(path: Path) -> int:
    return sum(math.prod(entry["shape"]) for entry in header_of(path).values())


def write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int]]]) -> None:
    """A safetensors file of zeros with the given dtype code and shape per tensor."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        size = math.prod(shape) * BYTES_PER_ELEMENT[dtype]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + bytes(offset))


def tiny_model(
    folder: Path,
    *,
    model_type: str = "llama",
    vocab_size: int = 4,
    tokens: int = 4,
    tensors: dict[str, tuple[str, list[int]]] | None = None,
) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": model_type, "vocab_size": vocab_size}
    (folder / "config.json").write_text(json.dumps(config))
    vocab = {f"t{i}": i for i in range(tokens)}
    (folder / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE", "vocab": vocab}}))
    write_safetensors(
        folder / "model.safetensors",
        tensors or {"model.embed_tokens.weight": ("F32", [vocab_size, 8]), "model.norm.weight": ("F32", [8])},
    )
    return folder


@pytest.mark.parametrize("folder", ["target", "generic-drafter"])
def test_the_reference_models_inspect_from_their_headers(folder: str) -> None:
    path = REFERENCE / folder
    facts = inspect_folder(path)
    assert facts.family == "llama"
    assert facts.architecture == "LlamaForCausalLM"
    assert facts.parameter_count == parameters_in(path / "model.safetensors")
    # The bundled weights are stored in half precision (config.json's torch_dtype says so too).
    assert facts.dtype == "float16"
    assert facts.vocab_size == facts.embedding_rows == facts.tokenizer_size == 4096
    assert facts.files == hash_files(path, model_files(path))
    assert "model.safetensors" in facts.files and "tokenizer.json" in facts.files
    assert facts.total_bytes == sum((path / name).stat().st_size for name in facts.files)
    # Tied embeddings: the head is stored once, and counted once.
    assert "lm_head.weight" not in header_of(path / "model.safetensors")
    as_dict = facts.to_dict()
    assert as_dict["parameter_count"] == facts.parameter_count
    assert ModelFacts(**as_dict) == facts
    json.dumps(as_dict)


def test_the_reference_pair_shares_a_tokenizer_fingerprint() -> None:
    target = inspect_folder(REFERENCE / "target")
    drafter = inspect_folder(REFERENCE / "generic-drafter")
    assert target.tokenizer_fingerprint == drafter.tokenizer_fingerprint
    assert len(target.tokenizer_fingerprint) == 64
    assert target.parameter_count > drafter.parameter_count


def test_an_unchanged_folder_is_hashed_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tiny_model(tmp_path / "tiny")
    hashed: list[str] = []

    def counting_sha256(path: str | Path) -> str:
        hashed.append(Path(path).name)
        return sha256_of_file(path)

    monkeypatch.setattr(model_inspect, "sha256_of_file", counting_sha256)
    first = inspect_folder(folder)
    assert sorted(hashed) == ["config.json", "model.safetensors", "tokenizer.json"]
    hashed.clear()
    assert inspect_folder(folder) == first
    assert hashed == []
    (folder / "config.json").write_text((folder / "config.json").read_text() + "\n")
    changed = inspect_folder(folder)
    assert hashed == ["config.json"]
    assert changed.files["config.json"] == sha256_of_file(folder / "config.json")
    assert changed.files["config.json"] != first.files["config.json"]


@pytest.mark.slow
def test_a_tiny_qwen2_built_by_transformers_inspects_as_qwen2(tmp_path: Path) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=4096,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(tmp_path)
    shutil.copyfile(REFERENCE / "target" / "tokenizer.json", tmp_path / "tokenizer.json")
    facts = inspect_folder(tmp_path)
    assert facts.family == "qwen2"
    assert facts.architecture == "Qwen2ForCausalLM"
    assert facts.parameter_count == parameters_in(tmp_path / "model.safetensors") == model.num_parameters()
    assert facts.dtype == "float32"
    assert facts.vocab_size == facts.embedding_rows == 4096
    assert facts.tokenizer_fingerprint == inspect_folder(REFERENCE / "target").tokenizer_fingerprint


def test_the_dtype_is_the_one_holding_most_parameters(tmp_path: Path) -> None:
    folder = tiny_model(
        tmp_path,
        tensors={
            "model.embed_tokens.weight": ("BF16", [4, 8]),
            "model.norm.weight": ("F32", [8]),
            "model.layers.0.mlp.up_proj.weight": ("BF16", [8, 8]),
        },
    )
    facts = inspect_folder(folder)
    assert facts.dtype == "bfloat16"
    assert facts.parameter_count == 4 * 8 + 8 + 8 * 8


def test_sharded_weights_are_counted_across_their_shards(tmp_path: Path) -> None:
    folder = tiny_model(tmp_path)
    (folder / "model.safetensors").unlink()
    write_safetensors(
        folder / "model-00001-of-00002.safetensors", {"model.embed_tokens.weight": ("F16", [4, 8])}
    )
    write_safetensors(folder / "model-00002-of-00002.safetensors", {"lm_head.weight": ("F16", [4, 8])})
    weight_map = {
        "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
        "lm_head.weight": "model-00002-of-00002.safetensors",
    }
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    facts = inspect_folder(folder)
    assert facts.parameter_count == 64
    assert facts.embedding_rows == 4
    assert set(facts.files) == {
        "config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
    }


def test_an_unsupported_family_is_refused_listing_the_supported_ones(tmp_path: Path) -> None:
    folder = tiny_model(tmp_path, model_type="gpt2")
    with pytest.raises(ModelSourceError, match="model of type 'gpt2'") as refused:
        inspect_folder(folder)
    assert all(family in str(refused.value) for family in SUPPORTED_FAMILIES)


def test_fewer_vocabulary_rows_than_tokens_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelSourceError, match="vocab_size gives 4 vocabulary rows but the tokenizer has 6"):
        inspect_folder(tiny_model(tmp_path / "short-config", vocab_size=4, tokens=6))
    padded = tiny_model(tmp_path / "padded", vocab_size=8, tokens=6)
    assert inspect_folder(padded).tokenizer_size == 6


def test_embedding_rows_must_match_the_config(tmp_path: Path) -> None:
    folder = tiny_model(
        tmp_path, vocab_size=6, tokens=4, tensors={"model.embed_tokens.weight": ("F32", [5, 8])}
    )
    with pytest.raises(ModelSourceError, match="vocab_size is 6 but model.embed_tokens.weight has 5 rows"):
        inspect_folder(folder)


def test_weights_without_an_embedding_table_are_refused(tmp_path: Path) -> None:
    folder = tiny_model(tmp_path, tensors={"model.norm.weight": ("F32", [8])})
    with pytest.raises(ModelSourceError, match="no embed_tokens.weight tensor"):
        inspect_folder(folder)


def _header_bytes(header: dict[str, Any]) -> bytes:
    encoded = json.dumps(header).encode()
    return struct.pack("<Q", len(encoded)) + encoded


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b"\x01\x02", "shorter than its 8-byte header length"),
        (struct.pack("<Q", 1 << 40) + b"{}", "exceeds the file"),
        (struct.pack("<Q", 5) + b"nope!", "header is not JSON"),
        (
            _header_bytes({"x": {"dtype": "Q9", "shape": [1], "data_offsets": [0, 1]}}) + b"\0",
            "unknown dtype",
        ),
        (
            _header_bytes({"x": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}) + bytes(4),
            "has shape",
        ),
        (_header_bytes({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}) + bytes(8), "outside"),
        (_header_bytes({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}) + bytes(8), "needs 16"),
    ],
    ids=[
        "truncated",
        "huge-header",
        "not-json",
        "unknown-dtype",
        "negative-shape",
        "past-the-end",
        "short-span",
    ],
)
def test_invalid_safetensors_headers_are_refused(tmp_path: Path, content: bytes, expected: str) -> None:
    folder = tiny_model(tmp_path)
    (folder / "model.safetensors").write_bytes(content)
    with pytest.raises(ModelSourceError, match=expected):
        inspect_folder(folder)
