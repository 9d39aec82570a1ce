"""A lifecycle's transition table, pure: which state may follow which. Each lifecycle (jobs, drafter
versions, drift events, canaries) declares its table once with this class, in its own
``states.py`` or ``phases.py``, and every service moves its rows through it."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Generic, TypeVar

S = TypeVar("S", bound=enum.StrEnum)


class IllegalTransitionError(ValueError):
    """A state change a lifecycle's table does not allow."""

    def __init__(self, lifecycle: str, current: enum.StrEnum, new: enum.StrEnum) -> None:
        super().__init__(f"a {current.value} {lifecycle} cannot become {new.value}")
        self.current = current
        self.new = new


class Lifecycle(Generic[S]):
    """The states of one kind of row and the moves between them.

    >>> class Light(enum.StrEnum):
    ...     red = "red"
    ...     green = "green"
    >>> light = Lifecycle("light", {Light.red: {Light.green}, Light.green: set()})
    >>> light.move(Light.red, Light.green).value
    'green'
    >>> light.move(Light.green, Light.red)
    Traceback (most recent call last):
    ...
    controlplane.lifecycle.IllegalTransitionError: a green light cannot become red
    """

    def __init__(self, name: str, allowed: Mapping[S, set[S] | frozenset[S]]) -> None:
        self.name = name
        self.allowed: dict[S, frozenset[S]] = {state: frozenset(nexts) for state, nexts in allowed.items()}
        self.final = frozenset(state for state, nexts in self.allowed.items() if not nexts)

    def can_move(self, current: S, new: S) -> bool:
        return new in self.allowed[current]

    def move(self, current: S, new: S) -> S:
        """``new`` if the table allows ``current -> new``; IllegalTransitionError otherwise."""
        if not self.can_move(current, new):
            raise IllegalTransitionError(self.name, current, new)
        return new
