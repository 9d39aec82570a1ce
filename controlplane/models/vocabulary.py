"""Tokenizer vocabularies read from tokenizer.json, their fingerprints, and the check that a
drafter tokenizes like its target.

A drafter's proposals are token ids that the target verifies, so the two must give every shared id
the same token. The file is parsed as plain JSON: the control plane installs without the
``tokenizers`` package.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from controlplane.models.sources import ModelSourceError

TOKENIZER_FILE = "tokenizer.json"
# Far above any real vocabulary (the largest are a few hundred thousand tokens); an id beyond it
# is a corrupt or hostile file, not a reason to allocate gigabytes.
MAX_TOKEN_ID = (1 << 22) - 1
MAX_REPORTED_DIFFERENCES = 3

Vocabulary = list[str | None]


class TokenizerMismatchError(ValueError):
    """A drafter whose token ids do not mean what the target's do."""


def _refuse(path: Path, problem: str) -> ModelSourceError:
    return ModelSourceError(
        f"{path} {problem}; save the model's fast tokenizer again "
        "(AutoTokenizer.from_pretrained(...).save_pretrained(folder))"
    )


def _token_id(value: Any, path: Path, token: str) -> int:
    # bool is an int in Python, never a token id.
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_TOKEN_ID:
        raise _refuse(path, f"gives token {token!r} the id {value!r}, not an id from 0 to {MAX_TOKEN_ID}")
    return value


def load_vocabulary(folder: Path) -> Vocabulary:
    """Id → token from ``folder``/tokenizer.json: ``model.vocab`` (token → id for BPE, WordPiece
    and WordLevel; [piece, score] pairs for Unigram, the id being the position) plus
    ``added_tokens``, which win where they share an id. Ids that name no token are None."""
    path = Path(folder) / TOKENIZER_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise _refuse(path, "does not exist") from exc
    except (OSError, ValueError) as exc:
        raise _refuse(path, f"is not readable JSON ({exc})") from exc
    model = data.get("model") if isinstance(data, dict) else None
    raw_vocab = model.get("vocab") if isinstance(model, dict) else None
    tokens: dict[int, str] = {}
    if isinstance(raw_vocab, dict):
        for token, value in raw_vocab.items():
            tokens[_token_id(value, path, token)] = str(token)
    elif isinstance(raw_vocab, list):
        if len(raw_vocab) > MAX_TOKEN_ID + 1:
            raise _refuse(path, f"lists {len(raw_vocab)} pieces, more than any real vocabulary")
        for position, entry in enumerate(raw_vocab):
            if not isinstance(entry, list | tuple) or not entry or not isinstance(entry[0], str):
                raise _refuse(path, f"has model.vocab entry {position} that is not a [piece, score] pair")
            tokens[position] = entry[0]
    else:
        raise _refuse(path, "has no model.vocab (a token → id map or a list of [piece, score] pairs)")
    added = data.get("added_tokens") or []
    if not isinstance(added, list):
        raise _refuse(path, "has added_tokens that is not a list")
    for entry in added:
        if not isinstance(entry, dict) or not isinstance(entry.get("content"), str):
            raise _refuse(path, f"has an added token without content: {entry!r:.80}")
        tokens[_token_id(entry.get("id"), path, entry["content"])] = entry["content"]
    if not tokens:
        raise _refuse(path, "holds no tokens")
    vocabulary: Vocabulary = [None] * (max(tokens) + 1)
    for token_id, token in tokens.items():
        vocabulary[token_id] = token
    return vocabulary


def vocabulary_fingerprint(vocab: Sequence[str | None]) -> str:
    """Sha256 (hex) of the canonical id → token listing: equal exactly when the vocabularies are."""
    # ASCII escapes: a token JSON allows but UTF-8 cannot encode (a lone surrogate) still hashes.
    canonical = json.dumps(list(vocab), ensure_ascii=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("ascii")).hexdigest()


def _shown(token: str | None) -> str:
    return "no token" if token is None else repr(token)


def check_compatible(
    target_vocab: Sequence[str | None],
    drafter_vocab: Sequence[str | None],
    *,
    target_name: str,
    drafter_name: str,
) -> None:
    """Raise TokenizerMismatchError unless every id both vocabularies have names the same token.

    Either side may go on past the other (padding rows, extra special tokens at the end); an
    empty shared range is a mismatch.
    """
    shared = min(len(target_vocab), len(drafter_vocab))
    prefix = f"drafter {drafter_name!r} and target {target_name!r} tokenize differently"
    advice = "; register a drafter trained with the target's tokenizer"
    if shared == 0:
        empty = [
            name for name, vocab in ((target_name, target_vocab), (drafter_name, drafter_vocab)) if not vocab
        ]
        raise TokenizerMismatchError(
            f"{prefix}: no token ids in common ({' and '.join(repr(n) for n in empty)} "
            f"{'has' if len(empty) == 1 else 'have'} an empty vocabulary){advice}"
        )
    differing = [i for i in range(shared) if target_vocab[i] != drafter_vocab[i]]
    if not differing:
        return
    details = [
        f"id {i} is {_shown(target_vocab[i])} in {target_name} "
        f"but {_shown(drafter_vocab[i])} in {drafter_name}"
        for i in differing[:MAX_REPORTED_DIFFERENCES]
    ]
    more = len(differing) - len(details)
    tail = f" (and {more} more of the {shared} shared ids)" if more else ""
    raise TokenizerMismatchError(f"{prefix}: {'; '.join(details)}{tail}{advice}")
