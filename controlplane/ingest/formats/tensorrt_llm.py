"""TensorRT-LLM's per-choice ``speculative_decoding`` block (``per_request_spec_decode_stats``).

This module owns the TensorRT-LLM adapter: detection (the whole reply, a record with a
``speculative_decoding`` key, or the bare block, told from vLLM's by
``total_accepted_draft_tokens``) and the parser; the totals and histogram are read as vLLM's are.
"""

from __future__ import annotations

from typing import Any, Final

from controlplane.ingest.formats.base import _MISSING, FormatAdapter, _Errs
from controlplane.ingest.formats.replies import (
    _baseline,
    _build_spec,
    _envelope,
    _first_choice,
    _names_spec_count,
    _obj,
    _single_choice,
    _spec_counts,
    _usage,
)
from controlplane.ingest.record import AcceptanceRecord


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
    counts = _spec_counts(sd, p, "total_draft_tokens", "total_accepted_draft_tokens", errs)
    return _build_spec(env, errs, counts, generated=completion, prompt_tokens=prompt)


def _detects_trtllm(rec: dict[str, Any]) -> bool:
    return _names_spec_count(rec, _first_choice(rec), "total_accepted_draft_tokens")


ADAPTER: Final = FormatAdapter(
    name="trtllm",
    engine="trtllm",
    markers=frozenset({"total_accepted_draft_tokens", "speculative_decoding", "choices"}),
    detects=_detects_trtllm,
    parse=_from_trtllm,
    request_flag=None,  # its OpenAI server refuses unknown request fields
    described_as="TensorRT-LLM speculative_decoding",
)
