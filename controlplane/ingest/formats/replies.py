"""What engine replies share: the caller's envelope, OpenAI ``usage`` and ``choices``, acceptance
histograms, and the assembly of one ``AcceptanceRecord`` from a format's counts.

Every engine adapter (Fireworks, vLLM, TensorRT-LLM, SGLang) builds its record with ``_build``, so
the count identities and the storage limits are checked alike for all; vLLM and TensorRT-LLM read
their totals and histogram with one function (``_spec_counts``): only the totals' names differ.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Final, NamedTuple

from controlplane.ingest.formats.base import (
    _MISSING,
    _NATIVE_NAMES,
    MAX_HISTOGRAM_BUCKETS,
    MAX_K,
    _arm,
    _category,
    _check_relations,
    _count,
    _counts,
    _created_at,
    _epoch_seconds,
    _Errs,
    _Names,
    _opt_count,
    _request_id,
    _shown_key,
    _type_name,
    storage_problems,
)
from controlplane.ingest.record import ARM_LIVE, AcceptanceRecord

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


def _trim(hist: list[int]) -> list[int]:
    end = len(hist)
    while end and not hist[end - 1]:
        end -= 1
    return hist[:end]


def _first_choice(rec: dict[str, Any]) -> dict[str, Any] | None:
    choices = rec.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        return choices[0]
    return None


class _SpecCounts(NamedTuple):
    """A reply's acceptance totals, its field names for problems, and its histogram (if sent)."""

    names: _Names
    steps: int | None
    accepted: int | None
    drafted: int | None
    k: int | None
    hist: list[int] | None


def _names_spec_count(rec: dict[str, Any], choice: dict[str, Any] | None, key: str) -> bool:
    """Whether ``key`` (an engine's accepted-draft count) stands where that engine puts it: at
    the reply's top level, in its ``speculative_decoding`` block, or in its first choice's."""
    sd = rec.get("speculative_decoding")
    choice_sd = choice.get("speculative_decoding") if choice is not None else None
    return (
        key in rec
        or (isinstance(sd, dict) and key in sd)
        or (isinstance(choice_sd, dict) and key in choice_sd)
    )


def _spec_counts(sd: dict[str, Any], p: str, drafted_key: str, accepted_key: str, errs: _Errs) -> _SpecCounts:
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
    return _SpecCounts(names, steps, accepted, drafted, k, hist)


def _build_spec(
    env: _Envelope | None,
    errs: _Errs,
    counts: _SpecCounts,
    *,
    generated: int | None,
    prompt_tokens: int | None,
    positions: list[int] | None = None,
    ttft_ms: float | None = None,
    inter_token_ms: float | None = None,
    total_ms: float | None = None,
) -> AcceptanceRecord | None:
    """``_build`` from a reply's counts; unless given, per-position counts come from the
    histogram, as wide as k (or, without k, as the histogram is deep)."""
    if positions is None:
        hist, k = counts.hist, counts.k
        width = k if k is not None else (len(hist) - 1 if hist else 0)
        positions = _positions_from_histogram(hist, width) if hist else []
    return _build(
        env,
        errs,
        counts.names,
        drafted=counts.drafted,
        accepted=counts.accepted,
        steps=counts.steps,
        generated=generated,
        positions=positions,
        k=counts.k,
        prompt_tokens=prompt_tokens,
        ttft_ms=ttft_ms,
        inter_token_ms=inter_token_ms,
        total_ms=total_ms,
    )
