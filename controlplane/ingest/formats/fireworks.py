"""Fireworks ``perf_metrics`` (``perf_metrics_in_response: true``), body or response headers.

This module owns the Fireworks adapter: detection (``perf_metrics``, or its keys bare, with or
without the headers' ``fireworks-`` prefix), the spellings of ``speculation-acceptance`` (exact
``hits/total`` pairs, or per-position rates turned into estimated counts), and the parser.
"""

from __future__ import annotations

import math
from typing import Any, Final, NamedTuple

from controlplane.ingest.formats.base import (
    _MISSING,
    PERF_METRICS_IN_RESPONSE,
    FormatAdapter,
    _echo,
    _Errs,
    _latency_ms,
    _Names,
    _opt_count,
    _type_name,
)
from controlplane.ingest.formats.replies import _baseline, _build, _envelope, _obj, _usage
from controlplane.ingest.record import ARM_BASELINE, AcceptanceRecord

_FW_HEADER_PREFIX: Final = "fireworks-"
# Any one of these at the top of a record makes it a bare perf-metrics body (no perf_metrics key).
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


def _detects_fireworks(rec: dict[str, Any]) -> bool:
    return "perf_metrics" in rec or not _FIREWORKS_BARE_KEYS.isdisjoint(rec)


ADAPTER: Final = FormatAdapter(
    name="fireworks",
    engine="fireworks",
    # Not every bare key: beside drafted_tokens, a bare timing or generated-tokens header is a
    # native record's unknown field, not a reason to detect.
    markers=frozenset(
        {
            "perf_metrics",
            "speculation-acceptance",
            "speculation-generated-tokens",
            "fireworks-speculation-acceptance",
        }
    ),
    detects=_detects_fireworks,
    parse=_from_fireworks,
    request_flag=PERF_METRICS_IN_RESPONSE,
    described_as="Fireworks perf_metrics",
)
