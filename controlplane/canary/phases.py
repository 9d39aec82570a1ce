"""The canary phase machine, pure: which phase may follow which, and the decisions that end one.

::

    shadow ──(replay passed [, pool ready])──▶ live ──(promote)──▶ watching ──▶ closed
       │  └──(decided on the replay alone)───────────────┤                  │           │
       │                                                 ▼                  └───────────┴──▶ rolled_back
       └──(broken, harmful, superseded, pool never ready)──▶ decided ◀──(reject, inconclusive, superseded)

``shadow``: the gpu worker replays held-out prompts through no speculation, the incumbent and the
candidate. On a deployment with an actuator (webhook or command), a replay that passes leaves the
canary in ``shadow`` with ``arms["pool"]["state"] == "waiting"`` and no traffic split: the fleet
was told to load the candidate, and the canary goes live once the candidate pool is ready (its
readiness URLs answer 2xx, or the actuator calls back) or ends inconclusive when the pool is not
ready by the actuator's ``ready_timeout_s``. With the reference actuator it goes live at once.
``live``: the serving config splits traffic and ingested records feed the sequential
decision. ``decided``: rejected or inconclusive; the incumbent keeps serving. ``watching``: the
candidate was promoted and its first requests are checked against the canary's estimate.
``closed``: the watch ended without a shortfall. ``rolled_back``: the promotion was undone (by the
watch or by hand), even after the watch closed.
"""

from __future__ import annotations

from controlplane.db.models import CanaryDecision, CanaryPhase
from controlplane.lifecycle import IllegalTransitionError, Lifecycle

__all__ = [
    "ALLOWED",
    "OPEN",
    "UNDECIDED",
    "CanaryDecision",
    "CanaryPhase",
    "IllegalTransitionError",
    "can_move",
    "move",
]


# Still to be judged: a candidate in these phases may be promoted or rejected.
UNDECIDED = frozenset({CanaryPhase.shadow, CanaryPhase.live})
# Still needing the automation's attention (judging or watching); at most one per deployment.
OPEN = frozenset({CanaryPhase.shadow, CanaryPhase.live, CanaryPhase.watching})

CANARIES = Lifecycle(
    "canary",
    {
        CanaryPhase.shadow: {CanaryPhase.live, CanaryPhase.decided, CanaryPhase.watching},
        CanaryPhase.live: {CanaryPhase.decided, CanaryPhase.watching},
        CanaryPhase.decided: set(),
        CanaryPhase.watching: {CanaryPhase.closed, CanaryPhase.rolled_back},
        CanaryPhase.closed: {CanaryPhase.rolled_back},
        CanaryPhase.rolled_back: set(),
    },
)
ALLOWED = CANARIES.allowed


def can_move(current: str, new: str) -> bool:
    return CANARIES.can_move(CanaryPhase(current), CanaryPhase(new))


def move(current: str, new: str) -> CanaryPhase:
    """``new`` if the table allows ``current -> new`` (phases as stored: plain strings).

    >>> move("shadow", "live").value
    'live'
    >>> move("decided", "live")
    Traceback (most recent call last):
    ...
    controlplane.lifecycle.IllegalTransitionError: a decided canary cannot become live
    """
    return CANARIES.move(CanaryPhase(current), CanaryPhase(new))
