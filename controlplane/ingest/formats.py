"""Acceptance-metrics formats users already emit, normalised into one ``AcceptanceRecord``.

This module owns the batch body of ``POST .../acceptance`` (``parse_batch``), one adapter per
format (native, Fireworks ``perf_metrics``, vLLM ``metrics.speculative_decoding``, SGLang
``meta_info``, TensorRT-LLM ``speculative_decoding``), per-record format detection, and
``BatchValidationError``. It is pure: no I/O, no database, no web framework; the API wires it.

Shape borrowed from NVIDIA AIPerf (an engine-neutral per-request acceptance record filled by one
adapter per engine, histogram-based so adaptive k fits), with two differences: a malformed record
is reported to the caller (index, field, message) instead of being dropped, and the record keeps
per-position accepted counts, which every histogram determines exactly.

Exact vs estimated, per format (each adapter's docstring has the details):

* native: exactly what the caller sent, validated, including the optional counterfactual
  ``draft_stop_counts`` (``draft_stop_counts()`` checks them against the record's own counts).
* vllm / trtllm: counts exact; ``accepted_per_position[i]`` = steps that accepted >= i+1 draft
  tokens, exact from the histogram. ``generated_tokens`` exact from ``usage.completion_tokens``,
  else the lower bound ``accepted + steps``.
* sglang: counts exact; per-position exact from the histogram or ``*_by_position``; ``k`` exact
  from ``*_by_position``, else ``drafted / steps`` (SGLang's own definition of drafted).
* fireworks: exact with ``"i:hits/total"`` acceptance pairs (what Fireworks' own benchmark
  parses); estimated (rounded) when only per-position rates are given.
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
FORMATS: Final = ("native", "fireworks", "vllm", "sglang", "trtllm")
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
BATCH_FORMATS: Final = ("auto", *FORMATS)

NATIVE_FIELDS: Final = (
    "request_id",
    "drafted_tokens",
    "accepted_tokens",
    "verify_steps",
    "generated_tokens",
    "accepted_per_position",
    "k",
    "prompt_tokens",
    "ttft_ms",
    "inter_token_ms",
    "total_ms",
    "arm",
    "drafter_version",
    "category",
    "created_at",
    # Content like the counts above: a retry under the same request id must repeat it (409 else).
    "draft_stop_counts",
    # A sample of traffic also counted in an edge aggregate (controlplane.ingest.aggregates).
    "counted_in_aggregate",
)
_NATIVE_KEYS: Final = frozenset(NATIVE_FIELDS)
_BATCH_KEYS: Final = frozenset({"format", "records"})
# draft_stop_counts: its keys, and at most this many thresholds (a grid, not a histogram).
DRAFT_STOP_KEYS: Final = ("thresholds", "rounds", "drafted", "accepted")
_DRAFT_STOP_KEYS: Final = frozenset(DRAFT_STOP_KEYS)
MAX_DRAFT_STOP_THRESHOLDS: Final = 64


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
_Adapter = Callable[[dict[str, Any], _Errs], "AcceptanceRecord | None"]


class _Missing:
    """Sentinel for an absent key, distinct from an explicit JSON null."""

    def __repr__(self) -> str:
        return "<missing>"


_MISSING: Final = _Missing()
_INF: Final = math.inf
_fromisoformat: Final = datetime.fromisoformat


# --------------------------------------------------------------------------------------------
# Batch entry points
# --------------------------------------------------------------------------------------------


def parse_batch(payload: object) -> list[AcceptanceRecord]:
    """Parse ``{"format": ..., "records": [...]}`` into records, or raise with every problem."""
    if not isinstance(payload, dict):
        raise BatchValidationError([Problem(None, "", 'body must be a JSON object {"records": [...]}')])
    unknown: _Errs = []
    _unknown_keys(payload, _BATCH_KEYS, unknown)
    problems: list[Problem] = [Problem(None, f, m) for f, m in unknown]
    fmt = payload.get("format", "auto")
    if fmt is None:
        fmt = "auto"
    if fmt not in BATCH_FORMATS:
        problems.append(
            Problem(None, "format", f"must be one of {', '.join(BATCH_FORMATS)}; got {_echo(fmt)}")
        )
    records = payload.get("records", _MISSING)
    if records is _MISSING:
        problems.append(Problem(None, "records", "required field is missing"))
    elif not isinstance(records, list):
        problems.append(Problem(None, "records", f"must be a JSON array, got {_type_name(records)}"))
    elif len(records) > MAX_BATCH_RECORDS:
        raise BatchTooLargeError(
            [
                Problem(
                    None,
                    "records",
                    f"{len(records)} records exceed the limit of {MAX_BATCH_RECORDS} per batch; "
                    "split the batch",
                )
            ]
        )
    if problems:
        raise BatchValidationError(problems)
    assert isinstance(records, list)
    return _parse_records(records, str(fmt), problems)


def parse_record(record: object, fmt: str = "auto") -> AcceptanceRecord:
    """Parse one record of the given format; its problems carry ``index=0``."""
    if fmt not in BATCH_FORMATS:
        raise BatchValidationError([Problem(None, "format", f"must be one of {', '.join(BATCH_FORMATS)}")])
    problems: list[Problem] = []
    out = _parse_records([record], fmt, problems)
    if problems:  # pragma: no cover - _parse_records raises when there are problems
        raise BatchValidationError(problems)
    return out[0]


def detect_format(record: object) -> str:
    """The one format a record's keys identify; ``ValueError`` names candidates when not one."""
    if not isinstance(record, dict):
        raise ValueError("record must be a JSON object")
    candidates = _candidates(record)
    if len(candidates) != 1:
        raise ValueError(_detect_message(candidates))
    return candidates[0]


def record_problems(record: AcceptanceRecord) -> list[tuple[str, str]]:
    """(field, message) for every count identity an already-built record breaks, and every value
    the database could not store; empty if none.

    For records made outside ``parse_batch`` (e.g. Prometheus deltas), so they obey the same rules.
    """
    errs: _Errs = []
    positions = _positions(record.accepted_per_position, "accepted_per_position", errs)
    _check_relations(
        record.drafted_tokens,
        record.accepted_tokens,
        record.verify_steps,
        positions or [],
        record.k,
        record.arm,
        _NATIVE_NAMES,
        errs,
    )
    return errs + storage_problems(record)


def _parse_records(records: list[Any], fmt: str, problems: list[Problem]) -> list[AcceptanceRecord]:
    out: list[AcceptanceRecord] = []
    seen: dict[str, int] = {}
    errs: _Errs = []
    fixed = None if fmt == "auto" else _ADAPTERS[fmt]
    dropped = 0
    for index, rec in enumerate(records):
        if len(problems) > MAX_KEPT_PROBLEMS:
            # Enough to show: count the rest instead of keeping them.
            dropped += len(problems) - MAX_KEPT_PROBLEMS
            del problems[MAX_KEPT_PROBLEMS:]
        if type(rec) is not dict:
            problems.append(Problem(index, "", f"record must be a JSON object, got {_type_name(rec)}"))
            continue
        adapter = fixed if fixed is not None else _auto_adapter(rec, errs)
        try:
            parsed = adapter(rec, errs) if adapter is not None else None
        except Exception as exc:  # noqa: BLE001 - one odd record must become a 422, never a 500
            errs.append(("", f"could not parse record: {type(exc).__name__}: {exc}"))
            parsed = None
        if errs:
            problems.extend([Problem(index, f, m) for f, m in errs])
            errs.clear()
            continue
        assert parsed is not None
        first = seen.setdefault(parsed.request_id, index)
        if first != index:
            problems.append(
                Problem(index, "request_id", f"duplicate request_id {parsed.request_id!r} (first at {first})")
            )
            continue
        out.append(parsed)
    if problems:
        raise BatchValidationError(problems[:MAX_KEPT_PROBLEMS], dropped + len(problems))
    return out


# --------------------------------------------------------------------------------------------
# Auto-detection
# --------------------------------------------------------------------------------------------

# Keys whose presence at the top of a record means "not a plain native record".
_ENGINE_MARKERS: Final = frozenset(
    {
        "perf_metrics",
        "metrics",
        "meta_info",
        "choices",
        "speculative_decoding",
        "num_accepted_draft_tokens",
        "total_accepted_draft_tokens",
        "spec_verify_ct",
        "speculation-acceptance",
        "speculation-generated-tokens",
        "fireworks-speculation-acceptance",
    }
)
# Any one of these names a native record, so a native record missing a field still parses as native
# and gets a "required field is missing" problem rather than "cannot detect the format".
_NATIVE_MARKERS: Final = frozenset(
    {"drafted_tokens", "accepted_tokens", "verify_steps", "accepted_per_position"}
)
_FIREWORKS_BARE_KEYS: Final = frozenset(
    {
        "speculation-acceptance",
        "speculation-generated-tokens",
        "fireworks-speculation-acceptance",
        "fireworks-speculation-generated-tokens",
        "server-time-to-first-token",
        "server-processing-time",
    }
)


def _auto_adapter(rec: dict[str, Any], errs: _Errs) -> _Adapter | None:
    # Native is the hot path: two cheap checks before any engine probing.
    if "drafted_tokens" in rec and _ENGINE_MARKERS.isdisjoint(rec):
        return _from_native
    candidates = _candidates(rec)
    if len(candidates) == 1:
        return _ADAPTERS[candidates[0]]
    errs.append(("", _detect_message(candidates)))
    return None


def _detect_message(candidates: list[str]) -> str:
    if not candidates:
        return (
            "cannot detect the format from this record's keys (expected native drafted_tokens, Fireworks "
            "perf_metrics, vLLM metrics.speculative_decoding, SGLang meta_info or TensorRT-LLM "
            'speculative_decoding); set "format" on the batch'
        )
    return f'ambiguous record: it matches {", ".join(candidates)}; set "format" on the batch'


def _candidates(rec: dict[str, Any]) -> list[str]:
    found: list[str] = []
    if not _NATIVE_MARKERS.isdisjoint(rec):
        found.append("native")
    if "perf_metrics" in rec or not _FIREWORKS_BARE_KEYS.isdisjoint(rec):
        found.append("fireworks")
    choice = _first_choice(rec)
    sd = rec.get("speculative_decoding")
    if (
        "metrics" in rec
        or "num_accepted_draft_tokens" in rec
        or (isinstance(sd, dict) and "num_accepted_draft_tokens" in sd)
        or (choice is not None and "speculative_decoding_stats" in choice)
        or (
            choice is not None
            and isinstance(choice.get("speculative_decoding"), dict)
            and "num_accepted_draft_tokens" in choice["speculative_decoding"]
        )
    ):
        found.append("vllm")
    if (
        "total_accepted_draft_tokens" in rec
        or (isinstance(sd, dict) and "total_accepted_draft_tokens" in sd)
        or (
            choice is not None
            and isinstance(choice.get("speculative_decoding"), dict)
            and "total_accepted_draft_tokens" in choice["speculative_decoding"]
        )
    ):
        found.append("trtllm")
    if "meta_info" in rec or "spec_verify_ct" in rec or (choice is not None and "meta_info" in choice):
        found.append("sglang")
    return found


def _first_choice(rec: dict[str, Any]) -> dict[str, Any] | None:
    choices = rec.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        return choices[0]
    return None


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


# --------------------------------------------------------------------------------------------
# native
# --------------------------------------------------------------------------------------------


def _from_native(rec: dict[str, Any], errs: _Errs) -> AcceptanceRecord | None:
    """Keys exactly those of ``AcceptanceRecord``; everything validated, nothing derived.

    The hot path (hundreds of thousands of records a second): plain dict reads and ``type() is``
    checks; the slower helpers only run for values that are not already clean.
    """
    if not _NATIVE_KEYS.issuperset(rec):
        _unknown_keys(rec, _NATIVE_KEYS, errs)
    get = rec.get
    request_id = get("request_id", _MISSING)
    if type(request_id) is not str or not 0 < len(request_id) <= MAX_REQUEST_ID_CHARS:
        request_id = _request_id(request_id, "request_id", errs)
    drafted = get("drafted_tokens", _MISSING)
    if type(drafted) is not int or drafted < 0:
        drafted = _count(drafted, "drafted_tokens", errs)
    accepted = get("accepted_tokens", _MISSING)
    if type(accepted) is not int or accepted < 0:
        accepted = _count(accepted, "accepted_tokens", errs)
    steps = get("verify_steps", _MISSING)
    if type(steps) is not int or steps < 0:
        steps = _count(steps, "verify_steps", errs)
    generated = get("generated_tokens", _MISSING)
    if type(generated) is not int or generated < 0:
        generated = _count(generated, "generated_tokens", errs)
    positions = get("accepted_per_position")
    if type(positions) is list:
        prev = positions[0] if positions else 0
        for c in positions:
            if type(c) is not int or c < 0 or c > prev:
                positions = _positions(positions, "accepted_per_position", errs)
                break
            prev = c
    else:
        positions = _positions(positions, "accepted_per_position", errs)
    k = get("k")
    if k is not None and (type(k) is not int or k < 0):
        k = _count(k, "k", errs)
    prompt = get("prompt_tokens")
    if prompt is not None and (type(prompt) is not int or prompt < 0):
        prompt = _count(prompt, "prompt_tokens", errs)
    # `0.0 <= x < inf` is False for NaN and infinities: the common float passes one comparison.
    ttft = get("ttft_ms")
    if ttft is not None and (type(ttft) is not float or not 0.0 <= ttft < _INF):
        ttft = _latency_ms(ttft, "ttft_ms", errs)
    itl = get("inter_token_ms")
    if itl is not None and (type(itl) is not float or not 0.0 <= itl < _INF):
        itl = _latency_ms(itl, "inter_token_ms", errs)
    total = get("total_ms")
    if total is not None and (type(total) is not float or not 0.0 <= total < _INF):
        total = _latency_ms(total, "total_ms", errs)
    arm_value = get("arm")
    arm_version: int | None = None
    if arm_value is None or arm_value == ARM_LIVE:
        arm: str | None = ARM_LIVE
    else:
        parsed_arm = _arm(arm_value, "arm", errs)
        arm, arm_version = parsed_arm if parsed_arm is not None else (None, None)
    drafter_version = get("drafter_version")
    if drafter_version is not None and (type(drafter_version) is not int or drafter_version < 0):
        drafter_version = _count(drafter_version, "drafter_version", errs)
    category = get("category")
    if category is not None and (type(category) is not str or len(category) > MAX_CATEGORY_CHARS):
        category = _category(category, "category", errs)
    created_at = get("created_at")
    if created_at is not None:
        if type(created_at) is str:
            try:
                created_at = _fromisoformat(created_at)
            except ValueError:
                created_at = _created_at(created_at, "created_at", errs)
            else:
                if created_at.tzinfo is None:
                    created_at = created_at.replace(tzinfo=UTC)
        else:
            created_at = _created_at(created_at, "created_at", errs)

    if drafted is not None and accepted is not None and steps is not None and positions is not None:
        # One short-circuit test of every identity; _check_relations then names what broke.
        if (
            accepted > drafted
            or (drafted and not steps)
            or (k is not None and drafted > steps * k)
            or (
                positions
                and (
                    positions[0] > steps
                    or sum(positions) != accepted
                    or (k is not None and len(positions) > k)
                )
            )
            or (drafted and arm == ARM_BASELINE)
        ):
            _check_relations(drafted, accepted, steps, positions, k, arm or ARM_LIVE, _NATIVE_NAMES, errs)
    if arm_version is not None:
        if drafter_version is None:
            drafter_version = arm_version  # canary:<n> is served by drafter version n by definition
        elif drafter_version != arm_version:
            errs.append(("drafter_version", f"is {drafter_version} but arm is canary:{arm_version}"))
    stop_counts = get("draft_stop_counts")
    if stop_counts is not None:
        stop_counts = draft_stop_counts(stop_counts, drafted, accepted, steps, k, errs)
    in_aggregate = get("counted_in_aggregate")
    if in_aggregate is not None and not isinstance(in_aggregate, bool):
        errs.append(("counted_in_aggregate", "must be true or false"))
    if errs or positions is None or arm is None:
        return None
    record = AcceptanceRecord(
        request_id,
        drafted,
        accepted,
        steps,
        generated,
        positions,
        k,
        prompt,
        ttft,
        itl,
        total,
        arm,
        drafter_version,
        category,
        created_at,
        stop_counts,
        counted_in_aggregate=bool(in_aggregate),
    )
    errs.extend(storage_problems(record))
    return None if errs else record


def draft_stop_counts(
    value: object,
    drafted_tokens: int | None,
    accepted_tokens: int | None,
    verify_steps: int | None,
    k: int | None,
    errs: _Errs,
) -> dict[str, Any] | None:
    """A record's counterfactual draft-stop counts (workers.engine.metrics ``DraftStopCounts``),
    checked against the record's own counts, as a clean dict; None after appending problems.

    Per threshold t (strictly increasing, in (0, 1)): over ``rounds`` drafting rounds, the tokens
    a round stopping at its first draft below t would have drafted and had accepted. So
    ``rounds <= drafted[i] <= rounds * k`` (every round drafts its first token), ``accepted[i] <=
    drafted[i]``, both non-increasing in t (stopping earlier never drafts or keeps more), and
    never above the record's own drafted / accepted tokens (a threshold at or above the one the
    request ran with stops no later than it did).
    """
    name = "draft_stop_counts"
    if type(value) is not dict:
        errs.append(
            (name, f"must be an object {{{', '.join(DRAFT_STOP_KEYS)}}} or null, got {_type_name(value)}")
        )
        return None
    before = len(errs)
    _unknown_keys(value, _DRAFT_STOP_KEYS, errs, prefix=f"{name}.")
    thresholds = value.get("thresholds", _MISSING)
    clean_thresholds: list[float] = []
    if type(thresholds) is not list or not thresholds:
        shown = "missing" if thresholds is _MISSING else _type_name(thresholds)
        errs.append((f"{name}.thresholds", f"must be a non-empty array of probabilities, got {shown}"))
    elif len(thresholds) > MAX_DRAFT_STOP_THRESHOLDS:
        errs.append(
            (f"{name}.thresholds", f"has {len(thresholds)} entries; at most {MAX_DRAFT_STOP_THRESHOLDS}")
        )
    else:
        for i, t in enumerate(thresholds):
            if type(t) not in (int, float) or not 0.0 < t < 1.0:
                errs.append((f"{name}.thresholds[{i}]", f"must be a number in (0, 1), got {_echo(t)}"))
                break
            if clean_thresholds and t <= clean_thresholds[-1]:
                errs.append(
                    (
                        f"{name}.thresholds[{i}]",
                        f"must exceed the previous threshold ({clean_thresholds[-1]}), got {t}",
                    )
                )
                break
            clean_thresholds.append(float(t))
    rounds = _count(value.get("rounds", _MISSING), f"{name}.rounds", errs)
    drafted = _count_array(value, "drafted", errs)
    accepted = _count_array(value, "accepted", errs)
    if len(errs) > before:
        return None
    assert rounds is not None and drafted is not None and accepted is not None
    for field_name, counts in (("drafted", drafted), ("accepted", accepted)):
        if len(counts) != len(clean_thresholds):
            errs.append(
                (
                    f"{name}.{field_name}",
                    f"has {len(counts)} entries but thresholds has {len(clean_thresholds)}",
                )
            )
    if len(errs) > before:
        return None
    if verify_steps is not None and rounds > verify_steps:
        errs.append((f"{name}.rounds", f"({rounds}) exceeds verify_steps ({verify_steps})"))
    for i, (d, a) in enumerate(zip(drafted, accepted, strict=True)):
        where = f"{name}.drafted[{i}]"
        if d < rounds:
            errs.append((where, f"({d}) is below rounds ({rounds}): every round drafts its first token"))
        elif k is not None and d > rounds * k:
            errs.append((where, f"({d}) exceeds rounds × k ({rounds} × {k})"))
        elif drafted_tokens is not None and d > drafted_tokens:
            errs.append((where, f"({d}) exceeds drafted_tokens ({drafted_tokens})"))
        elif i and d > drafted[i - 1]:
            errs.append((where, f"({d}) exceeds the count at the lower threshold ({drafted[i - 1]})"))
        where = f"{name}.accepted[{i}]"
        if a > d:
            errs.append((where, f"({a}) exceeds drafted[{i}] ({d})"))
        elif accepted_tokens is not None and a > accepted_tokens:
            errs.append((where, f"({a}) exceeds accepted_tokens ({accepted_tokens})"))
        elif i and a > accepted[i - 1]:
            errs.append((where, f"({a}) exceeds the count at the lower threshold ({accepted[i - 1]})"))
        if len(errs) > before:
            return None
    if max(rounds, *drafted) > MAX_COUNT:
        errs.append((name, f"counts must be at most {MAX_COUNT}"))
        return None
    return {"thresholds": clean_thresholds, "rounds": rounds, "drafted": drafted, "accepted": accepted}


def _count_array(value: dict[str, Any], key: str, errs: _Errs) -> list[int] | None:
    """``draft_stop_counts[key]``: a required array of counts."""
    if key not in value:
        errs.append((f"draft_stop_counts.{key}", "required field is missing"))
        return None
    return _counts(value[key], f"draft_stop_counts.{key}", errs)


# --------------------------------------------------------------------------------------------
# Engine formats: shared envelope and record assembly
# --------------------------------------------------------------------------------------------

# Keys an engine-format record may carry next to the engine's own payload. Other top-level keys
# are allowed there, because the record is often the engine's whole response object.
ENVELOPE_FIELDS: Final = (
    "request_id",
    "arm",
    "drafter_version",
    "category",
    "created_at",
    "generated_tokens",
)


class _Envelope(NamedTuple):
    request_id: str
    arm: str
    drafter_version: int | None
    category: str | None
    created_at: datetime | None
    generated_tokens: int | None  # a caller-supplied override, e.g. from its own tokenizer


def _envelope(rec: dict[str, Any], errs: _Errs, fallback_id: object = _MISSING) -> _Envelope | None:
    """Caller metadata, falling back to the response's own ``id`` and ``created``."""
    before = len(errs)
    if "request_id" in rec:
        request_id = _request_id(rec["request_id"], "request_id", errs)
    elif "id" in rec:
        request_id = _request_id(rec["id"], "id", errs)
    elif fallback_id is not _MISSING:
        request_id = _request_id(fallback_id, "meta_info.id", errs)
    else:
        request_id = _request_id(_MISSING, "request_id", errs)
    parsed_arm = _arm(rec.get("arm"), "arm", errs)
    drafter_version = _opt_count(rec.get("drafter_version"), "drafter_version", errs)
    category = _category(rec.get("category"), "category", errs)
    if rec.get("created_at") is not None:
        created_at = _created_at(rec["created_at"], "created_at", errs)
    else:
        created_at = _epoch_seconds(rec.get("created"), "created", errs)
    generated = _opt_count(rec.get("generated_tokens"), "generated_tokens", errs)
    if parsed_arm is not None and parsed_arm[1] is not None:
        if drafter_version is None:
            drafter_version = parsed_arm[1]
        elif drafter_version != parsed_arm[1]:
            errs.append(("drafter_version", f"is {drafter_version} but arm is canary:{parsed_arm[1]}"))
    if len(errs) > before or request_id is None or parsed_arm is None:
        return None
    return _Envelope(request_id, parsed_arm[0], drafter_version, category, created_at, generated)


def _build(
    env: _Envelope | None,
    errs: _Errs,
    names: _Names,
    *,
    drafted: int | None,
    accepted: int | None,
    steps: int | None,
    generated: int | None,
    positions: list[int],
    k: int | None,
    prompt_tokens: int | None = None,
    ttft_ms: float | None = None,
    inter_token_ms: float | None = None,
    total_ms: float | None = None,
) -> AcceptanceRecord | None:
    if drafted is None or accepted is None or steps is None:
        return None
    # Checked even when the envelope failed, so one round trip reports every problem.
    _check_relations(drafted, accepted, steps, positions, k, env.arm if env else ARM_LIVE, names, errs)
    if env is None:
        return None
    if env.generated_tokens is not None:
        generated = env.generated_tokens
    if generated is None:
        # Each verify step emits its accepted drafts plus one target token: a lower bound on the
        # completion length (it misses the prefill token and non-speculative steps).
        generated = accepted + steps
    if errs:
        return None
    record = AcceptanceRecord(
        env.request_id,
        drafted,
        accepted,
        steps,
        generated,
        positions,
        k,
        prompt_tokens,
        ttft_ms,
        inter_token_ms,
        total_ms,
        env.arm,
        env.drafter_version,
        env.category,
        env.created_at,
    )
    errs.extend(storage_problems(record))
    return None if errs else record


def _baseline(
    env: _Envelope | None,
    errs: _Errs,
    *,
    generated: int | None,
    prompt_tokens: int | None,
    ttft_ms: float | None = None,
    inter_token_ms: float | None = None,
    total_ms: float | None = None,
) -> AcceptanceRecord | None:
    """A no-speculation record: the engine sent no acceptance block because nothing was drafted."""
    return _build(
        env,
        errs,
        _NATIVE_NAMES,
        drafted=0,
        accepted=0,
        steps=0,
        generated=generated,
        positions=[],
        k=None,
        prompt_tokens=prompt_tokens,
        ttft_ms=ttft_ms,
        inter_token_ms=inter_token_ms,
        total_ms=total_ms,
    )


def _obj(value: object, field: str, errs: _Errs) -> dict[str, Any] | None:
    if isinstance(value, dict):
        return value
    errs.append((field, f"must be a JSON object, got {_type_name(value)}"))
    return None


def _usage(rec: dict[str, Any], errs: _Errs) -> tuple[int | None, int | None]:
    """(prompt_tokens, completion_tokens) from an OpenAI-style ``usage`` object, if present."""
    usage = rec.get("usage")
    if usage is None:
        return None, None
    if not isinstance(usage, dict):
        errs.append(("usage", f"must be a JSON object, got {_type_name(usage)}"))
        return None, None
    prompt = _opt_count(usage.get("prompt_tokens"), "usage.prompt_tokens", errs)
    completion = _opt_count(usage.get("completion_tokens"), "usage.completion_tokens", errs)
    return prompt, completion


def _single_choice(rec: dict[str, Any], errs: _Errs) -> dict[str, Any] | None:
    choices = rec.get("choices")
    if not isinstance(choices, list) or not choices:
        errs.append(("choices", "must be a non-empty array"))
        return None
    if len(choices) > 1:
        errs.append(("choices", f"has {len(choices)} choices; acceptance is per sequence, send n == 1"))
        return None
    return _obj(choices[0], "choices[0]", errs)


def _histogram(value: object, field: str, errs: _Errs) -> list[int] | None:
    """A dense histogram (index j = verify steps that accepted exactly j drafts).

    Accepts the dense array engines send now and the ``{"j": count}`` object older vLLM builds
    sent (JSON object keys are strings).
    """
    if isinstance(value, dict):
        dense: dict[int, int] = {}
        ok = True
        for key, count in value.items():
            k_str = str(key)
            if not (k_str.isascii() and k_str.isdigit()):
                errs.append((f"{field}.{_shown_key(key)}", "bucket keys must be non-negative integers"))
                ok = False
                continue
            if len(k_str) > 3 or int(k_str) >= MAX_HISTOGRAM_BUCKETS:
                errs.append(
                    (
                        f"{field}.{k_str[:10]}",
                        f"bucket keys must be below {MAX_HISTOGRAM_BUCKETS} (k <= {MAX_K})",
                    )
                )
                ok = False
                continue
            clean = _count(count, f"{field}.{key}", errs)
            if clean is None:
                ok = False
            else:
                dense[int(k_str)] = clean
        if not ok:
            return None
        size = max(dense) + 1 if dense else 0
        return [dense.get(j, 0) for j in range(size)]
    if type(value) is list and len(value) > MAX_HISTOGRAM_BUCKETS:
        errs.append((field, f"has {len(value)} buckets; at most {MAX_HISTOGRAM_BUCKETS} (k <= {MAX_K})"))
        return None
    return _counts(value, field, errs)


def _positions_from_histogram(hist: list[int], width: int) -> list[int]:
    """``out[i]`` = steps that accepted at least ``i + 1`` drafts: a suffix sum of the histogram."""
    out = [0] * width
    running = 0
    for j in range(len(hist) - 1, 0, -1):
        running += hist[j]
        if j - 1 < width:
            out[j - 1] = running
    return out


def _check_histogram(
    hist: list[int],
    steps: int | None,
    accepted: int | None,
    k: int | None,
    field: str,
    names: _Names,
    errs: _Errs,
) -> bool:
    """The histogram's exact identities with the totals; True when all hold."""
    before = len(errs)
    if steps is not None and sum(hist) != steps:
        errs.append((field, f"counts sum to {sum(hist)} but {names.steps} is {steps}"))
    weighted = sum(j * c for j, c in enumerate(hist))
    if accepted is not None and weighted != accepted:
        errs.append((field, f"implies {weighted} accepted drafts but {names.accepted} is {accepted}"))
    if k is not None:
        beyond = [j for j in range(k + 1, len(hist)) if hist[j]]
        if beyond:
            errs.append((field, f"has steps accepting {beyond[0]} drafts but at most k = {k} are drafted"))
    return len(errs) == before


# --------------------------------------------------------------------------------------------
# vLLM
# --------------------------------------------------------------------------------------------


def _from_vllm(rec: dict[str, Any], errs: _Errs) -> AcceptanceRecord | None:
    """vLLM per-request ``metrics.speculative_decoding`` (``--per-request-spec-decode-metrics``).

    Takes the whole response (``metrics.speculative_decoding``; older builds put
    ``speculative_decoding_stats`` on ``choices[0]``), a record with a ``speculative_decoding``
    key, or the bare metrics object. Source: docs.vllm.ai features/speculative_decoding/
    acceptance_metrics. A null block (vLLM's answer when speculation is off) is a no-speculation
    record (nothing drafted) sized by ``usage``, on any arm, unless the reply has several choices
    (vLLM reports acceptance only for n == 1). A missing block is a problem naming the flag,
    except on the ``baseline`` arm (no speculation), where it is a no-speculation record too.

    Exact: drafted (``num_draft_tokens``, after grammar-invalidated drafts are subtracted, as
    vLLM counts), accepted, verify steps, k (``num_spec_tokens``), per-position counts (suffix
    sums of ``acceptance_histogram``), prompt and completion tokens from ``usage``, TTFT and
    mean ITL from the timing fields. ``total_ms`` = queue + TTFT + generation time (the sum of
    vLLM's own timing fields). Without ``usage``, ``generated_tokens`` is the lower bound
    ``accepted + steps``. Cross-checked (each mismatch is a problem): histogram sum and weighted
    sum against steps and accepted, ``acceptance_histogram_by_draft_length`` against the
    histogram and drafted, ``per_step_*`` arrays against all totals. The floats
    (``mean_acceptance_length``, ``draft_acceptance_rate``) are derived by vLLM from the counts
    and ignored, as AIPerf does, to avoid rounding false alarms.
    """
    timing: dict[str, Any] | None = None
    if "metrics" in rec:
        metrics = rec["metrics"]
        if metrics is None:
            errs.append(("metrics", "is null: vLLM reports per-request metrics only for n == 1 requests"))
            return None
        timing = _obj(metrics, "metrics", errs)
        if timing is None:
            return None
        path = "metrics.speculative_decoding"
        sd_raw = timing.get("speculative_decoding", _MISSING)
    elif "speculative_decoding" in rec:
        path, sd_raw = "speculative_decoding", rec["speculative_decoding"]
    elif "choices" in rec:
        choice = _single_choice(rec, errs)
        if choice is None:
            return None
        key = (
            "speculative_decoding_stats" if "speculative_decoding_stats" in choice else "speculative_decoding"
        )
        path, sd_raw = f"choices[0].{key}", choice.get(key, _MISSING)
    else:
        path, sd_raw = "", rec
    env = _envelope(rec, errs)
    prompt, completion = _usage(rec, errs)
    ttft = itl = total = None
    if timing is not None:
        ttft = _latency_ms(timing.get("time_to_first_token_ms"), "metrics.time_to_first_token_ms", errs)
        itl = _latency_ms(timing.get("mean_itl_ms"), "metrics.mean_itl_ms", errs)
        gen_ms = _latency_ms(timing.get("generation_time_ms"), "metrics.generation_time_ms", errs)
        queue_ms = _latency_ms(timing.get("queue_time_ms"), "metrics.queue_time_ms", errs)
        if ttft is not None and gen_ms is not None:
            total = (queue_ms or 0.0) + ttft + gen_ms
    choices = rec.get("choices")
    several = isinstance(choices, list) and len(choices) > 1
    if (sd_raw is None and not several) or (
        sd_raw is _MISSING and env is not None and env.arm == ARM_BASELINE
    ):
        # Served without speculation (a server without a drafter, or the no-speculation arm).
        return _baseline(
            env,
            errs,
            generated=completion,
            prompt_tokens=prompt,
            ttft_ms=ttft,
            inter_token_ms=itl,
            total_ms=total,
        )
    if sd_raw is _MISSING:
        errs.append((path, "is missing: start vLLM with --per-request-spec-decode-metrics summary|detailed"))
        return None
    if sd_raw is None:
        errs.append((path, "is null: vLLM reports acceptance only for single-sequence (n == 1) requests"))
        return None
    sd = _obj(sd_raw, path, errs)
    if sd is None:
        return None
    p = f"{path}." if path else ""
    names, steps, accepted, drafted, k, hist = _spec_counts(
        sd, p, "num_draft_tokens", "num_accepted_draft_tokens", errs
    )
    per_step = _vllm_per_step(sd, p, steps, accepted, drafted, names, errs)
    if hist is None and per_step is not None:
        hist = per_step  # detailed mode alone determines the histogram exactly
    elif hist is not None and per_step is not None and _trim(per_step) != _trim(hist):
        errs.append((f"{p}per_step_accepted", "does not match acceptance_histogram"))
    by_length = sd.get("acceptance_histogram_by_draft_length")
    if by_length is not None and hist is not None:
        _vllm_by_length(by_length, hist, drafted, f"{p}acceptance_histogram_by_draft_length", names, errs)

    width = k if k is not None else (len(hist) - 1 if hist else 0)
    positions = _positions_from_histogram(hist, width) if hist else []
    return _build(
        env,
        errs,
        names,
        drafted=drafted,
        accepted=accepted,
        steps=steps,
        generated=completion,
        positions=positions,
        k=k,
        prompt_tokens=prompt,
        ttft_ms=ttft,
        inter_token_ms=itl,
        total_ms=total,
    )


def _trim(hist: list[int]) -> list[int]:
    end = len(hist)
    while end and not hist[end - 1]:
        end -= 1
    return hist[:end]


def _vllm_per_step(
    sd: dict[str, Any],
    p: str,
    steps: int | None,
    accepted: int | None,
    drafted: int | None,
    names: _Names,
    errs: _Errs,
) -> list[int] | None:
    """Cross-check ``detailed`` mode's per-step arrays; return the histogram they imply."""
    raw_acc, raw_dr = sd.get("per_step_accepted"), sd.get("per_step_drafted")
    if raw_acc is None and raw_dr is None:
        return None
    before = len(errs)
    acc = _counts(raw_acc, f"{p}per_step_accepted", errs) if raw_acc is not None else None
    dr = _counts(raw_dr, f"{p}per_step_drafted", errs) if raw_dr is not None else None
    for name, arr, want_sum, sum_name in (
        ("per_step_accepted", acc, accepted, names.accepted),
        ("per_step_drafted", dr, drafted, names.drafted),
    ):
        if arr is None:
            continue
        if steps is not None and len(arr) != steps:
            errs.append((f"{p}{name}", f"has {len(arr)} entries but {names.steps} is {steps}"))
        if want_sum is not None and sum(arr) != want_sum:
            errs.append((f"{p}{name}", f"sums to {sum(arr)} but {sum_name} is {want_sum}"))
    if acc is not None and max(acc, default=0) > MAX_K:
        errs.append(
            (f"{p}per_step_accepted", f"has a step accepting more than {MAX_K} drafts (k <= {MAX_K})")
        )
    if acc is not None and dr is not None:
        for s, (a, d) in enumerate(zip(acc, dr, strict=False)):
            if a > d:
                errs.append((f"{p}per_step_accepted[{s}]", f"({a}) exceeds per_step_drafted[{s}] ({d})"))
                break
    if acc is None or len(errs) > before:
        return None
    hist = [0] * (max(acc, default=0) + 1)
    for a in acc:
        hist[a] += 1
    return hist


def _vllm_by_length(
    value: object, hist: list[int], drafted: int | None, field: str, names: _Names, errs: _Errs
) -> None:
    """Rows ``{"L": [steps accepting j of L drafts]}`` must add up to the histogram and drafted."""
    rows = _obj(value, field, errs)
    if rows is None:
        return
    summed: list[int] = []
    drafted_by_rows = 0
    for key, row_raw in rows.items():
        length_str = str(key)
        if not (length_str.isascii() and length_str.isdigit()):
            errs.append((f"{field}.{key}", "draft-length keys must be non-negative integers"))
            return
        length = int(length_str)
        row = _counts(row_raw, f"{field}.{key}", errs)
        if row is None:
            return
        if len(row) != length + 1:
            errs.append((f"{field}.{key}", f"must have {length + 1} buckets, got {len(row)}"))
            return
        if len(summed) < len(row):
            summed.extend([0] * (len(row) - len(summed)))
        for j, c in enumerate(row):
            summed[j] += c
        drafted_by_rows += length * sum(row)
    if _trim(summed) != _trim(hist):
        errs.append((field, "rows do not add up to acceptance_histogram"))
    if drafted is not None and drafted_by_rows != drafted:
        errs.append((field, f"implies {drafted_by_rows} drafted tokens but {names.drafted} is {drafted}"))


# --------------------------------------------------------------------------------------------
# TensorRT-LLM
# --------------------------------------------------------------------------------------------


def _from_trtllm(rec: dict[str, Any], errs: _Errs) -> AcceptanceRecord | None:
    """TensorRT-LLM per-choice ``speculative_decoding`` (``per_request_spec_decode_stats``).

    Takes the whole response (``choices[0].speculative_decoding``), a record with a
    ``speculative_decoding`` key, or the bare object, with the field names AIPerf's TensorRT-LLM
    adapter reads: ``total_draft_tokens``, ``total_accepted_draft_tokens``, ``num_spec_steps``,
    ``acceptance_histogram`` (dense), ``num_spec_tokens`` (null under ``draft_len_schedule``),
    ``acceptance_rate``. Exact: all counts, per-position counts from the histogram, k when
    TensorRT-LLM reports one (else None and the histogram's own depth sets the width), tokens
    from ``usage``. ``avg_decoded_tokens_per_iter`` averages over iterations that drafted
    nothing too, so it is not used. TensorRT-LLM omits the block (or sends null) for a request
    that never drafted: that is a no-speculation record (nothing drafted), on any arm.
    """
    if "choices" in rec:
        choice = _single_choice(rec, errs)
        if choice is None:
            return None
        path, sd_raw = "choices[0].speculative_decoding", choice.get("speculative_decoding", _MISSING)
    elif "speculative_decoding" in rec:
        path, sd_raw = "speculative_decoding", rec["speculative_decoding"]
    else:
        path, sd_raw = "", rec
    env = _envelope(rec, errs)
    prompt, completion = _usage(rec, errs)
    if sd_raw is _MISSING or sd_raw is None:
        return _baseline(env, errs, generated=completion, prompt_tokens=prompt)
    sd = _obj(sd_raw, path, errs)
    if sd is None:
        return None
    p = f"{path}." if path else ""
    names, steps, accepted, drafted, k, hist = _spec_counts(
        sd, p, "total_draft_tokens", "total_accepted_draft_tokens", errs
    )
    width = k if k is not None else (len(hist) - 1 if hist else 0)
    positions = _positions_from_histogram(hist, width) if hist else []
    return _build(
        env,
        errs,
        names,
        drafted=drafted,
        accepted=accepted,
        steps=steps,
        generated=completion,
        positions=positions,
        k=k,
        prompt_tokens=prompt,
    )


# --------------------------------------------------------------------------------------------
# SGLang
# --------------------------------------------------------------------------------------------

# Current names first; SGLang kept the older ones as aliases for a release, so both may appear.
_SGLANG_ACCEPTED: Final = ("spec_num_correct_drafts", "spec_accepted_drafts", "spec_accept_token_num")
_SGLANG_DRAFTED: Final = ("spec_num_proposed_drafts", "spec_proposed_drafts", "spec_draft_token_num")
_SGLANG_HISTOGRAM: Final = ("spec_correct_drafts_histogram", "spec_accept_histogram")


def _alias_count(obj: dict[str, Any], keys: Sequence[str], p: str, errs: _Errs) -> tuple[int | None, str]:
    """The count under whichever alias is present; present aliases must agree."""
    found: list[tuple[str, int]] = []
    for key in keys:
        if obj.get(key) is not None:
            value = _count(obj[key], f"{p}{key}", errs)
            if value is None:
                return None, f"{p}{key}"
            found.append((key, value))
    if not found:
        return None, f"{p}{keys[0]}"
    for key, value in found[1:]:
        if value != found[0][1]:
            errs.append((f"{p}{key}", f"({value}) disagrees with {found[0][0]} ({found[0][1]})"))
            return None, f"{p}{found[0][0]}"
    return found[0][1], f"{p}{found[0][0]}"


def _from_sglang(rec: dict[str, Any], errs: _Errs) -> AcceptanceRecord | None:
    """SGLang ``meta_info`` from ``/generate`` (or ``choices[0].meta_info``, or bare).

    Reads current and older names: accepted = ``spec_num_correct_drafts`` | ``spec_accepted_drafts``
    | ``spec_accept_token_num``; drafted = ``spec_num_proposed_drafts`` | ``spec_proposed_drafts``
    | ``spec_draft_token_num``; histogram = ``spec_correct_drafts_histogram`` |
    ``spec_accept_histogram`` (index j = verify steps that accepted exactly j drafts);
    ``spec_verify_ct`` = verify steps. Source: sglang ``tokenizer_manager.py``
    ``_calculate_spec_decoding_metrics``.

    Exact: all counts, per-position counts (suffix sums of the histogram, or
    ``spec_num_correct_drafts_by_position`` when sent), prompt/completion tokens, ``total_ms``
    from ``e2e_latency`` (seconds). ``k`` is exact from ``spec_num_proposed_drafts_by_position``;
    otherwise it is ``drafted / spec_verify_ct`` when that divides (SGLang defines drafted as
    steps × (speculative_num_draft_tokens − 1)), else unknown. ``spec_accept_length`` is
    completion tokens ÷ steps in SGLang (bonus and prefill tokens included) and
    ``spec_accept_rate`` is accepted ÷ drafted: both derived, both ignored. Without
    ``spec_verify_ct`` (a server without speculation) or with 0 verify steps the record is a
    no-speculation record (nothing drafted), on any arm.
    """
    if "meta_info" in rec:
        path, meta_raw = "meta_info", rec["meta_info"]
    elif "choices" in rec:
        choice = _single_choice(rec, errs)
        if choice is None:
            return None
        path, meta_raw = "choices[0].meta_info", choice.get("meta_info", _MISSING)
    else:
        path, meta_raw = "", rec
    if meta_raw is _MISSING:
        errs.append((path, "is missing"))
        return None
    meta = _obj(meta_raw, path or "record", errs)
    if meta is None:
        return None
    p = f"{path}." if path else ""
    env = _envelope(rec, errs, fallback_id=meta.get("id", _MISSING) if path else _MISSING)
    usage_prompt, usage_completion = _usage(rec, errs)
    prompt = _opt_count(meta.get("prompt_tokens"), f"{p}prompt_tokens", errs)
    completion = _opt_count(meta.get("completion_tokens"), f"{p}completion_tokens", errs)
    total = _latency_ms(meta.get("e2e_latency"), f"{p}e2e_latency", errs, scale=1000.0)
    prompt = prompt if prompt is not None else usage_prompt
    completion = completion if completion is not None else usage_completion

    if meta.get("spec_verify_ct") is None:
        if _has_any(meta, (*_SGLANG_ACCEPTED, *_SGLANG_DRAFTED)):
            errs.append((f"{p}spec_verify_ct", "is missing but draft counts are present"))
            return None
        # A server without speculation writes no spec_* field at all.
        return _baseline(env, errs, generated=completion, prompt_tokens=prompt, total_ms=total)
    steps = _count(meta["spec_verify_ct"], f"{p}spec_verify_ct", errs)
    accepted, accepted_field = _alias_count(meta, _SGLANG_ACCEPTED, p, errs)
    drafted, drafted_field = _alias_count(meta, _SGLANG_DRAFTED, p, errs)
    if steps == 0:
        # SGLang writes the spec counters only once a verify step happened.
        accepted = 0 if accepted is None and not _has_any(meta, _SGLANG_ACCEPTED) else accepted
        drafted = 0 if drafted is None and not _has_any(meta, _SGLANG_DRAFTED) else drafted
    for value, field, aliases in (
        (accepted, accepted_field, _SGLANG_ACCEPTED),
        (drafted, drafted_field, _SGLANG_DRAFTED),
    ):
        if value is None and not any(f == field for f, _ in errs):
            errs.append((field, f"is missing: one of {', '.join(aliases)} is needed when spec_verify_ct > 0"))
    names = _Names(drafted_field, accepted_field, f"{p}spec_verify_ct", "")

    by_pos_acc = meta.get("spec_num_correct_drafts_by_position")
    by_pos_dr = meta.get("spec_num_proposed_drafts_by_position")
    k: int | None = None
    if by_pos_dr is not None:
        proposed = _counts(by_pos_dr, f"{p}spec_num_proposed_drafts_by_position", errs)
        if proposed is not None:
            k = len(proposed)
            if drafted is not None and sum(proposed) != drafted:
                message = f"sums to {sum(proposed)} but {drafted_field} is {drafted}"
                errs.append((f"{p}spec_num_proposed_drafts_by_position", message))
    elif steps and drafted is not None and drafted % steps == 0:
        k = drafted // steps

    hist: list[int] | None = None
    hist_key = next((key for key in _SGLANG_HISTOGRAM if meta.get(key) is not None), None)
    if hist_key is not None:
        hist = _histogram(meta[hist_key], f"{p}{hist_key}", errs)
        for other in _SGLANG_HISTOGRAM:
            if hist is not None and other != hist_key and meta.get(other) is not None:
                if _histogram(meta[other], f"{p}{other}", errs) != hist:
                    errs.append((f"{p}{other}", f"disagrees with {hist_key}"))
        if hist is not None and not _check_histogram(hist, steps, accepted, k, f"{p}{hist_key}", names, errs):
            hist = None
    positions: list[int] = []
    if hist:
        width = k if k is not None else max(len(_trim(hist)) - 1, 0)
        positions = _positions_from_histogram(hist, width)
    if by_pos_acc is not None:
        direct = _positions(by_pos_acc, f"{p}spec_num_correct_drafts_by_position", errs)
        if direct is not None:
            if positions and _trim(direct) != _trim(positions):
                errs.append((f"{p}spec_num_correct_drafts_by_position", f"disagrees with {hist_key}"))
            positions = direct
    return _build(
        env,
        errs,
        names._replace(positions=f"{p}{hist_key or 'spec_num_correct_drafts_by_position'}"),
        drafted=drafted,
        accepted=accepted,
        steps=steps,
        generated=completion,
        positions=positions,
        k=k,
        prompt_tokens=prompt,
        total_ms=total,
    )


def _has_any(obj: dict[str, Any], keys: Iterable[str]) -> bool:
    return any(obj.get(key) is not None for key in keys)


# --------------------------------------------------------------------------------------------
# Fireworks
# --------------------------------------------------------------------------------------------

_FW_HEADER_PREFIX: Final = "fireworks-"


def _fw_key(key: object) -> str:
    """Documented spelling of a perf-metrics key: also accepts header names and underscores."""
    k = str(key).strip().lower().replace("_", "-")
    return k[len(_FW_HEADER_PREFIX) :] if k.startswith(_FW_HEADER_PREFIX) else k


def _fw_count(value: object, field: str, errs: _Errs) -> int | None:
    """Counts may arrive as header strings ("42") when a client copies response headers."""
    if type(value) is str:
        text = value.strip()
        if text.isascii() and text.isdigit():
            return int(text)
        errs.append((field, f"must be a non-negative integer, got {_echo(value)}"))
        return None
    return _opt_count(value, field, errs)


def _fw_seconds(value: object, field: str, errs: _Errs) -> float | None:
    if type(value) is str:
        try:
            value = float(value)
        except ValueError:
            errs.append((field, f"must be a number of seconds, got {_echo(value)}"))
            return None
    return _latency_ms(value, field, errs, scale=1000.0)


class _FwPairs(NamedTuple):
    hits: list[int]
    totals: list[int]


def _fw_acceptance(value: object, field: str, errs: _Errs) -> _FwPairs | list[float] | None:
    """``speculation-acceptance`` as exact ``hits/total`` pairs or as per-position rates.

    Accepted spellings: ``"0:45/50,1:30/45"`` (what Fireworks' own benchmark, fw-ai/benchmark
    ``llm_bench/load_test.py``, parses from the body and the ``fireworks-speculation-acceptance``
    header), ``"45/50,30/45"``, ``["45/50", ...]``, ``{"0": "45/50"}``; or rates:
    ``"0.9,0.6"``, ``[0.9, 0.6]``, ``{"0": 0.9}``.
    """
    items: list[object]
    if type(value) is str:
        items = [part.strip() for part in value.split(",") if part.strip()]
    elif type(value) is list:
        items = list(value)
    elif isinstance(value, dict):
        try:
            ordered = sorted(value.items(), key=lambda kv: int(str(kv[0])))
        except ValueError:
            errs.append((field, "object keys must be draft positions 0, 1, ..."))
            return None
        if [int(str(key)) for key, _ in ordered] != list(range(len(ordered))):
            errs.append((field, "positions must be 0..k-1 without gaps"))
            return None
        items = [item for _, item in ordered]
    else:
        errs.append((field, f"must be a string, array or object, got {_type_name(value)}"))
        return None
    if not items:
        errs.append((field, "is empty"))
        return None
    if all(type(item) is str and ("/" in item or ":" in item) for item in items):
        return _fw_pairs([str(item) for item in items], field, errs)
    rates: list[float] = []
    for i, item in enumerate(items):
        try:
            rate = float(item) if type(item) is str or type(item) is int or type(item) is float else math.nan
        except ValueError:
            rate = math.nan
        if not 0.0 <= rate <= 1.0:  # also false for NaN
            errs.append((f"{field}[{i}]", f"must be a rate in [0, 1] or 'hits/total', got {_echo(item)}"))
            return None
        rates.append(rate)
    return rates


def _fw_pairs(items: list[str], field: str, errs: _Errs) -> _FwPairs | None:
    hits: list[int] = []
    totals: list[int] = []
    for i, item in enumerate(items):
        pos_text, _, frac = item.rpartition(":")
        h_text, slash, t_text = frac.partition("/")
        h_text, t_text, pos_text = h_text.strip(), t_text.strip(), pos_text.strip()
        if not (slash and h_text.isascii() and h_text.isdigit() and t_text.isascii() and t_text.isdigit()):
            errs.append((f"{field}[{i}]", f"must look like '{i}:hits/total', got {_echo(item)}"))
            return None
        if pos_text and pos_text != str(i):
            errs.append(
                (f"{field}[{i}]", f"positions must be 0..k-1 in order, got position {_echo(pos_text)}")
            )
            return None
        h, t = int(h_text), int(t_text)
        if h > t:
            errs.append((f"{field}[{i}]", f"hits ({h}) exceed total ({t})"))
            return None
        if i and h > hits[-1]:
            errs.append((f"{field}[{i}]", f"hits ({h}) exceed position {i - 1}'s ({hits[-1]})"))
            return None
        if i and t > totals[-1]:
            errs.append((f"{field}[{i}]", f"total ({t}) exceeds position {i - 1}'s ({totals[-1]})"))
            return None
        hits.append(h)
        totals.append(t)
    return _FwPairs(hits, totals)


def _round_half_up(x: float) -> int:
    return math.floor(x + 0.5)


def _from_fireworks(rec: dict[str, Any], errs: _Errs) -> AcceptanceRecord | None:
    """Fireworks ``perf_metrics`` as returned with ``perf_metrics_in_response: true``.

    Takes the whole response (or final streaming chunk) with ``perf_metrics`` and ``usage``, a
    record wrapping ``perf_metrics``, or the bare metrics (header names with the ``fireworks-``
    prefix and underscores are accepted too). Source: docs.fireworks.ai, API reference
    ``perf_metrics_in_response`` and deployments/speculative-decoding.

    Fields used: ``speculation-acceptance`` (by draft position), ``speculation-generated-tokens``
    (G; Fireworks documents it only as "tokens generated through speculation", and this project
    gives it one meaning everywhere, the reference server and the traffic driver included: the
    tokens the speculative verify steps emitted, accepted drafts plus one target token per step,
    i.e. the completion tokens less the one sampled from the prefill; never the drafted tokens),
    ``prompt-tokens``, ``server-time-to-first-token`` and ``server-processing-time`` (seconds).
    ``speculation-prompt-tokens`` / ``speculation-prompt-matched-tokens`` describe Predicted
    Outputs (the caller's prediction, not the drafter) and are deliberately not counted as drafts.

    With ``hits/total`` pairs (k = number of positions) everything is exact but drafted:
    verify steps = total at position 0, ``accepted_per_position`` = hits, accepted = their sum.
    Steps that proposed nothing (an n-gram miss, the last token of the budget) draft no position,
    so they are not in the totals; with G, verify steps = G − accepted when that is larger (G
    counts one target token per step), which recovers them. That is exact unless a request both
    had such steps and ended on an accepted end-of-text draft (that last step emits no target
    token: then steps is one low).
    Drafted = the sum of the totals when they count proposals per position (exact); when the
    totals are conditional (total[i] == hits[i-1], i.e. position i only counted after i-1 was
    accepted), drafted = steps × k (estimated: assumes every step drafted k tokens). Absolute totals
    from a drafter whose draft length varies can match that pattern by coincidence; they are then
    read as conditional too (the format cannot tell them apart; only drafted differs).

    With rates only (k = number of rates, each the share of verify steps that accepted that
    position, so non-increasing), counts are estimated from G = ``speculation-generated-tokens``
    (else the completion tokens, one more than G because of the prefill token): steps =
    round(G / (1 + Σ rates)), ``accepted_per_position[i]`` = round(rate[i] × steps), accepted =
    their sum, drafted = steps × k. Precision: steps is within ±1 when the rates carry ~3
    significant digits; per-position counts inherit the rates' rounding (±0.5 × steps × 10^-d for
    d decimals). Non-increasing rates stay non-increasing after rounding. Conditional rates
    (which may increase with position) are refused with a message asking for pairs.

    ``generated_tokens`` = ``usage.completion_tokens`` when present (exact), else G + 1, else the
    lower bound accepted + steps. ``inter_token_ms`` = (processing − TTFT) ÷ (generated − 1),
    the usual mean inter-token latency. A record without ``speculation-acceptance`` (serverless,
    or speculation off) is a problem unless its arm is ``baseline``.
    """
    if "perf_metrics" in rec:
        pm = _obj(rec["perf_metrics"], "perf_metrics", errs)
        p = "perf_metrics."
    else:
        pm, p = rec, ""
    env = _envelope(rec, errs)
    prompt_usage, completion = _usage(rec, errs)
    if pm is None:
        return None
    metrics: dict[str, tuple[str, object]] = {}
    for key, value in pm.items():
        metrics.setdefault(_fw_key(key), (f"{p}{key}", value))

    def get(name: str) -> tuple[str, object]:
        return metrics.get(name, (f"{p}{name}", _MISSING))

    gen_field, gen_raw = get("speculation-generated-tokens")
    spec_generated = _fw_count(gen_raw, gen_field, errs) if gen_raw is not _MISSING else None
    prompt_field, prompt_raw = get("prompt-tokens")
    prompt = _fw_count(prompt_raw, prompt_field, errs) if prompt_raw is not _MISSING else prompt_usage
    ttft_field, ttft_raw = get("server-time-to-first-token")
    ttft = _fw_seconds(ttft_raw, ttft_field, errs)
    total_field, total_raw = get("server-processing-time")
    total = _fw_seconds(total_raw, total_field, errs)
    if env is not None and env.generated_tokens is not None:
        completion = env.generated_tokens

    acc_field, acc_raw = get("speculation-acceptance")
    if acc_raw is _MISSING or acc_raw is None or acc_raw == "":
        # Neither speculation key: the server ran without speculation (a deployment without a
        # drafter, on any arm), as vLLM's null block says. One key without the other hides lost
        # acceptance, and is refused outside the no-speculation arm.
        if env is not None and (env.arm == ARM_BASELINE or gen_raw is _MISSING):
            generated = (
                completion
                if completion is not None
                else (spec_generated + 1 if spec_generated is not None else None)
            )
            return _baseline(
                env,
                errs,
                generated=generated,
                prompt_tokens=prompt,
                ttft_ms=ttft,
                inter_token_ms=_fw_itl(ttft, total, generated),
                total_ms=total,
            )
        errs.append((acc_field, "is missing: Fireworks reports it on dedicated deployments with speculation"))
        return None
    acceptance = _fw_acceptance(acc_raw, acc_field, errs)
    if acceptance is None:
        return None
    if isinstance(acceptance, _FwPairs):
        k = len(acceptance.hits)
        steps = acceptance.totals[0]
        positions = acceptance.hits
        accepted = sum(positions)
        if spec_generated is not None and spec_generated - accepted > steps:
            # Steps without a proposal emit one target token each and show in G only.
            if completion is None or spec_generated < completion:
                steps = spec_generated - accepted
        conditional = all(acceptance.totals[i] == acceptance.hits[i - 1] for i in range(1, k))
        drafted = acceptance.totals[0] * k if conditional else sum(acceptance.totals)
    else:
        k = len(acceptance)
        for i in range(1, k):
            if acceptance[i] > acceptance[i - 1] + 1e-9:
                message = (
                    "rates must be non-increasing (the share of verify steps that accepted the position); "
                    "conditional rates are ambiguous, send 'i:hits/total' pairs"
                )
                errs.append((f"{acc_field}[{i}]", message))
                return None
        if spec_generated is not None:
            basis: int | None = spec_generated
        elif completion is not None:
            basis = max(completion - 1, 0)  # the prefill token is not emitted by a verify step
        else:
            basis = None
        if basis is None:
            errs.append(
                (gen_field, "is needed (or usage.completion_tokens) to turn acceptance rates into counts")
            )
            return None
        steps = _round_half_up(basis / (1.0 + sum(acceptance)))
        positions = [_round_half_up(rate * steps) for rate in acceptance]
        accepted = sum(positions)
        drafted = steps * k
    if completion is not None:
        generated = completion
    elif spec_generated is not None:
        generated = spec_generated + 1  # G leaves out the token sampled from the prefill
    else:
        generated = accepted + steps
    return _build(
        env,
        errs,
        _Names(acc_field, acc_field, acc_field, acc_field),
        drafted=drafted,
        accepted=accepted,
        steps=steps,
        generated=generated,
        positions=positions,
        k=k,
        prompt_tokens=prompt,
        ttft_ms=ttft,
        inter_token_ms=_fw_itl(ttft, total, generated),
        total_ms=total,
    )


def _fw_itl(ttft: float | None, total: float | None, generated: int | None) -> float | None:
    if ttft is None or total is None or generated is None or generated < 2 or total < ttft:
        return None
    return (total - ttft) / (generated - 1)


_ADAPTERS: Final[dict[str, _Adapter]] = {
    "native": _from_native,
    "fireworks": _from_fireworks,
    "vllm": _from_vllm,
    "sglang": _from_sglang,
    "trtllm": _from_trtllm,
}


def _spec_counts(
    sd: dict[str, Any], p: str, drafted_key: str, accepted_key: str, errs: _Errs
) -> tuple[_Names, int | None, int | None, int | None, int | None, list[int] | None]:
    """Totals and the acceptance histogram that vLLM and TensorRT-LLM report alike (only the
    names of the two totals differ); an inconsistent histogram is reported and dropped."""
    names = _Names(
        f"{p}{drafted_key}", f"{p}{accepted_key}", f"{p}num_spec_steps", f"{p}acceptance_histogram"
    )
    steps = _count(sd.get("num_spec_steps", _MISSING), names.steps, errs)
    accepted = _count(sd.get(accepted_key, _MISSING), names.accepted, errs)
    drafted = _count(sd.get(drafted_key, _MISSING), names.drafted, errs)
    k = _opt_count(sd.get("num_spec_tokens"), f"{p}num_spec_tokens", errs)
    hist: list[int] | None = None
    if sd.get("acceptance_histogram") is not None:
        hist = _histogram(sd["acceptance_histogram"], f"{p}acceptance_histogram", errs)
        if hist is not None and not _check_histogram(
            hist, steps, accepted, k, f"{p}acceptance_histogram", names, errs
        ):
            hist = None  # already reported; deriving positions from it would only repeat the problem
    return names, steps, accepted, drafted, k, hist
