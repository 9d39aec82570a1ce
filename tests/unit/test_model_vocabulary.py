"""Vocabularies read from tokenizer.json (BPE maps, Unigram piece lists, added tokens) and the
check that a drafter gives every shared token id the same token as its target."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from controlplane.models.sources import ModelSourceError
from controlplane.models.vocabulary import (
    TokenizerMismatchError,
    check_compatible,
    load_vocabulary,
    vocabulary_fingerprint,
)

REFERENCE = Path(__file__).resolve().parents[2] / "workers" / "models" / "reference"


def write_tokenizer(folder: Path, model: dict[str, Any], added: list[dict[str, Any]] | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(
        json.dumps({"version": "1.0", "added_tokens": added or [], "model": model})
    )
    return folder


def bpe(tokens: list[str]) -> dict[str, Any]:
    return {"type": "BPE", "vocab": {token: i for i, token in enumerate(tokens)}, "merges": []}


def test_a_bpe_vocabulary_with_added_tokens_and_holes(tmp_path: Path) -> None:
    folder = write_tokenizer(
        tmp_path,
        bpe(["a", "b", "ab"]),
        added=[{"id": 5, "content": "<|eot|>", "special": True}, {"id": 0, "content": "a"}],
    )
    assert load_vocabulary(folder) == ["a", "b", "ab", None, None, "<|eot|>"]


def test_a_unigram_vocabulary_is_a_list_of_pieces_with_scores(tmp_path: Path) -> None:
    model = {"type": "Unigram", "unk_id": 0, "vocab": [["<unk>", 0.0], ["▁the", -2.5], ["s", -4.1]]}
    folder = write_tokenizer(tmp_path, model, added=[{"id": 3, "content": "<pad>"}])
    assert load_vocabulary(folder) == ["<unk>", "▁the", "s", "<pad>"]


def test_the_reference_pair_shares_one_vocabulary() -> None:
    target = load_vocabulary(REFERENCE / "target")
    drafter = load_vocabulary(REFERENCE / "generic-drafter")
    assert len(target) == 4096
    assert target[0] == "<|endoftext|>"
    assert vocabulary_fingerprint(target) == vocabulary_fingerprint(drafter)
    check_compatible(target, drafter, target_name="reference-target", drafter_name="reference-drafter")


def test_the_fingerprint_changes_with_any_id_or_token() -> None:
    base = vocabulary_fingerprint(["a", "b", None])
    assert len(base) == 64
    assert base == vocabulary_fingerprint(["a", "b", None])
    for other in (["b", "a", None], ["a", "b"], ["a", "b", None, None], ["a", "b", "c"]):
        assert vocabulary_fingerprint(other) != base
    assert vocabulary_fingerprint(["\ud800", "é"]) != vocabulary_fingerprint(["\ud801", "é"])


def test_extra_trailing_tokens_on_either_side_are_compatible() -> None:
    tokens: list[str | None] = ["<s>", "a", "b", "ab"]
    padded = [*tokens, "<pad_0>", None, "<pad_2>"]
    check_compatible(tokens, padded, target_name="t", drafter_name="d")
    check_compatible(padded, tokens, target_name="t", drafter_name="d")


def test_swapped_tokens_are_refused_naming_both_ids_and_tokens() -> None:
    target: list[str | None] = ["<s>", "ab", "ba", "c"]
    drafter: list[str | None] = ["<s>", "ba", "ab", "c", "<extra>"]
    with pytest.raises(TokenizerMismatchError) as refused:
        check_compatible(target, drafter, target_name="llama-8b", drafter_name="tiny")
    assert str(refused.value).startswith(
        "drafter 'tiny' and target 'llama-8b' tokenize differently: "
        "id 1 is 'ab' in llama-8b but 'ba' in tiny; id 2 is 'ba' in llama-8b but 'ab' in tiny"
    )


def test_at_most_three_differences_are_listed() -> None:
    target: list[str | None] = [f"t{i}" for i in range(10)]
    drafter: list[str | None] = [f"d{i}" for i in range(10)]
    drafter[9] = None
    with pytest.raises(TokenizerMismatchError) as refused:
        check_compatible(target, drafter, target_name="t", drafter_name="d")
    message = str(refused.value)
    assert "id 0 is 't0' in t but 'd0' in d; id 1" in message and "id 2" in message
    assert "id 3" not in message
    assert "7 more of the 10 shared ids" in message


def test_a_hole_against_a_token_is_a_difference() -> None:
    with pytest.raises(TokenizerMismatchError, match="id 1 is 'x' in t but no token in d"):
        check_compatible(["a", "x"], ["a", None], target_name="t", drafter_name="d")


def test_an_empty_shared_range_is_a_mismatch() -> None:
    with pytest.raises(TokenizerMismatchError, match="no token ids in common"):
        check_compatible(["a"], [], target_name="t", drafter_name="d")


def test_the_reference_tokenizer_against_a_shuffled_copy(tmp_path: Path) -> None:
    data = json.loads((REFERENCE / "target" / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.__getitem__)[300:302]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(TokenizerMismatchError) as refused:
        check_compatible(
            load_vocabulary(REFERENCE / "target"),
            load_vocabulary(tmp_path),
            target_name="target",
            drafter_name="shuffled",
        )
    assert f"id 300 is {first!r} in target but {second!r} in shuffled" in str(refused.value)
    assert f"id 301 is {second!r} in target but {first!r} in shuffled" in str(refused.value)


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (None, "does not exist"),
        ("{not json", "not readable JSON"),
        (json.dumps({"model": {"type": "BPE"}}), "has no model.vocab"),
        (json.dumps({"model": {"vocab": {"a": -1}}}), "not an id from 0"),
        (json.dumps({"model": {"vocab": {"a": 1 << 40}}}), "not an id from 0"),
        (json.dumps({"model": {"vocab": {"a": True}}}), "not an id from 0"),
        (json.dumps({"model": {"vocab": [[1, 0.0]]}}), "not a \\[piece, score\\] pair"),
        (json.dumps({"model": {"vocab": {}}, "added_tokens": [{"id": 0}]}), "added token without content"),
        (json.dumps({"model": {"vocab": {}}}), "holds no tokens"),
    ],
)
def test_unreadable_tokenizers_are_refused(tmp_path: Path, content: str | None, expected: str) -> None:
    if content is not None:
        (tmp_path / "tokenizer.json").write_text(content)
    with pytest.raises(ModelSourceError, match=expected):
        load_vocabulary(tmp_path)
