"""How a realign job recovers, pure: the backoff before its next attempt, when a running attempt's
lease has lapsed, what follows a lost or failed attempt (another try, or the end), and how long a
deployment a guardrail switched to its fallback waits before each new try at a drafter.

An attempt that raised goes back to ``queued`` until ``next_attempt_at``; an attempt whose worker
stopped renewing its lease (killed, hung, cut off) is treated the same way by the beat sweep.
Attempts are counted when they start, so ``attempts`` is also the number of the running one.

>>> retry_delay_s(1, base_s=60), retry_delay_s(3, base_s=60)
(60.0, 240.0)
>>> [after_failed_attempt(attempts=n, max_attempts=3).retry for n in (1, 2, 3)]
[True, True, False]
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

# However many attempts and whatever the base, one wait never exceeds this.
MAX_RETRY_DELAY_S = 6 * 3600.0
# A worker renews its lease this many times per lease: two renewals may fail before it lapses.
HEARTBEATS_PER_LEASE = 3


def retry_delay_s(attempts: int, *, base_s: float) -> float:
    """The wait before the next attempt once ``attempts`` have failed: base * 2^(attempts-1),
    capped at MAX_RETRY_DELAY_S.

    >>> retry_delay_s(20, base_s=60) == MAX_RETRY_DELAY_S
    True
    """
    if attempts < 1:
        raise ValueError("attempts must be at least 1 once an attempt has failed")
    # The exponent is capped first so a large attempt count never builds a huge float.
    return float(min(MAX_RETRY_DELAY_S, base_s * 2 ** min(attempts - 1, 32)))


def heartbeat_interval_s(lease_s: float) -> float:
    """How often a running attempt renews its lease.

    >>> heartbeat_interval_s(60)
    20.0
    """
    return lease_s / HEARTBEATS_PER_LEASE


def lease_lapsed(lease_expires_at: datetime | None, *, now: datetime) -> bool:
    """True once a running attempt's lease has run out (an attempt without one never had a
    worker that renewed it: it lapsed too)."""
    return lease_expires_at is None or lease_expires_at <= now


@dataclass(frozen=True, slots=True)
class NextStep:
    """What follows a failed or lost attempt: another one (after ``delay_s``), or the end."""

    retry: bool
    delay_s: float = 0.0


def after_failed_attempt(*, attempts: int, max_attempts: int, backoff_base_s: float = 60.0) -> NextStep:
    """Retry while attempts remain (with exponential backoff), else stop."""
    if attempts >= max_attempts:
        return NextStep(retry=False)
    return NextStep(retry=True, delay_s=retry_delay_s(attempts, base_s=backoff_base_s))


# A deployment a guardrail switched to its fallback tries a new drafter at least this often.
MAX_GUARDRAIL_REALIGN_DELAY_S = 24 * 3600.0
# ...and no more often than this, whatever the drift policy's cooldown: it never spins.
MIN_GUARDRAIL_REALIGN_DELAY_S = 60.0


def guardrail_realign_delay_s(losses: int, *, cooldown_s: float) -> float:
    """The wait before the next realignment of a deployment a guardrail switched to its fallback,
    once ``losses`` candidates have lost to that fallback: the cooldown * 2^losses, between the
    floor and a day.

    >>> guardrail_realign_delay_s(0, cooldown_s=600), guardrail_realign_delay_s(2, cooldown_s=600)
    (600.0, 2400.0)
    >>> guardrail_realign_delay_s(40, cooldown_s=600) == MAX_GUARDRAIL_REALIGN_DELAY_S
    True
    """
    base = max(float(cooldown_s), MIN_GUARDRAIL_REALIGN_DELAY_S)
    return float(min(MAX_GUARDRAIL_REALIGN_DELAY_S, base * 2 ** min(max(losses, 0), 32)))


def next_attempt_time(now: datetime, step: NextStep) -> datetime:
    return now + timedelta(seconds=step.delay_s)
