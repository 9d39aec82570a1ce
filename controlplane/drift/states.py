"""The drift-event state machine, pure: which state may follow which, and how an event ends.

::

    open ──(a realignment starts)──▶ realigning ──▶ resolved (promoted | candidate_rejected |
      │                                  │              canary_inconclusive | realignment_failed |
      ├──────────────────────────────────┴──────▶       not_enough_data | guardrail_action)
      └──(a person: false alarm)──▶ dismissed (dismissed)

An event is ``open`` while the detector's alarm stands unanswered and ``realigning`` while a
realignment (and then its canary) answers it. Every end carries a named resolution. While an
event is open or realigning the detector stays latched (one event per deployment); once it ends
the detector re-arms, so a drift that is still there raises a new event after the cooldown.

>>> transition(DriftState.open, DriftState.realigning).value
'realigning'
>>> transition(DriftState.resolved, DriftState.open)
Traceback (most recent call last):
...
controlplane.lifecycle.IllegalTransitionError: a resolved drift event cannot become open
"""

from __future__ import annotations

from controlplane.db.models import DriftResolution, DriftState
from controlplane.lifecycle import IllegalTransitionError, Lifecycle

__all__ = ["ALLOWED", "UNANSWERED", "IllegalTransitionError", "end_state", "transition"]

UNANSWERED = frozenset({DriftState.open, DriftState.realigning})

DRIFT_EVENTS = Lifecycle(
    "drift event",
    {
        DriftState.open: {DriftState.realigning, DriftState.resolved, DriftState.dismissed},
        DriftState.realigning: {DriftState.resolved, DriftState.dismissed},
        DriftState.resolved: set(),
        DriftState.dismissed: set(),
    },
)
ALLOWED = DRIFT_EVENTS.allowed
transition = DRIFT_EVENTS.move


def end_state(resolution: DriftResolution) -> DriftState:
    """The state an event ends in for a resolution.

    >>> end_state(DriftResolution.promoted).value, end_state(DriftResolution.dismissed).value
    ('resolved', 'dismissed')
    """
    return DriftState.dismissed if resolution == DriftResolution.dismissed else DriftState.resolved
