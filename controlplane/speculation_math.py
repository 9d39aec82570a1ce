"""Every speculative-decoding figure users see, each defined once: the hit rate, the mean
accepted length and tokens per verify step, milliseconds per output token, and speed-ups (measured
from two runs, or expected from acceptance and measured costs). Stats, the dashboard, /metrics,
the canary's tally and tuning, drift, the demo, the shadow replay and the load benchmark all call
these functions, so their figures agree to the last float. Pure: no I/O, no imports from the
project (the workers import it too).

Conventions, once for all:

* A figure that has nothing to count is ``None``, never NaN and never 0.
* Rates are fractions (0.497); only formatting multiplies by 100.
* Milliseconds per output token is decode time: TTFT (the prefill, the same for every arm) is
  left out, unless a caller asks for wall time per token (``include_ttft=True``).
* A speed-up is how many times faster a candidate runs than a baseline, from their times for the
  same work (or their rates, higher being faster).
"""

from __future__ import annotations

# Drafter step time / target step time where nothing measured one yet (no shadow replay). An
# assumption, not a measurement of the deployment: the reference pair's small drafter measured
# about this (0.07 for a 0.9M drafter against a 12M target; docs/results.md's first drafter 0.075).
ASSUMED_DRAFTER_COST_RATIO = 0.07


def hit_rate(accepted: float, drafted: float) -> float | None:
    """Accepted draft tokens / drafted tokens (positions after a rejection count as drafted, not
    accepted); None when nothing was drafted."""
    return accepted / drafted if drafted > 0 else None


def mean_accepted_length(accepted: float, verify_steps: float) -> float | None:
    """Tokens a verify step emits on average: its accepted draft tokens plus the target's own
    (1 + accepted / steps); None without verify steps."""
    return 1.0 + accepted / verify_steps if verify_steps > 0 else None


def tokens_per_step(generated: float, verify_steps: float) -> float:
    """Generated tokens per target forward pass of one request (1.0 without verify steps: without
    speculation every token costs its own pass). Unlike :func:`mean_accepted_length` it counts
    the prefill's first token, so it is what the canary's latency-paired statistics compare."""
    return generated / verify_steps if verify_steps > 0 else 1.0


def mean_of(total: float, count: float) -> float | None:
    """The mean of ``count`` per-request figures summing to ``total``; None when there are none."""
    return total / count if count > 0 else None


def ms_per_token(
    inter: float | None,
    total: float | None,
    ttft: float | None,
    generated: int,
    *,
    include_ttft: bool = False,
) -> float | None:
    """Milliseconds per output token of one request (or of requests summed: totals and tokens).

    Decode time: the inter-token figure when the engine reports it; else the total spread over the
    tokens after the first (TTFT is prefill, the same for every arm). With ``include_ttft``: wall
    time per token, the total over every token (what a client waiting for the whole reply sees).
    """
    if include_ttft:
        return float(total) / generated if total is not None and generated > 0 else None
    if inter is not None and inter > 0:
        return float(inter)
    if total is not None and generated > 1:
        return max(0.0, float(total) - float(ttft or 0.0)) / (generated - 1)
    return None


def speedup(
    baseline: float | None, candidate: float | None, *, higher_is_faster: bool = False
) -> float | None:
    """How many times faster ``candidate`` runs than ``baseline``: baseline / candidate for the
    times of the same work (ms per token; target steps for the same tokens), candidate /
    baseline for rates (tokens per second) when ``higher_is_faster``. None where either is
    missing or not positive."""
    if baseline is None or candidate is None or baseline <= 0 or candidate <= 0:
        return None
    return candidate / baseline if higher_is_faster else baseline / candidate


def expected_tokens_per_step(alpha: float, k: int) -> float:
    """Leviathan et al.'s E: tokens one verify step of ``k`` drafted tokens yields when each is
    accepted with probability ``alpha`` independently, ``(1 - alpha^(k+1)) / (1 - alpha)``."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def expected_speedup(tokens_per_round: float, cost_per_round: float) -> float:
    """The speed-up of a verify round that yields ``tokens_per_round`` tokens for
    ``cost_per_round`` target steps (drafting included): without speculation the same tokens
    cost one target step each."""
    value = speedup(tokens_per_round, cost_per_round)
    if value is None:
        raise ValueError("a verify round yields tokens and costs time")
    return value


def leviathan_speedup(alpha: float, k: int, cost_ratio: float, verify_cost: float = 1.0) -> float:
    """Leviathan et al.'s expected speed-up ``E / (verify_cost + k c)``: k drafter steps of ``c``
    (drafter step time / target step time) each and one verify pass of k + 1 tokens costing
    ``verify_cost`` target steps (1.0: as cheap as one token, the paper's assumption)."""
    return expected_speedup(expected_tokens_per_step(alpha, k), verify_cost + k * cost_ratio)


def alpha_from_hit_rate(rate: float, k: int) -> float:
    """The per-token acceptance alpha whose i.i.d. hit rate with ``k`` drafted is ``rate``:
    ``rate = alpha (1 - alpha^k) / (k (1 - alpha))`` inverted by bisection (it is monotone)."""
    target = min(max(rate, 0.0), 0.999999)

    def rate_of(alpha: float) -> float:
        return alpha * (1 - alpha**k) / (k * (1 - alpha))

    lo, hi = 0.0, 0.999999
    for _ in range(60):
        mid = (lo + hi) / 2
        if rate_of(mid) < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def speedup_from_hit_rate(
    rate: float | None, k: int | None, cost_ratio: float, verify_cost: float = 1.0
) -> float | None:
    """The expected speed-up of serving ``k`` drafted tokens at hit rate ``rate`` (None without
    either): :func:`leviathan_speedup` at the alpha that hit rate implies."""
    if rate is None or not k:
        return None
    return leviathan_speedup(alpha_from_hit_rate(rate, k), k, cost_ratio, verify_cost)
