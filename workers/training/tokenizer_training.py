"""Train the byte-level BPE that the target and every drafter share, from the corpora's train splits.

The structured domain is generated text with a small vocabulary of its own; it is capped so that its
templates do not take over the merge table that prose and code need.
"""

from __future__ import annotations

from collections.abc import Iterator

from workers import corpora
from workers.engine.tokenizer import EOS_TOKEN, Tokenizer, train_bpe

VOCAB_SIZE = 4096
# Enough documents to learn the structured domain's keywords, not so many that they dominate merges.
STRUCTURED_DOCS_FOR_TOKENIZER = 2000


def training_texts(max_docs_per_domain: int | None = None) -> Iterator[str]:
    """Train-split texts of every domain, in a fixed order (so the merges are reproducible)."""
    for domain in corpora.DOMAINS:
        docs = corpora.texts(domain, "train")
        cap = STRUCTURED_DOCS_FOR_TOKENIZER if domain == "structured" else None
        if max_docs_per_domain is not None:
            cap = min(cap or max_docs_per_domain, max_docs_per_domain)
        yield from docs[:cap] if cap is not None else docs


def train_tokenizer(vocab_size: int = VOCAB_SIZE, max_docs_per_domain: int | None = None) -> Tokenizer:
    """A byte-level BPE with ``<|endoftext|>`` as its only special token (id 0)."""
    return train_bpe(training_texts(max_docs_per_domain), vocab_size=vocab_size, special_tokens=(EOS_TOKEN,))
