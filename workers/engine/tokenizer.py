"""The tokenizer target and drafters share: a byte-level BPE from the `tokenizers` library.

Owns: `Tokenizer` (encode/decode, the end-of-text id, a content fingerprint), `train_bpe` to train one
from text, and `ensure_same_tokenizer`, the guard that refuses a drafter whose token -> id mapping
differs from its target's over the ids both define (speculation compares token ids, so a different
mapping silently proposes garbage; extra tokens at the end of one of them are fine).

The fingerprint is the sha256 of a canonical JSON of the BPE vocabulary, the merges and the added
(special) tokens: two files that tokenize identically but differ in whitespace or key order agree.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

EOS_TOKEN = "<|endoftext|>"


class TokenizerMismatchError(ValueError):
    """A drafter's tokenizer differs from its target's."""


class Tokenizer:
    def __init__(self, tok: HFTokenizer, eos_token: str | None = EOS_TOKEN) -> None:
        self.tok = tok
        self.eos_token = eos_token
        eos_id = tok.token_to_id(eos_token) if eos_token is not None else None
        if eos_token is not None and eos_id is None:
            raise ValueError(f"tokenizer has no end-of-text token {eos_token!r}")
        self.eos_id: int | None = eos_id
        self._fingerprint: str | None = None

    @classmethod
    def from_file(cls, path: str | Path, eos_token: str | None = None) -> Tokenizer:
        """Load `tokenizer.json` (or a folder holding it). Without `eos_token`, use the folder's
        `tokenizer_config.json` if present, else `<|endoftext|>` if the vocabulary has it."""
        p = Path(path)
        folder = p if p.is_dir() else p.parent
        if p.is_dir():
            p = p / "tokenizer.json"
        tok = HFTokenizer.from_file(str(p))
        if eos_token is None:
            eos_token = _eos_from_folder(folder)
        if eos_token is None and tok.token_to_id(EOS_TOKEN) is not None:
            eos_token = EOS_TOKEN
        return cls(tok, eos_token)

    @classmethod
    def from_str(cls, json_str: str, eos_token: str | None = EOS_TOKEN) -> Tokenizer:
        return cls(HFTokenizer.from_str(json_str), eos_token)

    def save(self, path: str | Path) -> None:
        self.tok.save(str(path))

    def to_str(self) -> str:
        return str(self.tok.to_str())

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [list(e.ids) for e in self.tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    @property
    def vocab_size(self) -> int:
        return int(self.tok.get_vocab_size(with_added_tokens=True))

    def id_to_token_table(self) -> list[str | None]:
        """Every id's token, in id order (None for an id no token has)."""
        vocab = self.tok.get_vocab(with_added_tokens=True)
        table: list[str | None] = [None] * (max(vocab.values(), default=-1) + 1)
        for token, token_id in vocab.items():
            table[token_id] = token
        return table

    @property
    def fingerprint(self) -> str:
        if self._fingerprint is None:
            self._fingerprint = _fingerprint(json.loads(self.tok.to_str()))
        return self._fingerprint

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Tokenizer) and self.fingerprint == other.fingerprint

    def __hash__(self) -> int:
        return hash(self.fingerprint)

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, eos={self.eos_token!r}, fp={self.fingerprint[:12]})"


def _eos_from_folder(folder: Path) -> str | None:
    cfg = folder / "tokenizer_config.json"
    if not cfg.is_file():
        return None
    eos = json.loads(cfg.read_text()).get("eos_token")
    if isinstance(eos, dict):  # older transformers saved AddedToken dicts
        eos = eos.get("content")
    return eos if isinstance(eos, str) else None


def _fingerprint(spec: dict[str, Any]) -> str:
    model = spec.get("model") or {}
    merges = []
    for m in model.get("merges") or []:
        # tokenizers < 0.20 wrote "a b" strings, later versions ["a", "b"] pairs: hash one form.
        merges.append(m.split(" ", 1) if isinstance(m, str) else list(m))
    added = sorted((int(t["id"]), str(t["content"])) for t in spec.get("added_tokens") or [])
    canonical = {
        "type": model.get("type"),
        "vocab": model.get("vocab"),
        "merges": merges,
        "added_tokens": added,
    }
    blob = json.dumps(canonical, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def train_bpe(
    texts: Iterable[str],
    vocab_size: int,
    special_tokens: Sequence[str] = (EOS_TOKEN,),
    min_frequency: int = 2,
) -> Tokenizer:
    """Train a byte-level BPE (every byte is in the alphabet, so any text round-trips)."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return Tokenizer(tok, special_tokens[0] if special_tokens else None)


def ensure_same_tokenizer(
    target_tok: Tokenizer, drafter_tok: Tokenizer, target_name: str = "target", drafter_name: str = "drafter"
) -> None:
    """Raise `TokenizerMismatchError` naming both models unless every id both tokenizers define
    stands for the same token in each.

    One of them may define extra ids at the end (a larger model's folder adding tokens past the
    shared ones): the decoder then samples only the ids both cover. The fingerprint stays strict
    (it identifies one exact tokenizer), so identical tokenizers pass on it without a comparison.
    """
    if target_tok.fingerprint == drafter_tok.fingerprint:
        return
    target_ids, drafter_ids = target_tok.id_to_token_table(), drafter_tok.id_to_token_table()
    shared = min(len(target_ids), len(drafter_ids))
    if target_ids[:shared] == drafter_ids[:shared]:
        return
    first = next(i for i in range(shared) if target_ids[i] != drafter_ids[i])
    detail = ""
    if target_tok.vocab_size != drafter_tok.vocab_size:
        detail = f" (vocab sizes {target_tok.vocab_size} vs {drafter_tok.vocab_size})"
    raise TokenizerMismatchError(
        f"drafter {drafter_name!r} does not share the tokenizer of target {target_name!r}{detail}: "
        f"id {first} is {target_ids[first]!r} for the target but {drafter_ids[first]!r} for the drafter "
        f"(fingerprints {target_tok.fingerprint[:16]} and {drafter_tok.fingerprint[:16]}). "
        "Speculative decoding compares token ids, so the drafter must be trained with the target's "
        "tokenizer."
    )
