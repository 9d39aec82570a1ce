"""The per-request figures that more than one part reads off an acceptance record, each defined
once here: the canary's tally and the ingest's window aggregates must agree on them to the last
float. Pure: no I/O, no imports from the project.
"""

from __future__ import annotations


def ms_per_token(
    inter: float | None, total: float | None, ttft: float | None, generated: int
) -> float | None:
    """Decode latency per token of one request.

    The inter-token figure when the engine reports it; else the total spread over the tokens
    after the first (TTFT is prefill, the same for every arm).
    """
    if inter is not None and inter > 0:
        return float(inter)
    if total is not None and generated > 1:
        return max(0.0, float(total) - float(ttft or 0.0)) / (generated - 1)
    return None
