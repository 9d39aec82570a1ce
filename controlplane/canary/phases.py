"""The canary phase machine, pure: which phase may follow which, and the decisions that end one.

::

    shadow ──(replay recorded, not broken)──▶ live ──(promote)──▶ watching ──▶ closed
       │  └──(decided on the replay alone)─────────┤                  │           │
       │                                           ▼                  └───────────┴──▶ rolled_back
       └──(broken, harmful, superseded)──▶ decided ◀──(reject, inconclusive, superseded)

``shadow``: the gpu worker replays held-out prompts through no speculation, the incumbent and the
candidate. ``live``: the serving config splits traffic and ingested records feed the sequential
decision. ``decided``: rejected or inconclusive; the incumbent keeps serving. ``watching``: the
candidate was promoted and its first requests are checked against the canary's estimate.
``closed``: the watch ended without a shortfall. ``rolled_back``: the promotion was undone (by the
watch or by hand), even after the watch closed.
"""

from __future__ import annotations

import enum


class CanaryPhase(enum.StrEnum):
    shadow = "shadow"
    live = "live"
    decided = "decided"
    watching = "watching"
    closed = "closed"
    rolled_back = "rolled_back"


class CanaryDecision(enum.StrEnum):
    promote = "promote"
    reject = "reject"
    inconclusive = "inconclusive"


# Still to be judged: a candidate in these phases may be promoted or rejected.
UNDECIDED = frozenset({CanaryPhase.shadow, CanaryPhase.live})
# Still needing the automation's attention (judging or watching); at most one per deployment.
OPEN = frozenset({CanaryPhase.shadow, CanaryPhase.live, CanaryPhase.watching})

ALLOWED: dict[CanaryPhase, frozenset[CanaryPhase]] = {
    CanaryPhase.shadow: frozenset({CanaryPhase.live, CanaryPhase.decided, CanaryPhase.watching}),
    CanaryPhase.live: frozenset({CanaryPhase.decided, CanaryPhase.watching}),
    CanaryPhase.decided: frozenset(),
    CanaryPhase.watching: frozenset({CanaryPhase.closed, CanaryPhase.rolled_back}),
    CanaryPhase.closed: frozenset({CanaryPhase.rolled_back}),
    CanaryPhase.rolled_back: frozenset(),
}

# The phase a decision leads to.
AFTER_DECISION: dict[CanaryDecision, CanaryPhase] = {
    CanaryDecision.promote: CanaryPhase.watching,
    CanaryDecision.reject: CanaryPhase.decided,
    CanaryDecision.inconclusive: CanaryPhase.decided,
}


class IllegalPhaseChangeError(ValueError):
    """A phase change the canary phase machine does not allow."""

    def __init__(self, current: CanaryPhase, new: CanaryPhase) -> None:
        super().__init__(f"a canary in phase {current.value} cannot move to {new.value}")
        self.current = current
        self.new = new


def can_move(current: str, new: str) -> bool:
    return CanaryPhase(new) in ALLOWED[CanaryPhase(current)]


def move(current: str, new: str) -> CanaryPhase:
    """``new`` if the machine allows ``current -> new``; raises IllegalPhaseChangeError otherwise.

    >>> move("shadow", "live").value
    'live'
    >>> move("decided", "live")
    Traceback (most recent call last):
    ...
    controlplane.canary.phases.IllegalPhaseChangeError: a canary in phase decided cannot move to live
    """
    if not can_move(current, new):
        raise IllegalPhaseChangeError(CanaryPhase(current), CanaryPhase(new))
    return CanaryPhase(new)
