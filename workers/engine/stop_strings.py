"""OpenAI `stop` values: what a request may ask for, checked in one place.

Torch-free, so the traffic driver (plain HTTP) can check scenario files with it too.
"""

from __future__ import annotations

MAX_STOP_STRINGS = 4  # OpenAI's limit


def parse_stop(value: object) -> tuple[str, ...]:
    """``None`` -> no stop strings; one non-empty string, or a list of 1 to 4 of them -> a tuple.

    Anything else raises ValueError with a message fit for the caller's user.
    """
    if value is None:
        return ()
    if isinstance(value, str):
        stops: tuple[object, ...] = (value,)
    elif isinstance(value, list | tuple):
        stops = tuple(value)
    else:
        raise ValueError("stop must be a string or a list of strings")
    if not stops:
        raise ValueError("stop takes at least one string (leave it out for none)")
    if len(stops) > MAX_STOP_STRINGS:
        raise ValueError(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(stops)}")
    if not all(isinstance(s, str) and s for s in stops):
        raise ValueError("stop strings must be non-empty strings")
    return tuple(str(s) for s in stops)
