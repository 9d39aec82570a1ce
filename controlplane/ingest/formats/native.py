"""The native format: the project's own ``AcceptanceRecord`` as JSON, validated, nothing derived.

This module owns the native field list, the native parser (the ingest hot path, hundreds of
thousands of records a second) and the optional counterfactual ``draft_stop_counts``, checked
against the record's own counts. The reference server sends a native record as
``speculation_record`` when a request asks for ``perf_metrics_in_response``.
"""

from __future__ import annotations

from datetime import UTC
from typing import Any, Final

from controlplane.ingest.formats.base import (
    _INF,
    _MISSING,
    _NATIVE_NAMES,
    MAX_CATEGORY_CHARS,
    MAX_COUNT,
    MAX_REQUEST_ID_CHARS,
    PERF_METRICS_IN_RESPONSE,
    FormatAdapter,
    _arm,
    _category,
    _check_relations,
    _count,
    _counts,
    _created_at,
    _echo,
    _Errs,
    _fromisoformat,
    _latency_ms,
    _positions,
    _request_id,
    _type_name,
    _unknown_keys,
    storage_problems,
)
from controlplane.ingest.record import ARM_BASELINE, ARM_LIVE, AcceptanceRecord

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
# draft_stop_counts: its keys, and at most this many thresholds (a grid, not a histogram).
DRAFT_STOP_KEYS: Final = ("thresholds", "rounds", "drafted", "accepted")
_DRAFT_STOP_KEYS: Final = frozenset(DRAFT_STOP_KEYS)
MAX_DRAFT_STOP_THRESHOLDS: Final = 64

# Any one of these names a native record, so a native record missing a field still parses as native
# and gets a "required field is missing" problem rather than "cannot detect the format".
_NATIVE_MARKERS: Final = frozenset(
    {"drafted_tokens", "accepted_tokens", "verify_steps", "accepted_per_position"}
)


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


def _detects_native(rec: dict[str, Any]) -> bool:
    return not _NATIVE_MARKERS.isdisjoint(rec)


ADAPTER: Final = FormatAdapter(
    name="native",
    engine="reference",
    markers=_NATIVE_MARKERS,
    detects=_detects_native,
    parse=_from_native,
    request_flag=PERF_METRICS_IN_RESPONSE,
    described_as="native drafted_tokens",
)
