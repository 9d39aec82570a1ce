"""Acceptance-metrics formats users already emit, normalised into one ``AcceptanceRecord``.

This package owns the batch body of ``POST .../acceptance`` (``parse_batch``), the registry of
format adapters (``FORMAT_ADAPTERS``), per-record format detection, and ``BatchValidationError``.
One module per format (``native``, ``fireworks``, ``vllm``, ``tensorrt_llm``, ``sglang``) defines
its ``ADAPTER``; ``base`` holds the adapter interface, limits, errors and field validators, and
``replies`` what engine replies share. Every name importers use is re-exported here. It is pure:
no I/O, no database, no web framework; the API wires it.

The registry's order is the detection order: native, fireworks, vllm, trtllm, sglang. An
ambiguous record names the formats it matches in that order; ``FORMATS`` lists them so.

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

from typing import Any, Final

from controlplane.ingest.formats import fireworks, native, sglang, tensorrt_llm, vllm
from controlplane.ingest.formats.base import (
    _MISSING,
    _NATIVE_NAMES,
    EARLIEST,
    LATEST,
    MAX_BATCH_RECORDS,
    MAX_CATEGORY_CHARS,
    MAX_COUNT,
    MAX_ECHO_CHARS,
    MAX_HISTOGRAM_BUCKETS,
    MAX_K,
    MAX_KEPT_PROBLEMS,
    MAX_LATENCY_MS,
    MAX_REPORTED_PROBLEMS,
    MAX_REQUEST_ID_CHARS,
    MAX_SUGGESTED_KEY_CHARS,
    MAX_UNKNOWN_KEYS_LISTED,
    PERF_METRICS_IN_RESPONSE,
    BatchTooLargeError,
    BatchValidationError,
    FormatAdapter,
    Problem,
    _check_relations,
    _echo,
    _Errs,
    _Parse,
    _positions,
    _type_name,
    _unknown_keys,
    storage_problems,
)
from controlplane.ingest.formats.native import (
    DRAFT_STOP_KEYS,
    MAX_DRAFT_STOP_THRESHOLDS,
    NATIVE_FIELDS,
    _from_native,
    draft_stop_counts,
)
from controlplane.ingest.formats.replies import ENVELOPE_FIELDS
from controlplane.ingest.record import AcceptanceRecord

__all__ = [
    "BATCH_FORMATS",
    "DRAFT_STOP_KEYS",
    "EARLIEST",
    "ENVELOPE_FIELDS",
    "FORMATS",
    "FORMAT_ADAPTERS",
    "LATEST",
    "MAX_BATCH_RECORDS",
    "MAX_CATEGORY_CHARS",
    "MAX_COUNT",
    "MAX_DRAFT_STOP_THRESHOLDS",
    "MAX_ECHO_CHARS",
    "MAX_HISTOGRAM_BUCKETS",
    "MAX_K",
    "MAX_KEPT_PROBLEMS",
    "MAX_LATENCY_MS",
    "MAX_REPORTED_PROBLEMS",
    "MAX_REQUEST_ID_CHARS",
    "MAX_SUGGESTED_KEY_CHARS",
    "MAX_UNKNOWN_KEYS_LISTED",
    "NATIVE_FIELDS",
    "PERF_METRICS_IN_RESPONSE",
    "BatchTooLargeError",
    "BatchValidationError",
    "FormatAdapter",
    "Problem",
    "detect_format",
    "draft_stop_counts",
    "parse_batch",
    "parse_record",
    "record_problems",
    "storage_problems",
]

# In detection order. A new format is one module defining ADAPTER, added here.
FORMAT_ADAPTERS: Final[tuple[FormatAdapter, ...]] = (
    native.ADAPTER,
    fireworks.ADAPTER,
    vllm.ADAPTER,
    tensorrt_llm.ADAPTER,
    sglang.ADAPTER,
)
FORMATS: Final = tuple(adapter.name for adapter in FORMAT_ADAPTERS)
BATCH_FORMATS: Final = ("auto", *FORMATS)
_ADAPTERS: Final[dict[str, _Parse]] = {adapter.name: adapter.parse for adapter in FORMAT_ADAPTERS}
_BATCH_KEYS: Final = frozenset({"format", "records"})


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
_ENGINE_MARKERS: Final = frozenset[str]().union(
    *(adapter.markers for adapter in FORMAT_ADAPTERS if adapter is not native.ADAPTER)
)
_SHAPES: Final = [adapter.described_as for adapter in FORMAT_ADAPTERS]
_EXPECTED_SHAPES: Final = f"{', '.join(_SHAPES[:-1])} or {_SHAPES[-1]}"


def _auto_adapter(rec: dict[str, Any], errs: _Errs) -> _Parse | None:
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
            f"cannot detect the format from this record's keys (expected {_EXPECTED_SHAPES}); "
            'set "format" on the batch'
        )
    return f'ambiguous record: it matches {", ".join(candidates)}; set "format" on the batch'


def _candidates(rec: dict[str, Any]) -> list[str]:
    return [adapter.name for adapter in FORMAT_ADAPTERS if adapter.detects(rec)]
