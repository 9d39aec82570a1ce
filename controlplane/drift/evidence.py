"""What an alarm (or a status query) reports: the figures an operator needs to judge a drift event."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class DriftEvidence:
    """Evidence for a (possible) drop, measured over the requests since the estimated change point.

    Rates are conditional per-trial acceptance (accepted over tried draft positions);
    ``baseline_rate`` is what the frozen baseline predicts for those same requests (so it follows
    the category mix when the baseline is risk-adjusted). ``statistic`` and ``threshold`` are on
    the detector's log scale; an alarm means ``statistic >= threshold``.
    """

    baseline_rate: float
    current_estimate: float
    drop: float
    position_most_affected: int | None
    baseline_per_position: list[float]
    estimate_per_position: list[float]
    statistic: float
    threshold: float
    records_examined: int
    detection_delay_estimate: int
    component: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DriftEvidence:
        return cls(**data)
