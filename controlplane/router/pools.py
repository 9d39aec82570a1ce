"""Backend pools: which backends may serve an arm, in which order, and which are out for a while.

Pure (no I/O; the clock is passed in). An arm maps to a pool: ``live`` to the incumbent pool,
``canary:<n>`` to the candidate pool, ``baseline`` to the baseline pool; a backend labelled with the
arm's own drafter version serves it first whatever its pool (after a promotion the candidate pool
already serves the new live drafter while the incumbent pool is rolled), and ``follower`` backends
(servers that follow serving-config themselves) serve any arm. Within a pool the backend with the
fewest requests in flight goes first.

A request that cannot be served by its arm's backends (refused, timed out, 5xx before the first
byte) goes to the baseline arm's backends next, then to the live arm's, so a client never sees an
error that a healthy backend could have served; the record is filed under the arm that served.

Circuit breaker per backend: ``failures`` consecutive failures open it for ``cooldown_s``; then one
trial request is let through (half-open), and a success closes it again. While every backend of a
request's candidates is open, the open ones are still tried in order, so an outage of all of them
reaches the client as the backends' own error rather than as a refusal from the router.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from controlplane.ingest.record import ARM_BASELINE, ARM_CANARY_PREFIX, ARM_LIVE

POOL_OF_ARM = {ARM_LIVE: "incumbent", ARM_BASELINE: "baseline"}


def pool_of_arm(arm: str) -> str:
    return "candidate" if arm.startswith(ARM_CANARY_PREFIX) else POOL_OF_ARM.get(arm, "incumbent")


@dataclass
class BackendState:
    name: str
    pool: str
    url: str
    drafter_version: int | None
    in_flight: int = 0
    consecutive_failures: int = 0
    open_until: float = 0.0
    trial_in_flight: bool = False
    served: int = 0
    failed: int = 0

    def available(self, now: float) -> bool:
        """Closed, or half-open with no trial request out yet."""
        if self.open_until <= 0.0:
            return True
        return now >= self.open_until and not self.trial_in_flight


class CircuitBreakers:
    """Failure bookkeeping for backends; ``failures`` in a row open one for ``cooldown_s``."""

    def __init__(self, failures: int, cooldown_s: float) -> None:
        self.failures = failures
        self.cooldown_s = cooldown_s

    def started(self, backend: BackendState, now: float) -> None:
        backend.in_flight += 1
        if backend.open_until > 0.0 and now >= backend.open_until:
            backend.trial_in_flight = True

    def succeeded(self, backend: BackendState) -> None:
        backend.in_flight -= 1
        backend.served += 1
        backend.consecutive_failures = 0
        backend.open_until = 0.0
        backend.trial_in_flight = False

    def failed(self, backend: BackendState, now: float) -> None:
        backend.in_flight -= 1
        backend.failed += 1
        backend.consecutive_failures += 1
        if backend.trial_in_flight or backend.consecutive_failures >= self.failures:
            backend.open_until = now + self.cooldown_s
        backend.trial_in_flight = False

    def released(self, backend: BackendState) -> None:
        """The request ended for a reason that says nothing about the backend (client went away)."""
        backend.in_flight -= 1
        backend.trial_in_flight = False


@dataclass(frozen=True, slots=True)
class Attempt:
    """One backend to try, and the arm a reply from it is filed under."""

    backend: BackendState
    arm: str


class Pools:
    """A deployment's backends by name; rebuilt in place when the declared set changes, keeping
    the in-flight and breaker state of backends that stay."""

    def __init__(self) -> None:
        self._backends: dict[str, BackendState] = {}

    @property
    def backends(self) -> list[BackendState]:
        return list(self._backends.values())

    def update(self, declared: Iterable[tuple[str, str, str, int | None]]) -> None:
        """Set the backends to ``declared`` (name, pool, url, drafter_version)."""
        fresh: dict[str, BackendState] = {}
        for name, pool, url, version in declared:
            old = self._backends.get(name)
            if old is not None and (old.pool, old.url, old.drafter_version) == (pool, url, version):
                fresh[name] = old
            else:
                fresh[name] = BackendState(name, pool, url, version)
        self._backends = fresh

    def attempts(
        self, arm: str, arm_version: int | None, arms: Sequence[tuple[str, int | None]], now: float
    ) -> list[Attempt]:
        """Backends to try for a request assigned ``arm`` (serving ``arm_version``), in order:
        the arm's own backends, then the baseline arm's, then the live arm's. ``arms`` lists the
        serving config's (arm, drafter version) pairs, so fallbacks are filed correctly."""
        order: list[tuple[str, int | None]] = [(arm, arm_version)]
        versions = dict(arms)
        for fallback in (ARM_BASELINE, ARM_LIVE):
            if fallback != arm:
                order.append((fallback, versions.get(fallback)))
        seen: set[str] = set()
        ready: list[Attempt] = []
        resting: list[Attempt] = []
        for name, version in order:
            for backend in self._serving(name, version):
                if backend.name in seen:
                    continue
                seen.add(backend.name)
                (ready if backend.available(now) else resting).append(Attempt(backend, name))
        # Within a group, fewest in flight first, then fewest served (so equals take turns); the
        # backends whose breaker is open come after every available one, soonest to reopen first.
        group = {name: i for i, (name, _) in enumerate(order)}
        ready.sort(key=lambda a: (group[a.arm], a.backend.in_flight, a.backend.served))
        resting.sort(key=lambda a: a.backend.open_until)
        return ready + resting

    def _serving(self, arm: str, version: int | None) -> list[BackendState]:
        pool = pool_of_arm(arm)
        if arm == ARM_BASELINE:
            # No speculation: only the baseline pool (or a follower told so) serves it truthfully.
            labelled: list[BackendState] = []
        else:
            labelled = [
                b
                for b in self._backends.values()
                if version is not None and b.drafter_version == version and b.pool != "baseline"
            ]
        pooled = [b for b in self._backends.values() if b.pool == pool]
        followers = [b for b in self._backends.values() if b.pool == "follower"]
        return labelled or pooled or followers
