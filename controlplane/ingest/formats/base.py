"""What every acceptance-metrics format shares: the adapter interface, limits, errors, validators.

This module owns ``FormatAdapter`` (what one engine format provides: its name, the engine that
answers in it, its detection markers, the parser of a reply or metrics body into the native
``AcceptanceRecord``, and the request flag that turns the engine's per-request metrics on), the
limits every record obeys (what the database stores), ``Problem`` and the batch errors, the field
validators every adapter uses, and the count identities every record obeys, whatever produced it.
Pure: no I/O, no database, no web framework.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final, NamedTuple

from controlplane.ingest.record import ARM_BASELINE, ARM_CANARY_PREFIX, ARM_LIVE, AcceptanceRecord

MAX_BATCH_RECORDS: Final = 10_000
MAX_REQUEST_ID_CHARS: Final = 200
MAX_CATEGORY_CHARS: Final = 100  # the acceptance_records.category column
# What the database stores, checked before a record joins a shared (group-commit) transaction:
# a value the database refuses would fail every request flushed with it, across accounts.
MAX_COUNT: Final = 2**31 - 1  # INTEGER columns
MAX_K: Final = 64  # draft positions per step (k is a SMALLINT; no engine drafts more)
MAX_LATENCY_MS: Final = 86_400_000.0  # a day: beyond it a sum over many records loses meaning
EARLIEST: Final = datetime(2000, 1, 1, tzinfo=UTC)
LATEST: Final = datetime(2100, 1, 1, tzinfo=UTC)
# A refused batch names its first problems and counts the rest: a reply (and the memory holding
# it) stays small however broken the body, e.g. megabytes of unknown keys.
MAX_REPORTED_PROBLEMS: Final = 20
MAX_KEPT_PROBLEMS: Final = 1000
# Unknown keys listed one by one per object (with a suggestion each), then counted; only keys
# this short get a suggestion (difflib's cost grows with the product of the lengths).
MAX_UNKNOWN_KEYS_LISTED: Final = 5
MAX_SUGGESTED_KEY_CHARS: Final = 64
# A verify step accepts at most k <= MAX_K drafts: an acceptance histogram has at most
# MAX_K + 1 buckets, whatever the object keys ask for.
MAX_HISTOGRAM_BUCKETS: Final = MAX_K + 1


@dataclass(frozen=True, slots=True)
class Problem:
    """One reason a batch was refused: record index (None: the batch itself), field, message."""

    index: int | None
    field: str
    message: str


class BatchValidationError(ValueError):
    """The problems found in a batch (the first MAX_KEPT_PROBLEMS kept, ``total`` counting all);
    nothing in the batch is valid to store (all or nothing)."""

    def __init__(self, problems: Sequence[Problem], total: int | None = None) -> None:
        self.problems: list[Problem] = list(problems)
        self.total = len(self.problems) if total is None else total
        first = self.problems[0] if self.problems else Problem(None, "", "invalid batch")
        where = "batch" if first.index is None else f"record {first.index}"
        more = f" (and {self.total - 1} more problems)" if self.total > 1 else ""
        super().__init__(f"{where}: {first.field or '<body>'}: {first.message}{more}")

    def as_dicts(self) -> list[dict[str, object]]:
        """The first MAX_REPORTED_PROBLEMS problems as JSON-able dicts (e.g. for a 422 body), and
        one more entry counting the rest, if any."""
        shown: list[dict[str, object]] = [
            {"index": p.index, "field": p.field, "message": p.message}
            for p in self.problems[:MAX_REPORTED_PROBLEMS]
        ]
        if self.total > len(shown):
            shown.append(
                {"index": None, "field": "", "message": f"and {self.total - len(shown)} more problems"}
            )
        return shown


class BatchTooLargeError(BatchValidationError):
    """More records than one batch may hold; separate so the API can answer 413."""


# (field, message) pairs collected while one record is parsed; the batch adds the index.
_Errs = list[tuple[str, str]]


class _Missing:
    """Sentinel for an absent key, distinct from an explicit JSON null."""

    def __repr__(self) -> str:
        return "<missing>"


_MISSING: Final = _Missing()
_INF: Final = math.inf
_fromisoformat: Final = datetime.fromisoformat

# Fireworks' request field; the reference server honours it too (and adds its native record).
PERF_METRICS_IN_RESPONSE: Final = "perf_metrics_in_response"
# A format's parser: one record in, its problems appended to the list, None when there are any.
_Parse = Callable[[dict[str, Any], _Errs], "AcceptanceRecord | None"]


@dataclass(frozen=True, slots=True)
class FormatAdapter:
    """One format: how a record in it is recognised and parsed, and how the engine is asked for it.

    ``name`` is the batch's ``format`` value. ``markers`` are top-level keys that mark a record as
    this format's, at least one of them this format's alone; any engine format's marker beside
    ``drafted_tokens`` sends a record through detection instead of the native fast path.
    ``detects`` decides, and may read more than the markers (nested keys, and keys too generic to
    take a record off the native fast path). ``parse`` turns a reply (or its metrics body) into the
    native record. ``request_flag`` is the request-body field that turns the engine's per-request
    metrics on, None where the engine has none (its server is started so, or always reports).
    ``engine`` is what the benchmark client (``controlplane benchmark --engine``) calls the
    servers that answer in this format; ``described_as`` names the shape when nothing matches.
    """

    name: str
    engine: str
    markers: frozenset[str]
    detects: Callable[[dict[str, Any]], bool]
    parse: _Parse
    request_flag: str | None
    described_as: str


# --------------------------------------------------------------------------------------------
# Field validators: each returns the clean value or None after appending one problem.
# --------------------------------------------------------------------------------------------


def _type_name(value: object) -> str:
    if value is None:
        return "null"
    return {bool: "boolean", str: "string", list: "array", dict: "object", float: "number"}.get(
        type(value), type(value).__name__
    )


def _did_you_mean(key: object, allowed: Iterable[str]) -> str:
    text = str(key)
    if len(text) > MAX_SUGGESTED_KEY_CHARS:
        return ""
    close = difflib.get_close_matches(text, list(allowed), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


# Values quoted back in a problem are cut to this many characters: a reply stays small whatever
# was sent (one bad value may be megabytes long).
MAX_ECHO_CHARS: Final = 80


def _echo(value: object) -> str:
    """``repr(value)``, cut to MAX_ECHO_CHARS."""
    if type(value) is str and len(value) > MAX_ECHO_CHARS:
        return repr(value[:MAX_ECHO_CHARS]) + "..."
    text = repr(value)
    return text if len(text) <= MAX_ECHO_CHARS else text[:MAX_ECHO_CHARS] + "..."


def _shown_key(key: object) -> str:
    text = str(key)
    return text if len(text) <= MAX_SUGGESTED_KEY_CHARS else text[:MAX_SUGGESTED_KEY_CHARS] + "..."


def _count(value: object, field: str, errs: _Errs) -> int | None:
    """A required non-negative integer count."""
    if type(value) is int:
        if value >= 0:
            return value
        errs.append((field, f"must be a non-negative integer, got {value}"))
        return None
    return _count_other(value, field, errs)


def _count_other(value: object, field: str, errs: _Errs) -> int | None:
    if value is _MISSING:
        errs.append((field, "required field is missing"))
    elif type(value) is float and value.is_integer() and value >= 0:
        # JSON encoders may write 12.0 for 12; a fractional part is never a valid count.
        return int(value)
    else:
        shown = repr(value) if isinstance(value, int | float) else _type_name(value)
        errs.append((field, f"must be a non-negative integer, got {shown}"))
    return None


def _opt_count(value: object, field: str, errs: _Errs) -> int | None:
    if value is None or value is _MISSING:
        return None
    return _count(value, field, errs)


def _latency_ms(value: object, field: str, errs: _Errs, scale: float = 1.0) -> float | None:
    """An optional finite, non-negative duration; ``scale`` converts the source unit to ms."""
    if value is None or value is _MISSING:
        return None
    if (type(value) is float or type(value) is int) and math.isfinite(value) and value >= 0:
        return float(value) * scale
    shown = repr(value) if isinstance(value, int | float) and type(value) is not bool else _type_name(value)
    errs.append((field, f"must be a finite number >= 0, got {shown}"))
    return None


def _request_id(value: object, field: str, errs: _Errs) -> str | None:
    if type(value) is str and 0 < len(value) <= MAX_REQUEST_ID_CHARS:
        return value
    if value is _MISSING:
        errs.append((field, "required field is missing"))
    elif type(value) is not str:
        errs.append((field, f"must be a string, got {_type_name(value)}"))
    elif not value:
        errs.append((field, "must not be empty"))
    else:
        errs.append((field, f"must be at most {MAX_REQUEST_ID_CHARS} characters, got {len(value)}"))
    return None


def _arm(value: object, field: str, errs: _Errs) -> tuple[str, int | None] | None:
    """The arm and, for ``canary:<n>``, the drafter version n."""
    if value is None or value is _MISSING or value == ARM_LIVE:
        return ARM_LIVE, None
    if value == ARM_BASELINE:
        return ARM_BASELINE, None
    if type(value) is str and value.startswith(ARM_CANARY_PREFIX):
        raw = value[len(ARM_CANARY_PREFIX) :]
        digits = raw.lstrip("0") or raw[:1]
        # At most 10 digits: a drafter version is an INTEGER (checked against MAX_COUNT later).
        if digits.isascii() and digits.isdigit() and len(digits) <= 10:
            version = int(digits)
            return f"{ARM_CANARY_PREFIX}{version}", version
    errs.append((field, f'must be "live", "baseline" or "canary:<drafter version>", got {_echo(value)}'))
    return None


def _category(value: object, field: str, errs: _Errs) -> str | None:
    if value is None or value is _MISSING:
        return None
    if type(value) is str and len(value) <= MAX_CATEGORY_CHARS:
        return value
    if type(value) is str:
        errs.append((field, f"must be at most {MAX_CATEGORY_CHARS} characters"))
    else:
        errs.append((field, f"must be a string or null, got {_type_name(value)}"))
    return None


def _created_at(value: object, field: str, errs: _Errs) -> datetime | None:
    """ISO-8601; a timestamp without offset is taken as UTC (what log emitters overwhelmingly mean)."""
    if value is None or value is _MISSING:
        return None
    if type(value) is str:
        try:
            parsed = datetime.fromisoformat(value)
        except ValueError:
            errs.append((field, f"must be an ISO-8601 timestamp, got {_echo(value)}"))
            return None
        return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)
    if isinstance(value, datetime):  # Python callers, not JSON
        return value if value.tzinfo is not None else value.replace(tzinfo=UTC)
    errs.append((field, f"must be an ISO-8601 string, got {_type_name(value)}"))
    return None


def _epoch_seconds(value: object, field: str, errs: _Errs) -> datetime | None:
    """OpenAI-style ``created`` (Unix seconds) as an aware UTC datetime."""
    if value is None or value is _MISSING:
        return None
    if (type(value) is int or type(value) is float) and math.isfinite(value) and 0 <= value < 1e11:
        return datetime.fromtimestamp(value, tz=UTC)
    errs.append((field, f"must be Unix seconds, got {_echo(value)}"))
    return None


def _counts(value: object, field: str, errs: _Errs) -> list[int] | None:
    """An array of counts; every bad element is reported."""
    if type(value) is not list:
        errs.append((field, f"must be an array of non-negative integers, got {_type_name(value)}"))
        return None
    out: list[int] = []
    ok = True
    for i, item in enumerate(value):
        if type(item) is int and item >= 0:
            out.append(item)
            continue
        clean = _count(item, f"{field}[{i}]", errs)
        if clean is None:
            ok = False
        else:
            out.append(clean)
    return out if ok else None


def _positions(value: object, field: str, errs: _Errs) -> list[int] | None:
    """Per-position accepted counts: an array of counts, non-increasing in position."""
    if value is None or value is _MISSING:
        return []
    counts = _counts(value, field, errs)
    if counts is None:
        return None
    prev = counts[0] if counts else 0
    for i, c in enumerate(counts):
        if c > prev:
            # Accepting position i needs positions 0..i-1 accepted in the same step.
            errs.append((f"{field}[{i}]", f"must not exceed position {i - 1} ({prev}), got {c}"))
            return None
        prev = c
    return counts


def _unknown_keys(rec: dict[str, Any], allowed: frozenset[str], errs: _Errs, prefix: str = "") -> None:
    """The first MAX_UNKNOWN_KEYS_LISTED unknown keys, each a problem, and one more counting the rest."""
    unknown = 0
    for key in rec:
        if key in allowed:
            continue
        unknown += 1
        if unknown <= MAX_UNKNOWN_KEYS_LISTED:
            errs.append((f"{prefix}{_shown_key(key)}", f"unknown field{_did_you_mean(key, allowed)}"))
    if unknown > MAX_UNKNOWN_KEYS_LISTED:
        errs.append((prefix.rstrip("."), f"and {unknown - MAX_UNKNOWN_KEYS_LISTED} more unknown fields"))


# --------------------------------------------------------------------------------------------
# Invariants shared by every format
# --------------------------------------------------------------------------------------------


class _Names(NamedTuple):
    """Input field names to blame for each normalised quantity in a format's messages."""

    drafted: str
    accepted: str
    steps: str
    positions: str


_NATIVE_NAMES: Final = _Names("drafted_tokens", "accepted_tokens", "verify_steps", "accepted_per_position")


def storage_problems(record: AcceptanceRecord) -> list[tuple[str, str]]:
    """(field, message) for every value of ``record`` the database could not store exactly."""
    r = record
    # One chain of comparisons passes the common, storable record (ingest's hot path); the report
    # field by field only runs when it fails. Positions are non-increasing: the first is the largest.
    if (
        r.drafted_tokens <= MAX_COUNT
        and r.accepted_tokens <= MAX_COUNT
        and r.verify_steps <= MAX_COUNT
        and r.generated_tokens <= MAX_COUNT
        and (r.prompt_tokens is None or r.prompt_tokens <= MAX_COUNT)
        and (r.drafter_version is None or r.drafter_version <= MAX_COUNT)
        and (r.k is None or r.k <= MAX_K)
        and len(r.accepted_per_position) <= MAX_K
        and (not r.accepted_per_position or r.accepted_per_position[0] <= MAX_COUNT)
        and (r.ttft_ms is None or r.ttft_ms <= MAX_LATENCY_MS)
        and (r.inter_token_ms is None or r.inter_token_ms <= MAX_LATENCY_MS)
        and (r.total_ms is None or r.total_ms <= MAX_LATENCY_MS)
        and "\x00" not in r.request_id
        and (r.category is None or "\x00" not in r.category)
        and (r.created_at is None or EARLIEST <= r.created_at < LATEST)
    ):
        return []
    errs: _Errs = []
    for name in ("drafted_tokens", "accepted_tokens", "verify_steps", "generated_tokens", "prompt_tokens"):
        value = getattr(record, name)
        if value is not None and value > MAX_COUNT:
            errs.append((name, f"must be at most {MAX_COUNT}, got {value}"))
    if record.drafter_version is not None and record.drafter_version > MAX_COUNT:
        errs.append(("drafter_version", f"must be at most {MAX_COUNT}, got {record.drafter_version}"))
    if record.k is not None and record.k > MAX_K:
        errs.append(("k", f"must be at most {MAX_K}, got {record.k}"))
    if len(record.accepted_per_position) > MAX_K:
        errs.append(
            ("accepted_per_position", f"has {len(record.accepted_per_position)} positions; at most {MAX_K}")
        )
    elif any(c > MAX_COUNT for c in record.accepted_per_position):
        errs.append(("accepted_per_position", f"counts must be at most {MAX_COUNT}"))
    for name in ("ttft_ms", "inter_token_ms", "total_ms"):
        value = getattr(record, name)
        if value is not None and value > MAX_LATENCY_MS:
            errs.append((name, f"must be at most {MAX_LATENCY_MS:.0f} ms (a day), got {value!r}"))
    if "\x00" in record.request_id:
        errs.append(("request_id", "must not contain NUL"))
    if record.category is not None and "\x00" in record.category:
        errs.append(("category", "must not contain NUL"))
    if record.created_at is not None and not EARLIEST <= record.created_at < LATEST:
        errs.append(
            (
                "created_at",
                f"must be between {EARLIEST:%Y-%m-%d} and {LATEST:%Y-%m-%d}, "
                f"got {record.created_at.isoformat()}",
            )
        )
    return errs


def _check_relations(
    drafted: int,
    accepted: int,
    steps: int,
    positions: list[int],
    k: int | None,
    arm: str,
    names: _Names,
    errs: _Errs,
) -> None:
    """Count identities every record obeys, whatever produced it."""
    if accepted > drafted:
        errs.append((names.accepted, f"accepted ({accepted}) exceeds drafted ({drafted})"))
    if steps == 0 and drafted > 0:
        errs.append((names.steps, f"is 0 but {drafted} tokens were drafted; every draft is verified"))
    elif k is not None and drafted > steps * k:
        errs.append((names.drafted, f"({drafted}) exceeds verify steps × k ({steps} × {k})"))
    if positions:
        if positions[0] > steps:
            errs.append(
                (f"{names.positions}[0]", f"({positions[0]}) exceeds the number of verify steps ({steps})")
            )
        total = sum(positions)
        if total != accepted:
            errs.append((names.positions, f"sums to {total} but accepted tokens is {accepted}"))
        if k is not None and len(positions) > k:
            errs.append((names.positions, f"has {len(positions)} positions but k is {k}"))
    if arm == ARM_BASELINE and drafted:
        errs.append(("arm", f"baseline runs without speculation but {drafted} tokens were drafted"))
