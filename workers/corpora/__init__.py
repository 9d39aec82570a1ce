"""Built-in traffic domains made only from text present on every machine with Python.

Three domains, each split into train / validation / test by document:

- ``prose``: the ``pydoc`` language-reference topics and the stdlib's docstrings (English prose);
- ``code``: the stdlib's own Python modules, one document per file;
- ``structured``: natural-language requests answered by SQL or a JSON tool call, from templates.

``prompts(domain, split, n, seed)`` yields prefixes of held-out documents, cut at a line boundary
(prose, code) or right after an answer marker (structured), with the held-out continuation attached
as ``reference``, one per document: what the benches measure on. Every request carries
``category``, the traffic label a deployment monitors (the domain name), so acceptance can be
baselined per category.

``traffic_prompts(domain, split, seed, heldout=...)`` is what scenario traffic sends: an endless
stream in which every prompt is a new draw, so that prompts rarely repeat verbatim. A structured
prompt is cut from a document of its own, generated without bound (:mod:`workers.corpora.generated`:
Faker's names, places and companies, many phrasings per task, the fixed corpus's answer grammar). A
prose or code prompt is a distinct (document, cut point, window length) draw: it ends at any word
boundary and starts at any word start 200-800 characters earlier. The bundled prose test split is
the interpreter's own text and small (about 25 documents, 70,000 characters), so prose prompts share
documents and overlap one another heavily even when no two are equal; traffic on a real model's
generated corpora is what carries headline figures. Documents are partitioned by a hash of their
key (``<domain>:<doc_id>``): :data:`HELDOUT_DOCUMENT_SHARE` of them only ever feed held-out
streams, the rest only the others, so a held-out phase shares no document with any other phase.

Two more domains are traffic only, for instruction-tuned targets (:mod:`workers.corpora.chat`):
``chat`` (general assistant chat) and ``chat_structured`` (JSON extraction, tool calls, SQL). Their
requests are lists of chat messages, carried by ``Prompt.messages`` (``text`` is their plain
"<role>: <content>" rendering, what repeats are counted on; ``reference`` the expected answer where
one is known), each generated as a document of its own and split by the same document hash; a
held-out chat stream also keeps to its side of a hash of its last user turn, so the two sides never
ask the same question. They have no fixed documents: ``documents``, ``prompts`` and ``fingerprint``
cover the three completion domains only (:data:`DOMAINS`), as does model training.

The prose and code domains depend on the interpreter's version (their text is its stdlib);
:func:`fingerprint` records which interpreter and a sha256 per domain and split, so a model's
recipe can name the exact corpus it was trained on.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import random
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache

from workers.corpora import chat, code, generated, prose, structured, values
from workers.corpora._common import SPLITS, Document, python_tag, split_of
from workers.corpora.chat import CHAT_DOMAINS

DOMAINS = ("prose", "code", "structured")
# Every domain scenario traffic may draw from: the completion domains and the chat ones.
TRAFFIC_DOMAINS = DOMAINS + CHAT_DOMAINS
# "tool" is the name the design notes use for the structured domain.
ALIASES = {"tool": "structured"}
# The traffic category label that requests of each domain carry.
CATEGORY = {"prose": "prose", "code": "code", "structured": "structured"} | {d: d for d in CHAT_DOMAINS}
# The share of documents (by a hash of their key) that only held-out traffic draws from: of the
# bundled prose test split, 7 of 25 documents (20,000 of 71,000 characters; 5 long enough to cut).
HELDOUT_DOCUMENT_SHARE = 0.3
# A traffic prompt of prose or code is a window of this many characters, followed in its document
# by at least _MIN_REST more (the reference continuation).
TRAFFIC_MIN_PROMPT_CHARS, TRAFFIC_MAX_PROMPT_CHARS = 200, 800
_MIN_REST = 100

__all__ = [
    "ALIASES",
    "CATEGORY",
    "CHAT_DOMAINS",
    "DOMAINS",
    "HELDOUT_DOCUMENT_SHARE",
    "SPLITS",
    "TRAFFIC_DOMAINS",
    "Document",
    "Prompt",
    "document_key",
    "documents",
    "fingerprint",
    "is_heldout_document",
    "prepare_traffic",
    "prompts",
    "split_of",
    "texts",
    "traffic_prompts",
]


@dataclass(frozen=True)
class Prompt:
    """A request made from a held-out document: its prefix, and the text that really followed (for
    a chat domain: its messages, their plain rendering and the expected answer, "" if open-ended)."""

    text: str
    reference: str
    domain: str
    category: str
    doc_id: str
    kind: str
    messages: tuple[dict[str, str], ...] = ()


def _domain(name: str) -> str:
    name = ALIASES.get(name, name)
    if name not in DOMAINS:
        raise ValueError(f"unknown domain {name!r}; expected one of {DOMAINS} (or {sorted(ALIASES)})")
    return name


def _traffic_domain(name: str) -> str:
    name = ALIASES.get(name, name)
    if name not in TRAFFIC_DOMAINS:
        raise ValueError(f"unknown domain {name!r}; expected one of {TRAFFIC_DOMAINS} (or {sorted(ALIASES)})")
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


def document_key(domain: str, doc_id: str) -> str:
    """The key that names a document across domains (what a request's ``document`` field carries).

    >>> document_key("prose", "topic:integers")
    'prose:topic:integers'
    """
    return f"{_traffic_domain(domain)}:{doc_id}"


def is_heldout_document(key: str) -> bool:
    """Whether the document ``key`` is reserved for held-out traffic (a pure function of the key)."""
    digest = hashlib.sha256(f"heldout-traffic:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < HELDOUT_DOCUMENT_SHARE


def _word_bounds(text: str, min_prefix: int, min_rest: int) -> tuple[list[int], list[int]]:
    """Where a prose or code prompt may start (a word's first character, or the document's) and end
    (after a word, before the white space that follows it, so the continuation's first token carries
    its own leading space, as a tokenizer splits it)."""
    starts = [0] + [i for i in range(1, len(text)) if text[i - 1].isspace() and not text[i].isspace()]
    ends = [
        i
        for i in range(max(min_prefix, 1), len(text) - min_rest + 1)
        if text[i].isspace() and not text[i - 1].isspace()
    ]
    return starts, ends


@dataclass(frozen=True)
class _Windows:
    """Every (start, end) window of one document whose length is within the prompt bounds, counted
    without being listed: window ``w`` is found by bisecting the running totals."""

    doc: Document
    starts: tuple[int, ...]
    ends: tuple[int, ...]
    first_start: tuple[int, ...]  # per end: the index in `starts` of its earliest start
    totals: tuple[int, ...]  # per end: windows of this end and every earlier one

    def window(self, w: int) -> tuple[int, int]:
        e = bisect.bisect_right(self.totals, w)
        before = self.totals[e - 1] if e else 0
        return self.starts[self.first_start[e] + w - before], self.ends[e]


@cache
def _window_table(
    domain: str, split: str, heldout: bool, min_chars: int, max_chars: int, min_rest: int
) -> tuple[tuple[_Windows, ...], tuple[int, ...]]:
    """The documents on one side of the held-out partition with their windows, and the running total
    of windows over documents: a draw below the total is uniform over every window of every document."""
    tables: list[_Windows] = []
    totals: list[int] = []
    total = 0
    for doc in documents(domain, split):
        if is_heldout_document(document_key(domain, doc.doc_id)) != heldout:
            continue
        starts, ends = _word_bounds(doc.text, min_chars, min_rest)
        first, counts = [], []
        for end in ends:
            lo = bisect.bisect_left(starts, end - max_chars)
            hi = bisect.bisect_right(starts, end - min_chars)
            first.append(lo)
            counts.append(max(0, hi - lo))
        if sum(counts) == 0:
            continue
        tables.append(
            _Windows(doc, tuple(starts), tuple(ends), tuple(first), tuple(itertools.accumulate(counts)))
        )
        total += sum(counts)
        totals.append(total)
    return tuple(tables), tuple(totals)


def traffic_prompts(
    domain: str,
    split: str = "test",
    seed: int = 0,
    *,
    heldout: bool = False,
    max_prompt_chars: int = TRAFFIC_MAX_PROMPT_CHARS,
    min_prompt_chars: int = TRAFFIC_MIN_PROMPT_CHARS,
    reference_chars: int = 600,
) -> Iterator[Prompt]:
    """An endless stream of prompts for scenario traffic, each a new draw (see the module docstring).

    The same arguments always give the same stream. ``heldout`` picks the side of the document
    partition: held-out streams and the others never share a document.
    """
    domain = _traffic_domain(domain)
    if domain in CHAT_DOMAINS:
        yield from _chat_traffic(domain, split, seed, heldout)
        return
    side = "heldout" if heldout else "open"
    rng = random.Random(f"traffic:{domain}:{split}:{seed}:{side}")
    if domain == "structured":
        for index in itertools.count():
            made = generated.document(split, seed, index)
            doc = made.document
            if is_heldout_document(document_key(domain, doc.doc_id)) != heldout:
                continue
            # The answered request itself is on the same side as the document: the fixed corpus's
            # requests recur ("What is SONY trading at?"), and a held-out phase must never end
            # with a request that another phase's prompts end with, whatever their history.
            cuts = [
                cut
                for cut in _cut_points(doc, 0, 0)[made.history :]
                if is_heldout_document(f"request:{_answered_request(doc.text, cut)}") == heldout
            ]
            if not cuts:
                continue
            cut = rng.choice(cuts)
            start = max(0, cut - max_prompt_chars)
            if start > 0:
                nl = doc.text.find("\n", start, cut)
                start = nl + 1 if 0 <= nl < cut - 1 else start
            yield _prompt(doc, start, cut, reference_chars)
    tables, totals = _window_table(domain, split, heldout, min_prompt_chars, max_prompt_chars, _MIN_REST)
    if not tables:
        raise ValueError(f"the {domain}/{split} corpus has no {side} document long enough for a prompt")
    while True:
        draw = rng.randrange(totals[-1])
        which = bisect.bisect_right(totals, draw)
        table = tables[which]
        start, end = table.window(draw - (totals[which - 1] if which else 0))
        yield _prompt(table.doc, start, end, reference_chars)


def _chat_traffic(domain: str, split: str, seed: int, heldout: bool) -> Iterator[Prompt]:
    """The chat domains' stream: the documents on ``heldout``'s side of both partitions, in order."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    for index in itertools.count():
        doc = chat.document(domain, split, seed, index)
        if is_heldout_document(document_key(domain, doc.doc_id)) != heldout:
            continue
        asked = " ".join(chat.last_user_turn(doc.messages).casefold().split())
        if is_heldout_document(f"request:{asked}") != heldout:
            continue
        yield Prompt(
            text=chat.plain_text(doc.messages),
            reference=doc.reference,
            domain=domain,
            category=CATEGORY[domain],
            doc_id=doc.doc_id,
            kind=doc.kind,
            messages=doc.messages,
        )


def prepare_traffic(domain: str, split: str = "test") -> None:
    """Build what ``traffic_prompts`` draws from (seconds: the corpus, its windows, Faker's pools),
    so a caller can do it before any clock starts."""
    domain = _traffic_domain(domain)
    if domain in CHAT_DOMAINS:
        chat.prepare()
        return
    documents(domain, split)
    if domain == "structured":
        values.pools()
        return
    for heldout in (False, True):
        _window_table(domain, split, heldout, TRAFFIC_MIN_PROMPT_CHARS, TRAFFIC_MAX_PROMPT_CHARS, _MIN_REST)


def _answered_request(text: str, cut: int) -> str:
    """The request a structured prompt cut at ``cut`` asks to answer (its last "User:" line),
    normalised as prompts are compared."""
    return " ".join(text[:cut].split("\n")[-2].casefold().split())


def _prompt(doc: Document, start: int, cut: int, reference_chars: int) -> Prompt:
    return Prompt(
        text=doc.text[start:cut],
        reference=doc.text[cut : cut + reference_chars],
        domain=doc.domain,
        category=CATEGORY[doc.domain],
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
