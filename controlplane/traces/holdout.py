"""What counts as the same prompt, and the held-out split built on it: which traces realignment
keeps out of training, so that its scores and the canary's shadow replay are measured on prompts
whose text (and, where the traffic names it, source document) never reached training.

The split hashes a trace's *content key* with the training seed, so the trainer (in the workers)
and the replay's prompt selection (in the control plane) agree without sharing any state, and two
requests with the same normalised prompt, or from the same source document, always fall on the
same side: a repeated prompt can never be trained on under one id and scored under another.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata

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
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < share
