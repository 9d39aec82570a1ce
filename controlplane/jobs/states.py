"""The job state machine, pure: which state may follow which, and nothing else.

``queued -> running -> succeeded | failed | cancelled``; a queued job may also be cancelled or fail
(it could not be enqueued), and ``running -> running`` is the restart of a task that the broker
redelivered after its worker died (acks_late), which counts one more attempt. Terminal states
have no way out: a finished job is history, and a new run is a new job.
"""

from __future__ import annotations

from controlplane.db.models import JobState

TERMINAL = frozenset({JobState.succeeded, JobState.failed, JobState.cancelled})
ACTIVE = frozenset({JobState.queued, JobState.running})

ALLOWED: dict[JobState, frozenset[JobState]] = {
    JobState.queued: frozenset({JobState.running, JobState.failed, JobState.cancelled}),
    JobState.running: frozenset({JobState.running, JobState.succeeded, JobState.failed, JobState.cancelled}),
    JobState.succeeded: frozenset(),
    JobState.failed: frozenset(),
    JobState.cancelled: frozenset(),
}


class IllegalTransitionError(ValueError):
    """A state change the job state machine does not allow."""

    def __init__(self, current: JobState, new: JobState) -> None:
        super().__init__(f"a {current.value} job cannot become {new.value}")
        self.current = current
        self.new = new


def can_transition(current: JobState, new: JobState) -> bool:
    return new in ALLOWED[current]


def transition(current: JobState, new: JobState) -> JobState:
    """``new`` if the machine allows ``current -> new``; raises IllegalTransitionError otherwise.

    >>> transition(JobState.queued, JobState.running).value
    'running'
    >>> transition(JobState.succeeded, JobState.running)
    Traceback (most recent call last):
    ...
    controlplane.jobs.states.IllegalTransitionError: a succeeded job cannot become running
    """
    if not can_transition(current, new):
        raise IllegalTransitionError(current, new)
    return new
