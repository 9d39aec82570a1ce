"""Per-request speculative-decoding metrics, counted by the decoder and exported in two shapes.

Owns `RequestMetrics` and its exports: `to_native()` (the control plane's ingest record, exactly its
keys), `to_fireworks()` (the `perf_metrics` object of Fireworks' `perf_metrics_in_response`) and
`to_vllm()` (vLLM's per-request `metrics.speculative_decoding`).

Definitions (raw counts; every ratio is derived from them):
- prompt_tokens: tokens in the prompt (the prefill).
- verify_steps: target forward passes after the prefill. A step whose proposer proposed nothing
  (n-gram lookup without a match, speculation disabled) still counts: it is a plain decoding step.
- drafted_tokens: draft tokens sent to verification. Positions after a rejection in the same step
  still count as drafted; a proposer that proposes k' < k tokens adds only k'.
- accepted_tokens: draft tokens the verifier accepted and that were kept (if an accepted draft is
  the end-of-text token, the drafts after it are not kept and not counted).
- generated_tokens: tokens the engine emitted: the token sampled from the prefill, then per step
  the accepted drafts plus the target's own token; an end-of-text token counts, nothing after it.
  So generated_tokens = 1 + accepted_tokens + verify_steps, less one if the request ended on an
  accepted end-of-text draft.
- accepted_per_position[i] (length k): verify steps in which draft position i was accepted, i.e. at
  least i + 1 drafts were accepted; non-increasing in i and summing to accepted_tokens.
- drafted_per_position[i]: verify steps that drafted position i (at least i + 1 drafts).
- hit rate = accepted_tokens / drafted_tokens; mean accepted length = 1 + accepted / verify_steps.

The Fireworks shape, exactly as Fireworks sends it (docs.fireworks.ai, `perf_metrics_in_response`;
the parser in Fireworks' own benchmark, fw-ai/benchmark `llm_bench/load_test.py`):
- `speculation-acceptance`: one string, `"0:a0/d0,1:a1/d1,..."`, position i's hits / total, here
  accepted_per_position[i] / drafted_per_position[i] (exact counts, not rates).
- `speculation-generated-tokens`: "tokens generated through speculation", read here, in the ingest
  adapter (controlplane.ingest.formats) and in the traffic driver with one meaning: the tokens the
  speculative (verify) steps emitted, i.e. accepted drafts plus each step's own target token =
  generated_tokens - 1 (the token sampled from the prefill is not one of them). Never drafted tokens.
Both are sent only when the request was decoded with speculation (k >= 1), as Fireworks sends them
only on deployments with speculation.
- ttft_ms: from the start of the request to the first generated token (prefill + first sample).
  inter_token_ms: mean gap per token after the first, (t_last - t_first) / (generated - 1).
  total_ms: start of the request to the last token. propose_ms / score_ms: time spent proposing
  and in target verification forwards after the prefill; the rest of total_ms - ttft_ms is the
  engine's own bookkeeping (`overhead_ms`).
- draft_stop_counts (draft-model speculation only; None otherwise): what drafting would have done
  under each confidence threshold of a fixed grid (`DraftStopCounts`), the draft-stop tuner's input
  (controlplane.tuning.draft_stop). Per verify round in which the drafter drafted: the tokens a
  round stopping at the first draft its drafter gave less than t would have drafted (that draft
  included, as DraftModelProposer stops) and the accepted prefix capped at that count: exact under
  greedy verification, and per token exact in distribution under rejection sampling (draft i is
  accepted with probability min(1, p_i / q_i), which later drafts do not change). A round that
  already stopped at an active threshold t0 shows only thresholds >= t0 (a lower one would have
  drafted past the stop, which was never drafted), so the grid reported is the part >= t0.
- Predicted outputs: prediction_tokens = tokens in the caller's prediction; prediction_matched_tokens
  = accepted drafts that came from the prediction (Fireworks `speculation-prompt-tokens` and
  `speculation-prompt-matched-tokens`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

NATIVE_KEYS = (
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
    "draft_stop_counts",
)
# Confidence thresholds whose counterfactual draft counts are reported (see DraftStopCounts).
DRAFT_STOP_GRID = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


def counterfactual_round(
    confidences: Sequence[float], drafted: int, accepted: int, thresholds: Sequence[float]
) -> tuple[list[int], list[int]]:
    """(drafted, accepted) per threshold for one verify round that drafted ``drafted`` tokens with
    the drafter's ``confidences`` (at least ``drafted`` of them) and kept ``accepted``.

    Under threshold t the round stops after the first draft whose confidence is below t (that
    draft is still proposed), never past ``drafted``: what DraftModelProposer does with
    ``confidence_threshold=t``; the accepted prefix is cut to the shorter draft.
    """
    out_drafted: list[int] = []
    out_accepted: list[int] = []
    for t in thresholds:
        n = drafted
        for i in range(drafted - 1):
            if confidences[i] < t:
                n = i + 1
                break
        out_drafted.append(n)
        out_accepted.append(min(accepted, n))
    return out_drafted, out_accepted


@dataclass
class DraftStopCounts:
    """Per-threshold sums over a request's drafting rounds: ``rounds`` verify rounds in which the
    drafter drafted, and per threshold the tokens it would have drafted and had accepted."""

    thresholds: tuple[float, ...]
    rounds: int = 0
    drafted: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.drafted:
            self.drafted = [0] * len(self.thresholds)
        if not self.accepted:
            self.accepted = [0] * len(self.thresholds)

    def record_round(self, drafted: list[int], accepted: list[int]) -> None:
        self.rounds += 1
        for i, (d, a) in enumerate(zip(drafted, accepted, strict=True)):
            self.drafted[i] += d
            self.accepted[i] += a

    def as_dict(self) -> dict[str, Any]:
        return {
            "thresholds": list(self.thresholds),
            "rounds": self.rounds,
            "drafted": list(self.drafted),
            "accepted": list(self.accepted),
        }


@dataclass
class RequestMetrics:
    k: int
    prompt_tokens: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    verify_steps: int = 0
    generated_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    # One entry per verify step; kept because vLLM's "detailed" mode and our tests need them.
    per_step_drafted: list[int] = field(default_factory=list)
    per_step_accepted: list[int] = field(default_factory=list)
    ttft_ms: float | None = None
    inter_token_ms: float | None = None
    total_ms: float | None = None
    prediction_tokens: int | None = None
    prediction_matched_tokens: int | None = None
    # Where the decode time went (not exported): proposing (drafter forwards), scoring (target
    # verification forwards), and everything else. Costs measured in situ differ from isolated
    # micro-benchmarks because target and drafter evict each other's weights from the CPU caches.
    propose_ms: float = 0.0
    score_ms: float = 0.0
    # Counterfactual draft-stop counts (None: not a draft model's request); the per-round values
    # are kept beside per_step_drafted for the same reason.
    draft_stop: DraftStopCounts | None = None
    per_step_stop_drafted: list[list[int]] = field(default_factory=list)
    per_step_stop_accepted: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.accepted_per_position:
            self.accepted_per_position = [0] * self.k
        if not self.drafted_per_position:
            self.drafted_per_position = [0] * self.k

    def record_step(self, drafted: int, accepted: int, emitted: int, from_prediction: int = 0) -> None:
        """Count one verify step: `drafted` proposals, `accepted` kept drafts, `emitted` new tokens."""
        self.verify_steps += 1
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        self.generated_tokens += emitted
        self.per_step_drafted.append(drafted)
        self.per_step_accepted.append(accepted)
        for i in range(min(drafted, self.k)):
            self.drafted_per_position[i] += 1
        for i in range(min(accepted, self.k)):
            self.accepted_per_position[i] += 1
        if from_prediction:
            self.prediction_matched_tokens = (self.prediction_matched_tokens or 0) + min(
                accepted, from_prediction
            )

    def record_draft_stop(self, confidences: Sequence[float], drafted: int, accepted: int) -> None:
        """Add one drafting round's counterfactual counts (see `counterfactual_round`)."""
        stop = self.draft_stop
        if stop is None or drafted == 0:
            return
        would_draft, would_accept = counterfactual_round(confidences, drafted, accepted, stop.thresholds)
        stop.record_round(would_draft, would_accept)
        self.per_step_stop_drafted.append(would_draft)
        self.per_step_stop_accepted.append(would_accept)

    @property
    def hit_rate(self) -> float | None:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else None

    @property
    def mean_accepted_length(self) -> float | None:
        return 1.0 + self.accepted_tokens / self.verify_steps if self.verify_steps else None

    @property
    def overhead_ms(self) -> float | None:
        if self.total_ms is None or self.ttft_ms is None:
            return None
        return self.total_ms - self.ttft_ms - self.propose_ms - self.score_ms

    def per_position_acceptance(self) -> list[float]:
        pairs = zip(self.accepted_per_position, self.drafted_per_position, strict=True)
        return [a / d if d else 0.0 for a, d in pairs]

    def to_native(
        self, request_id: str, arm: str = "live", drafter_version: int | None = None
    ) -> dict[str, Any]:
        return {
            "request_id": request_id,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "verify_steps": self.verify_steps,
            "generated_tokens": self.generated_tokens,
            "accepted_per_position": list(self.accepted_per_position),
            "k": self.k,
            "prompt_tokens": self.prompt_tokens,
            "ttft_ms": self.ttft_ms,
            "inter_token_ms": self.inter_token_ms,
            "total_ms": self.total_ms,
            "arm": arm,
            "drafter_version": drafter_version,
            "draft_stop_counts": self.draft_stop.as_dict()
            if self.draft_stop is not None and self.draft_stop.rounds
            else None,
        }

    @property
    def speculation_generated_tokens(self) -> int:
        """Tokens emitted by verify steps (Fireworks' `speculation-generated-tokens`): all but the
        token sampled from the prefill."""
        return max(self.generated_tokens - 1, 0)

    def fireworks_acceptance(self) -> str:
        """Fireworks' `speculation-acceptance`: `"position:hits/total"` pairs joined by commas."""
        pairs = zip(self.accepted_per_position, self.drafted_per_position, strict=True)
        return ",".join(f"{i}:{a}/{d}" for i, (a, d) in enumerate(pairs))

    def to_fireworks(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "prompt-tokens": self.prompt_tokens,
            "server-time-to-first-token": (self.ttft_ms or 0.0) / 1000.0,
            "server-processing-time": (self.total_ms or 0.0) / 1000.0,
        }
        if self.k >= 1:
            out["speculation-generated-tokens"] = self.speculation_generated_tokens
            out["speculation-acceptance"] = self.fireworks_acceptance()
        if self.prediction_tokens is not None:
            out["speculation-prompt-tokens"] = self.prediction_tokens
            out["speculation-prompt-matched-tokens"] = self.prediction_matched_tokens or 0
        return out

    def to_vllm(self, detailed: bool = False) -> dict[str, Any]:
        hist = [0] * (self.k + 1)
        for a in self.per_step_accepted:
            hist[min(a, self.k)] += 1
        out: dict[str, Any] = {
            "num_spec_steps": self.verify_steps,
            "num_draft_tokens": self.drafted_tokens,
            "num_accepted_draft_tokens": self.accepted_tokens,
            "draft_acceptance_rate": self.hit_rate,
            "mean_acceptance_length": self.mean_accepted_length,
            "acceptance_histogram": hist,
        }
        if detailed:
            out["per_step_drafted"] = list(self.per_step_drafted)
            out["per_step_accepted"] = list(self.per_step_accepted)
        return out


def replay_greedy_rounds(
    agreement: Sequence[bool],
    k: int,
    stop_after: int | None = None,
    guess_ends: Sequence[bool] | None = None,
) -> RequestMetrics:
    """The token counts greedy draft-model speculation at draft length ``k`` gives on one request,
    replayed from teacher-forced agreement instead of decoded.

    ``agreement[j]`` says whether the drafter's argmax for output position j, given the prompt and
    the target's output before j, equals the target's token there; ``len(agreement)`` is the
    request's ``max_new_tokens`` (``agreement[0]`` is never read: the prefill emits the first
    token). Why this is exact: while every draft of a round is accepted, the drafter's context
    equals the target's output, so each draft is its teacher-forced argmax; the first disagreement
    ends the round and the target's own token continues from the target's output again. Drafts are
    capped as the decoder caps them, never past ``max_new_tokens`` (requests without an end-of-text
    stop). Lets a benchmark score drafters on thousands of positions with one forward pass each.

    Requests ended by stop strings: ``stop_after`` is the output length at which the target's text
    completes one (the request ends with the round that gets there), and ``guess_ends[j]`` whether
    the drafter's guess at j completes one, right or wrong; the decoder drafts nothing after such a
    guess. Accepted tokens and rounds stay exact; drafts the drafter makes after a wrong guess in
    the same round are its own continuation, which agreement cannot show, and the decoder may drop
    some of them too, so there the replayed drafted count is an upper bound (the hit rate a lower
    one).
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    length = len(agreement)
    end = length if stop_after is None else min(stop_after, length)
    metrics = RequestMetrics(k=k, generated_tokens=1 if agreement else 0)
    done = 1
    while done < end:
        drafted = min(k, length - done - 1)
        if guess_ends is not None:
            for j in range(done, done + drafted):
                if guess_ends[j]:
                    drafted = j - done + 1
                    break
                if not agreement[j]:
                    break  # later drafts are the drafter's own continuation: not known here
        accepted = 0
        while accepted < drafted and agreement[done + accepted]:
            accepted += 1
        metrics.record_step(drafted, accepted, accepted + 1)
        done += accepted + 1
    return metrics
