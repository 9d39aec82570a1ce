"""What counts as the same prompt, and the held-out split built on it: which traces realignment
keeps out of training, so that its scores and the canary's shadow replay are measured on prompts
whose text (and, where the traffic names it, source document) never reached training.

The split hashes a trace's *content key* with the training seed, so the trainer (in the workers)
and the replay's prompt selection (in the control plane) agree without sharing any state, and two
requests with the same normalised prompt, or from the same source document, always fall on the
same side: a repeated prompt can never be trained on under one id and scored under another.

The key is one value (the document when there is one), so a prompt sent from two documents, or
once with a document and once without, could still hash to both sides. Hence the second rule, the
one every held-out figure rests on: a held-out trace whose prompt hash or document occurs among
the traces trained on (``TrainedContent``) is dropped from the held-out side, and the overlap of
what is kept is counted (``overlap_count``), never assumed to be 0.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from collections.abc import Iterable
from dataclasses import dataclass, field

# The share of a realignment's recent traces held out for scoring (and so for the replay).
REALIGN_HOLDOUT_SHARE = 0.1

_SPACE = re.compile(r"\s+")


def normalised_prompt(text: str) -> str:
    """A prompt as compared for repeats and overlap: Unicode NFKC, case-folded, runs of white space
    as one space, no leading or trailing space.

    >>> normalised_prompt("  Hello\\n\\tWORLD ") == normalised_prompt("hello world")
    True
    """
    return _SPACE.sub(" ", unicodedata.normalize("NFKC", text).casefold()).strip()


def prompt_hash(text: str) -> str:
    """The sha256 (hex) of the normalised prompt: one value per prompt, whatever its spacing or case."""
    return hashlib.sha256(normalised_prompt(text).encode()).hexdigest()


def content_key(prompt: str, document: str | None = None) -> str:
    """The key a trace is split under: its source document when the traffic names one (every prompt
    cut from one document falls on one side), else its normalised prompt's hash.

    >>> content_key("a  b") == content_key("A b"), content_key("x", "doc-1") == content_key("y", "doc-1")
    (True, True)
    """
    if document:
        return f"document:{document}"
    return f"prompt:{prompt_hash(prompt)}"


def is_held_out(key: str, seed: int, share: float) -> bool:
    """Whether the trace with ``key`` is held out at this seed and share (stable across runs).

    >>> is_held_out("prompt:1", 0, 0.0), is_held_out("prompt:1", 0, 1.0)
    (False, True)
    """
    return holdout_rank(key, seed) < share


def holdout_rank(key: str, seed: int) -> float:
    """Where ``key`` falls in the split's order at this seed, in [0, 1): a key is held out at every
    share above its rank, so the keys a larger share would hold out next have the smallest ranks."""
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


@dataclass(frozen=True, slots=True)
class Content:
    """What a trace is compared by for overlap: its normalised prompt's hash and its source
    document (None: the traffic named none)."""

    prompt_hash: str
    document: str | None = None


def content_of(prompt: str, document: str | None = None) -> Content:
    """A trace's ``Content`` (an empty document counts as none).

    >>> content_of("Hi  there", "") == content_of("hi there")
    True
    """
    return Content(prompt_hash(prompt), document or None)


@dataclass(slots=True)
class TrainedContent:
    """The prompt hashes and source documents of the traces a drafter trained on.

    >>> seen = TrainedContent.of([content_of("a b", "doc-1")])
    >>> [seen.overlaps(content_of(*c)) for c in [("A  B",), ("c", "doc-1"), ("c",)]]
    [True, True, False]
    """

    prompt_hashes: set[str] = field(default_factory=set)
    documents: set[str] = field(default_factory=set)

    @classmethod
    def of(cls, contents: Iterable[Content]) -> TrainedContent:
        seen = cls()
        for content in contents:
            seen.add(content)
        return seen

    def add(self, content: Content) -> None:
        self.prompt_hashes.add(content.prompt_hash)
        if content.document is not None:
            self.documents.add(content.document)

    def overlaps(self, content: Content) -> bool:
        """Whether the trace's prompt, or its document, reached training."""
        return content.prompt_hash in self.prompt_hashes or (
            content.document is not None and content.document in self.documents
        )


def overlap_count(held_out: Iterable[Content], trained: TrainedContent) -> int:
    """How many held-out traces share a prompt or a document with the traces trained on (the
    figure published as ``heldout_prompt_overlap``: 0 when the split holds)."""
    return sum(1 for content in held_out if trained.overlaps(content))
