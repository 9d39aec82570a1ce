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
"""

from __future__ import annotations

from controlplane.db.models import DriftResolution, DriftState

UNANSWERED = frozenset({DriftState.open, DriftState.realigning})

ALLOWED: dict[DriftState, frozenset[DriftState]] = {
    DriftState.open: frozenset({DriftState.realigning, DriftState.resolved, DriftState.dismissed}),
    DriftState.realigning: frozenset({DriftState.resolved, DriftState.dismissed}),
    DriftState.resolved: frozenset(),
    DriftState.dismissed: frozenset(),
}


class IllegalTransitionError(ValueError):
    """A state change the drift-event state machine does not allow."""

    def __init__(self, current: DriftState, new: DriftState) -> None:
        super().__init__(f"a {current.value} drift event cannot become {new.value}")
        self.current = current
        self.new = new


def end_state(resolution: DriftResolution) -> DriftState:
    """The state an event ends in for a resolution.

    >>> end_state(DriftResolution.promoted).value, end_state(DriftResolution.dismissed).value
    ('resolved', 'dismissed')
    """
    return DriftState.dismissed if resolution == DriftResolution.dismissed else DriftState.resolved


def transition(current: DriftState, new: DriftState) -> DriftState:
    """``new`` if the machine allows ``current -> new``; raises IllegalTransitionError otherwise.

    >>> transition(DriftState.open, DriftState.realigning).value
    'realigning'
    >>> transition(DriftState.resolved, DriftState.open)
    Traceback (most recent call last):
    ...
    controlplane.drift.states.IllegalTransitionError: a resolved drift event cannot become open
    """
    if new not in ALLOWED[current]:
        raise IllegalTransitionError(current, new)
    return new
