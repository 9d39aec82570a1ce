"""vLLM's per-request ``metrics.speculative_decoding`` (``--per-request-spec-decode-metrics``).

This module owns the vLLM adapter: detection (the whole reply, a record with a
``speculative_decoding`` key, an older build's ``choices[0].speculative_decoding_stats``, or the
bare metrics object), the parser, and the cross-checks of ``detailed`` mode's per-step arrays and
of the histogram by draft length against the totals.
"""

from __future__ import annotations

from typing import Any, Final

from controlplane.ingest.formats.base import (
    _MISSING,
    MAX_K,
    FormatAdapter,
    _counts,
    _Errs,
    _latency_ms,
    _Names,
)
from controlplane.ingest.formats.replies import (
    _baseline,
    _build_spec,
    _envelope,
    _first_choice,
    _names_spec_count,
    _obj,
    _single_choice,
    _spec_counts,
    _SpecCounts,
    _trim,
    _usage,
)
from controlplane.ingest.record import ARM_BASELINE, AcceptanceRecord


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

    return _build_spec(
        env,
        errs,
        _SpecCounts(names, steps, accepted, drafted, k, hist),
        generated=completion,
        prompt_tokens=prompt,
        ttft_ms=ttft,
        inter_token_ms=itl,
        total_ms=total,
    )


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


def _detects_vllm(rec: dict[str, Any]) -> bool:
    choice = _first_choice(rec)
    return (
        "metrics" in rec
        or (choice is not None and "speculative_decoding_stats" in choice)
        or _names_spec_count(rec, choice, "num_accepted_draft_tokens")
    )


ADAPTER: Final = FormatAdapter(
    name="vllm",
    engine="vllm",
    markers=frozenset({"metrics", "num_accepted_draft_tokens", "speculative_decoding", "choices"}),
    detects=_detects_vllm,
    parse=_from_vllm,
    request_flag=None,  # a server option (--per-request-spec-decode-metrics), not a request field
    described_as="vLLM metrics.speculative_decoding",
)
