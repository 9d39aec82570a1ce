"""The held-out split of a deployment's traces: which traces realignment keeps out of training, so
that its scores and the canary's shadow replay are measured on requests the drafter never saw.

The split is a hash of the trace's key and the training seed, so the trainer (in the workers) and
the replay's prompt selection (in the control plane) agree without sharing any state.
"""

from __future__ import annotations

import hashlib

# The share of a realignment's recent traces held out for scoring (and so for the replay).
REALIGN_HOLDOUT_SHARE = 0.1


def trace_key(trace_id: int) -> str:
    """The key a stored trace is split and trained under."""
    return f"trace-{trace_id}"


def is_held_out(key: str, seed: int, share: float) -> bool:
    """Whether the trace with ``key`` is held out at this seed and share (stable across runs).

    >>> is_held_out("trace-1", 0, 0.0), is_held_out("trace-1", 0, 1.0)
    (False, True)
    """
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < share
