"""Built-in traffic domains made only from text present on every machine with Python.

Three domains, each split into train / validation / test by document:

- ``prose``: the ``pydoc`` language-reference topics and the stdlib's docstrings (English prose);
- ``code``: the stdlib's own Python modules, one document per file;
- ``structured``: natural-language requests answered by SQL or a JSON tool call, from templates.

``prompts(domain, split, n, seed)`` yields prefixes of held-out documents, cut at a line boundary
(prose, code) or right after an answer marker (structured), with the held-out continuation attached
as ``reference``. Every request carries ``category``, the traffic label a deployment monitors (the
domain name), so acceptance can be baselined per category.

The prose and code domains depend on the interpreter's version (their text is its stdlib);
:func:`fingerprint` records which interpreter and a sha256 per domain and split, so a model's
recipe can name the exact corpus it was trained on.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache

from workers.corpora import code, prose, structured
from workers.corpora._common import SPLITS, Document, python_tag, split_of

DOMAINS = ("prose", "code", "structured")
# "tool" is the name the design notes use for the structured domain.
ALIASES = {"tool": "structured"}
# The traffic category label that requests of each domain carry.
CATEGORY = {"prose": "prose", "code": "code", "structured": "structured"}

__all__ = [
    "ALIASES",
    "CATEGORY",
    "DOMAINS",
    "SPLITS",
    "Document",
    "Prompt",
    "documents",
    "fingerprint",
    "prompts",
    "split_of",
    "texts",
]


@dataclass(frozen=True)
class Prompt:
    """A request made from a held-out document: its prefix, and the text that really followed."""

    text: str
    reference: str
    domain: str
    category: str
    doc_id: str
    kind: str


def _domain(name: str) -> str:
    name = ALIASES.get(name, name)
    if name not in DOMAINS:
        raise ValueError(f"unknown domain {name!r}; expected one of {DOMAINS} (or {sorted(ALIASES)})")
    return name


@cache
def _all(domain: str) -> tuple[Document, ...]:
    builder = {"prose": prose.build, "code": code.build, "structured": structured.build}[domain]
    return tuple(builder())


def documents(domain: str, split: str) -> list[Document]:
    """The documents of one domain and split, in a fixed order."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    return [d for d in _all(_domain(domain)) if d.split == split]


def texts(domain: str, split: str) -> list[str]:
    """The documents' texts (what tokenizer and model training read)."""
    return [d.text for d in documents(domain, split)]


def _cut_points(doc: Document, min_prefix: int, min_rest: int) -> list[int]:
    """Where a prompt of this document may end: after a newline, or after a structured answer marker."""
    text = doc.text
    if doc.domain == "structured":
        points = []
        for marker in structured.ANSWER_MARKERS:
            start = 0
            while (i := text.find(marker, start)) >= 0:
                points.append(i + len(marker))
                start = i + 1
        return sorted(points)
    return [
        i + 1
        for i, ch in enumerate(text)
        if ch == "\n" and min_prefix <= i + 1 <= len(text) - min_rest and not text[i + 1 : i + 2].isspace()
    ] or [i + 1 for i, ch in enumerate(text) if ch == "\n" and min_prefix <= i + 1 <= len(text) - min_rest]


def prompts(
    domain: str,
    split: str = "test",
    n: int = 32,
    seed: int = 0,
    max_prompt_chars: int = 800,
    min_prompt_chars: int = 200,
    reference_chars: int = 600,
) -> Iterator[Prompt]:
    """Yield up to ``n`` prompts: prefixes of this split's documents, cut at a natural boundary.

    The same (domain, split, n, seed) always gives the same prompts. A prompt keeps at most the last
    ``max_prompt_chars`` characters of its prefix (trimmed to a line start), so it fits a small
    model's context; documents are drawn without replacement, one prompt per document, until
    ``n`` are made or the split runs out.
    """
    domain = _domain(domain)
    rng = random.Random(f"prompts:{domain}:{split}:{seed}")
    docs = documents(domain, split)
    order = list(range(len(docs)))
    rng.shuffle(order)
    made = 0
    for index in order:
        if made >= n:
            return
        doc = docs[index]
        points = _cut_points(doc, min_prompt_chars, min_rest=100)
        if not points:
            continue
        cut = rng.choice(points)
        start = max(0, cut - max_prompt_chars)
        if start > 0:
            # Start at a line boundary so the prompt does not open mid-word.
            nl = doc.text.find("\n", start, cut)
            start = nl + 1 if 0 <= nl < cut - 1 else start
        made += 1
        yield Prompt(
            text=doc.text[start:cut],
            reference=doc.text[cut : cut + reference_chars],
            domain=domain,
            category=CATEGORY[domain],
            doc_id=doc.doc_id,
            kind=doc.kind,
        )


def fingerprint() -> dict[str, object]:
    """Which interpreter the corpora came from, and a sha256 and size per domain and split."""
    out: dict[str, object] = {"python": python_tag()}
    for domain in DOMAINS:
        for split in SPLITS:
            h = hashlib.sha256()
            docs = documents(domain, split)
            for d in docs:
                h.update(d.doc_id.encode() + b"\0" + d.text.encode() + b"\0")
            out[f"{domain}/{split}"] = {
                "documents": len(docs),
                "chars": sum(len(d.text) for d in docs),
                "sha256": h.hexdigest(),
            }
    return out
