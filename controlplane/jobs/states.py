"""The job state machine, pure: which state may follow which, and nothing else.

``queued -> running -> succeeded | failed | cancelled``; a queued job may also be cancelled or fail
(it could not be enqueued). ``running -> queued`` is a realign attempt that failed or lost its
worker (its lease lapsed) going back to wait for its next attempt (see ``jobs.recovery``), and
``running -> running`` the restart of a task that the broker redelivered after its worker died
(acks_late), which counts one more attempt. Terminal states have no way out: a finished job is
history, and a new run is a new job.

>>> transition(JobState.queued, JobState.running).value
'running'
>>> transition(JobState.succeeded, JobState.running)
Traceback (most recent call last):
...
controlplane.lifecycle.IllegalTransitionError: a succeeded job cannot become running
"""

from __future__ import annotations

from controlplane.db.models import JobState
from controlplane.lifecycle import IllegalTransitionError, Lifecycle

__all__ = ["ACTIVE", "ALLOWED", "TERMINAL", "IllegalTransitionError", "can_transition", "transition"]

ACTIVE = frozenset({JobState.queued, JobState.running})

JOBS = Lifecycle(
    "job",
    {
        JobState.queued: frozenset({JobState.running, JobState.failed, JobState.cancelled}),
        JobState.running: frozenset(
            {JobState.queued, JobState.running, JobState.succeeded, JobState.failed, JobState.cancelled}
        ),
        JobState.succeeded: frozenset(),
        JobState.failed: frozenset(),
        JobState.cancelled: frozenset(),
    },
)
ALLOWED = JOBS.allowed
TERMINAL = JOBS.final
can_transition = JOBS.can_move
transition = JOBS.move
