"""Timestamps in UTC: the one place that turns what a database or a client hands back into an aware
UTC ``datetime``.

SQLite returns ``DateTime(timezone=True)`` columns naive (they were written as UTC); PostgreSQL
returns them aware. Clients send ISO 8601 with or without an offset. Everything past this module
compares aware UTC values.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import overload


def utcnow() -> datetime:
    """Now, aware, in UTC."""
    return datetime.now(UTC)


@overload
def as_utc(value: datetime) -> datetime: ...
@overload
def as_utc(value: None) -> None: ...
def as_utc(value: datetime | None) -> datetime | None:
    """``value`` as an aware UTC datetime; a naive value is taken to be UTC already.

    >>> as_utc(datetime(2026, 1, 1, 12)).isoformat()
    '2026-01-01T12:00:00+00:00'
    >>> as_utc(None) is None
    True
    """
    if value is None:
        return None
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def parse_utc(text: str) -> datetime:
    """An ISO 8601 timestamp as an aware UTC datetime (no offset means UTC); ValueError if malformed.

    >>> parse_utc("2026-01-01T12:00:00+02:00").isoformat()
    '2026-01-01T10:00:00+00:00'
    """
    return as_utc(datetime.fromisoformat(text))
