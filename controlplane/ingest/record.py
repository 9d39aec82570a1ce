"""The one engine-neutral acceptance record every ingest format is normalised into.

Raw counts only: engines define "acceptance rate" differently, so ratios are always derived
from counts here, never stored as the source of truth.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

ARM_LIVE = "live"
ARM_BASELINE = "baseline"  # no speculation (the control arm of a canary)
ARM_CANARY_PREFIX = "canary:"  # canary:<drafter version number>


@dataclass(slots=True)
class AcceptanceRecord:
    """One served request's speculation outcome.

    ``accepted_per_position[i]`` counts the verify steps in which draft position ``i`` was
    accepted (so at least ``i + 1`` tokens were accepted in that step); it is non-increasing
    in ``i``, has one entry per drafted position (length ``k``) and sums to
    ``accepted_tokens`` when every step drafted ``k`` tokens.
    """

    request_id: str
    drafted_tokens: int
    accepted_tokens: int
    verify_steps: int
    generated_tokens: int
    accepted_per_position: list[int] = field(default_factory=list)
    k: int | None = None
    prompt_tokens: int | None = None
    ttft_ms: float | None = None
    inter_token_ms: float | None = None
    total_ms: float | None = None
    arm: str = ARM_LIVE
    drafter_version: int | None = None
    category: str | None = None
    created_at: datetime | None = None  # None: the server stamps the ingest time
    # What drafting would have done under each confidence threshold of a grid:
    # {"thresholds": [...], "rounds": R, "drafted": [...], "accepted": [...]} (engines that count
    # it; validated by controlplane.ingest.formats; the draft-stop tuner's input).
    draft_stop_counts: dict[str, Any] | None = None
    # Provenance, not content: set by the write path when the caller holds the fleet's serving
    # key (only such records steer a canary); no format sets it, and idempotency ignores it.
    from_serving_key: bool = False
    # A record the edge sent as a sample of traffic it also counted in a window aggregate: kept
    # for detail (and the draft-stop tuner), never summed again by rollups, detector or judge.
    counted_in_aggregate: bool = False


class RecordError(ValueError):
    """A record that cannot be normalised; ``field`` names the offending input field."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.message = message
