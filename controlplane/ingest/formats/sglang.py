"""SGLang's ``meta_info`` spec-decoding counters (``/generate``, or ``choices[0].meta_info``).

This module owns the SGLang adapter: detection, the current and older names of its counters (both
may appear, and must agree), and the parser.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Final

from controlplane.ingest.formats.base import (
    _MISSING,
    FormatAdapter,
    _count,
    _counts,
    _Errs,
    _latency_ms,
    _Names,
    _opt_count,
    _positions,
)
from controlplane.ingest.formats.replies import (
    _baseline,
    _build_spec,
    _check_histogram,
    _envelope,
    _first_choice,
    _histogram,
    _obj,
    _positions_from_histogram,
    _single_choice,
    _SpecCounts,
    _trim,
    _usage,
)
from controlplane.ingest.record import AcceptanceRecord

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
    return _build_spec(
        env,
        errs,
        _SpecCounts(
            names._replace(positions=f"{p}{hist_key or 'spec_num_correct_drafts_by_position'}"),
            steps,
            accepted,
            drafted,
            k,
            hist,
        ),
        generated=completion,
        prompt_tokens=prompt,
        positions=positions,
        total_ms=total,
    )


def _has_any(obj: dict[str, Any], keys: Iterable[str]) -> bool:
    return any(obj.get(key) is not None for key in keys)


def _detects_sglang(rec: dict[str, Any]) -> bool:
    choice = _first_choice(rec)
    return "meta_info" in rec or "spec_verify_ct" in rec or (choice is not None and "meta_info" in choice)


ADAPTER: Final = FormatAdapter(
    name="sglang",
    engine="sglang",
    markers=frozenset({"meta_info", "spec_verify_ct", "choices"}),
    detects=_detects_sglang,
    parse=_from_sglang,
    request_flag=None,  # no request field: a speculating server fills meta_info's spec_* counters
    described_as="SGLang meta_info",
)
