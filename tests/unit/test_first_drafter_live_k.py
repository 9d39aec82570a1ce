"""A first drafter (no speculating incumbent) goes live at the k its shadow replay says pays best;
a candidate against a speculating incumbent keeps the incumbent's k."""

from __future__ import annotations

from typing import Any

from controlplane.canary.evaluate import live_k_for_a_first_drafter
from controlplane.canary_policy import CanaryPolicy
from controlplane.db.models import Canary


def _shadow(
    *, incumbent_speculates: bool, accepted: list[int], steps: int, cost_ratio: float
) -> dict[str, Any]:
    return {
        "arms": {
            "incumbent": {"speculative": incumbent_speculates, "verify_steps": steps},
            "candidate": {"speculative": True, "accepted_per_position": accepted, "verify_steps": steps},
            "baseline": {"speculative": False},
        },
        "costs": {
            "cost_ratio": 0.1,
            "verify_cost": {"1": 1.05, "2": 1.1, "3": 1.15, "4": 1.2},
            "in_situ": {"candidate": {"cost_ratio": cost_ratio}},
        },
    }


def _canary() -> Canary:
    return Canary(arms={"k": 4, "incumbent_k": 0})


def test_an_expensive_first_drafter_goes_live_at_a_shorter_k() -> None:
    canary = _canary()
    # Positions 3 and 4 rarely accepted and each draft step costs a third of a target step.
    shadow = _shadow(incumbent_speculates=False, accepted=[70, 40, 8, 2], steps=100, cost_ratio=0.33)
    live_k_for_a_first_drafter(canary, shadow, CanaryPolicy(tune_draft_length=True))
    assert canary.arms["k"] in (1, 2)
    assert canary.arms["live_k_source"]["configured_k"] == 4
    assert canary.arms["live_k_source"]["cost_ratio"] == 0.33  # the in-situ measurement wins


def test_a_candidate_against_a_speculating_incumbent_keeps_its_k() -> None:
    canary = _canary()
    shadow = _shadow(incumbent_speculates=True, accepted=[70, 40, 8, 2], steps=100, cost_ratio=0.33)
    live_k_for_a_first_drafter(canary, shadow, CanaryPolicy(tune_draft_length=True))
    assert canary.arms["k"] == 4 and "live_k_source" not in canary.arms


def test_without_k_tuning_the_configured_k_stays() -> None:
    canary = _canary()
    shadow = _shadow(incumbent_speculates=False, accepted=[70, 40, 8, 2], steps=100, cost_ratio=0.33)
    live_k_for_a_first_drafter(canary, shadow, CanaryPolicy(tune_draft_length=False))
    assert canary.arms["k"] == 4
