"""Code domain: the standard library's own Python modules, one document per file.

The split key is the file's path relative to the stdlib folder, the same key the prose domain uses
for that module's docstrings, so the two domains never leak a held-out module into training.
"""

from __future__ import annotations

from workers.corpora._common import Document, split_of, stdlib_modules

DOMAIN = "code"


def build() -> list[Document]:
    """All code documents in sorted path order; the kind is the top-level package (or "module")."""
    docs = []
    for rel, source in stdlib_modules():
        kind = rel.split("/", 1)[0] if "/" in rel else "module"
        docs.append(Document(DOMAIN, f"file:{rel}", kind, source, split_of(rel)))
    return docs
