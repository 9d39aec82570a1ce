"""Draft-length tuning: the expected speed-up of each draft-token count k and the best k (pure)."""

from controlplane.tuning.draft_length import (
    DraftLengthPlan,
    DraftLengthRow,
    conditional_acceptance,
    leviathan_speedup,
    plan_draft_length,
    plan_from_conditional_rates,
)

__all__ = [
    "DraftLengthPlan",
    "DraftLengthRow",
    "conditional_acceptance",
    "leviathan_speedup",
    "plan_draft_length",
    "plan_from_conditional_rates",
]
