"""Shared pieces of the traffic domains: the document record, the split rule and the stdlib walk.

Everything here is deterministic for a given Python installation: files are visited in sorted order
and splits come from a hash of a stable key, never from a random draw, so a document keeps its split
when other documents are added or removed.
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SPLITS = ("train", "validation", "test")
# Share of documents (by key hash) that go to validation and to test; the rest trains.
VALIDATION_SHARE = 0.05
TEST_SHARE = 0.05

# Folders of the standard library that are not "the standard library's modules" as a user sees them:
# the regression tests (absent from many distro builds), codec tables (numbers, not code) and the
# pydoc topics (prose, used by the prose domain instead).
_EXCLUDED_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "encodings", "pydoc_data", "__pycache__"}
)
# Single files too large or too machine-generated to be representative code traffic.
_MAX_FILE_BYTES = 400_000


@dataclass(frozen=True)
class Document:
    """One unit of traffic text; splits are assigned per document, never inside one."""

    domain: str
    doc_id: str
    kind: str  # finer label inside the domain (e.g. "docstring", "sql"); the domain is the category
    text: str
    split: str


def split_of(key: str) -> str:
    """Deterministic train/validation/test assignment from a stable key (a path, a topic name)."""
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    u = int.from_bytes(digest[:8], "big") / 2**64
    if u < VALIDATION_SHARE:
        return "validation"
    if u < VALIDATION_SHARE + TEST_SHARE:
        return "test"
    return "train"


def stdlib_root() -> Path:
    """The running interpreter's pure-Python standard library folder."""
    return Path(sysconfig.get_paths()["stdlib"])


def python_tag() -> str:
    """Which interpreter's text the corpora were read from (the corpora differ between versions)."""
    v = sys.version_info
    return f"{sys.implementation.name}-{v.major}.{v.minor}.{v.micro}"


def stdlib_modules() -> Iterator[tuple[str, str]]:
    """Yield (relative path, source text) of the stdlib's own modules, in sorted order.

    Files that are not valid UTF-8 are skipped (a handful of legacy-encoded files): the corpora are
    text, and guessing encodings would make them machine-dependent.
    """
    root = stdlib_root()
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _EXCLUDED_DIRS)
        for name in sorted(filenames):
            if name.endswith(".py"):
                found.append(Path(dirpath) / name)
    for path in sorted(found):
        if path.stat().st_size > _MAX_FILE_BYTES:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        yield path.relative_to(root).as_posix(), text
