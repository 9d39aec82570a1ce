"""Which arm serves a request: a stable hash of the client's key placed on the arms' weights.

Pure. The hash is the first 8 bytes of sha256(key) read as a number in [0, 1), the same rule the
reference server applies to request ids, so a key lands on the same arm in every router process
and after every restart, and the share of keys per arm converges to its weight. The key is the
request's ``user`` field when it has one, else a header the operator names (a session or
conversation id), else the request id: a conversation stays on one arm while the split holds.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, TypeVar


class Weighted(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def weight(self) -> float: ...


def unit_hash(key: str) -> float:
    """A number in [0, 1) fixed by ``key``.

    >>> unit_hash("user-1") == unit_hash("user-1")
    True
    >>> 0.0 <= unit_hash("anything") < 1.0
    True
    """
    digest = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


A = TypeVar("A", bound=Weighted)


def pick_arm(arms: Sequence[A], key: str) -> A:
    """The arm whose slice of the cumulative weights holds ``key``'s hash (weights need not sum
    to 1; arms of weight 0 are never picked). ``arms`` must hold one arm of positive weight."""
    total = sum(max(a.weight, 0.0) for a in arms)
    if total <= 0.0:
        raise ValueError("no arm has a positive weight")
    point = unit_hash(key) * total
    cumulative = 0.0
    for arm in arms:
        if arm.weight <= 0.0:
            continue
        cumulative += arm.weight
        if point < cumulative:
            return arm
    return next(a for a in reversed(arms) if a.weight > 0.0)  # rounding at the top end


def client_key(
    body: Mapping[str, Any], headers: Mapping[str, str], header: str | None, request_id: str
) -> str:
    """The key a request's arm is hashed from: ``user``, else the operator's header, else the
    request id (each namespaced, so a user called like a request id cannot collide with it)."""
    user = body.get("user")
    if isinstance(user, str) and user:
        return f"user:{user}"
    if header:
        value = headers.get(header)
        if value:
            return f"header:{value}"
    return f"request:{request_id}"
