"""Tokenizer behaviour, the mismatch guard, and HF folder export/import (transformers loads it)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from workers.engine.hf_io import ChecksumMismatchError, load_hf_folder, save_hf_folder, sha256_of_file
from workers.engine.model import ModelConfig, build_model
from workers.engine.tokenizer import Tokenizer, TokenizerMismatchError, ensure_same_tokenizer, train_bpe

ConfigFactory = Callable[..., ModelConfig]
TEXT = "def add(a, b):\n    return a + b  # héllo ✓ 🙂"


def test_round_trip_and_eos(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(TEXT)
    assert tokenizer.decode(ids) == TEXT  # byte-level: even unseen emoji round-trip
    assert tokenizer.eos_id is not None
    assert tokenizer.encode("<|endoftext|>") == [tokenizer.eos_id]
    assert tokenizer.decode([*ids, tokenizer.eos_id]) == TEXT  # special tokens are skipped
    assert tokenizer.vocab_size == 320


def test_fingerprint_survives_save_and_load(tokenizer: Tokenizer, tmp_path: Path) -> None:
    path = tmp_path / "tokenizer.json"
    tokenizer.save(path)
    # Reformatting the JSON must not change the fingerprint: it hashes content, not bytes.
    path.write_text(json.dumps(json.loads(path.read_text()), indent=4, sort_keys=True))
    again = Tokenizer.from_file(path)
    assert again.fingerprint == tokenizer.fingerprint
    assert again.eos_id == tokenizer.eos_id
    ensure_same_tokenizer(tokenizer, again)


def test_mismatch_error_names_both(tokenizer: Tokenizer) -> None:
    other = train_bpe(["completely different text, different merges"] * 8, vocab_size=300)
    with pytest.raises(TokenizerMismatchError) as err:
        ensure_same_tokenizer(tokenizer, other, "acme/target-12m", "acme/drafter-v3")
    msg = str(err.value)
    assert "acme/target-12m" in msg and "acme/drafter-v3" in msg and "vocab sizes 320 vs" in msg


@pytest.mark.parametrize("tie", [True, False])
def test_hf_folder_loads_in_transformers_and_round_trips(
    tie: bool, tokenizer: Tokenizer, tiny_config: ConfigFactory, tmp_path: Path
) -> None:
    transformers = pytest.importorskip("transformers")
    model = build_model(tiny_config(tie_embeddings=tie), seed=7).eval()
    sha = save_hf_folder(model, tokenizer, tmp_path)
    assert sha == sha256_of_file(tmp_path / "model.safetensors")
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]

    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert hf_tok(TEXT)["input_ids"] == tokenizer.encode(TEXT)
    assert hf_tok.eos_token_id == tokenizer.eos_id
    x = torch.randint(0, 320, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        ours = model(x)
        torch.testing.assert_close(hf(x).logits, ours, atol=1e-4, rtol=1e-4)
        loaded, tok2 = load_hf_folder(tmp_path, expected_sha256=sha)
        torch.testing.assert_close(loaded(x), ours, atol=0.0, rtol=0.0)
    assert tok2.fingerprint == tokenizer.fingerprint and tok2.eos_id == tokenizer.eos_id
    assert replace(loaded.config, bos_token_id=None, eos_token_id=None) == model.config


def test_half_precision_folder_loads_as_float32(
    tokenizer: Tokenizer, tiny_config: ConfigFactory, tmp_path: Path
) -> None:
    model = build_model(tiny_config(), seed=8).eval()
    save_hf_folder(model, tokenizer, tmp_path, dtype=torch.bfloat16)
    loaded, _ = load_hf_folder(tmp_path)
    assert loaded.dtype == torch.float32
    x = torch.randint(0, 320, (1, 20))
    with torch.inference_mode():
        torch.testing.assert_close(loaded(x), model(x), atol=0.05, rtol=0.05)


def test_checksum_mismatch_and_pickles_refused(
    tokenizer: Tokenizer, tiny_config: ConfigFactory, tmp_path: Path
) -> None:
    save_hf_folder(build_model(tiny_config(), seed=9), tokenizer, tmp_path / "ok")
    with pytest.raises(ChecksumMismatchError, match="expected 00"):
        load_hf_folder(tmp_path / "ok", expected_sha256="00" * 32)

    bad = tmp_path / "pickled"
    bad.mkdir()
    (bad / "config.json").write_text((tmp_path / "ok" / "config.json").read_text())
    (bad / "pytorch_model.bin").write_bytes(b"not even read")
    with pytest.raises(ValueError, match="refusing to load them"):
        load_hf_folder(bad)
