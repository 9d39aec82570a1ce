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
"""

from __future__ import annotations

from controlplane.db.models import DrafterState

ALLOWED: dict[DrafterState, frozenset[DrafterState]] = {
    DrafterState.candidate: frozenset({DrafterState.canary, DrafterState.active, DrafterState.rejected}),
    DrafterState.canary: frozenset({DrafterState.candidate, DrafterState.active, DrafterState.rejected}),
    DrafterState.active: frozenset({DrafterState.retired, DrafterState.rejected}),
    DrafterState.retired: frozenset({DrafterState.active}),
    DrafterState.rejected: frozenset(),
}
# Versions that may still serve (or be judged): staleness after a target change concerns these.
LIVE = frozenset({DrafterState.candidate, DrafterState.canary, DrafterState.active})
PROMOTABLE = frozenset({DrafterState.candidate, DrafterState.canary})


class IllegalTransitionError(ValueError):
    """A state change the drafter-version state machine does not allow."""

    def __init__(self, current: DrafterState, new: DrafterState) -> None:
        super().__init__(f"a {current.value} drafter version cannot become {new.value}")
        self.current = current
        self.new = new


def can_transition(current: DrafterState, new: DrafterState) -> bool:
    return new in ALLOWED[current]


def transition(current: DrafterState, new: DrafterState) -> DrafterState:
    """``new`` if the machine allows ``current -> new``; raises IllegalTransitionError otherwise.

    >>> transition(DrafterState.candidate, DrafterState.canary).value
    'canary'
    >>> transition(DrafterState.rejected, DrafterState.active)
    Traceback (most recent call last):
    ...
    controlplane.drafters.states.IllegalTransitionError: a rejected drafter version cannot become active
    """
    if not can_transition(current, new):
        raise IllegalTransitionError(current, new)
    return new
