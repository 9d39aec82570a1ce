"""The drafter-version state machine, pure: which state may follow which.

::

    candidate ──▶ canary ──▶ active ──▶ retired ──(rollback)──▶ active
        │   ▲        │          │
        │   └────────┘          └──(rollback)──▶ rejected
        ├──(promoted by hand)──▶ active
        └──────────── rejected ◀── canary

A realignment registers a ``candidate``; its canary makes it ``canary`` (and gives it back as a
``candidate`` when the canary ends inconclusive or is superseded). A promotion makes it
``active`` and the version it replaces ``retired`` (kept for rollback); a rollback ``rejects``
the active version and makes the retired one ``active`` again. ``rejected`` is final.

>>> transition(DrafterState.candidate, DrafterState.canary).value
'canary'
>>> transition(DrafterState.rejected, DrafterState.active)
Traceback (most recent call last):
...
controlplane.lifecycle.IllegalTransitionError: a rejected drafter version cannot become active
"""

from __future__ import annotations

from controlplane.db.models import DrafterState
from controlplane.lifecycle import IllegalTransitionError, Lifecycle

__all__ = ["ALLOWED", "LIVE", "PROMOTABLE", "IllegalTransitionError", "transition"]

DRAFTER_VERSIONS = Lifecycle(
    "drafter version",
    {
        DrafterState.candidate: {DrafterState.canary, DrafterState.active, DrafterState.rejected},
        DrafterState.canary: {DrafterState.candidate, DrafterState.active, DrafterState.rejected},
        DrafterState.active: {DrafterState.retired, DrafterState.rejected},
        DrafterState.retired: {DrafterState.active},
        DrafterState.rejected: set(),
    },
)
ALLOWED = DRAFTER_VERSIONS.allowed
transition = DRAFTER_VERSIONS.move
# Versions that may still serve (or be judged): staleness after a target change concerns these.
LIVE = frozenset({DrafterState.candidate, DrafterState.canary, DrafterState.active})
PROMOTABLE = frozenset({DrafterState.candidate, DrafterState.canary})
