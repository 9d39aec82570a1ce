"""Draft tuning (pure): the expected speed-up of each draft-token count k and the best k, and of
each draft-stop confidence threshold and the threshold to serve."""

from controlplane.speculation_math import leviathan_speedup
from controlplane.tuning.draft_length import (
    DraftLengthPlan,
    DraftLengthRow,
    conditional_acceptance,
    plan_draft_length,
    plan_from_conditional_rates,
)
from controlplane.tuning.draft_stop import (
    DraftStopPlan,
    DraftStopRow,
    SummedDraftStopCounts,
    plan_draft_stop,
    sum_counts,
)

__all__ = [
    "DraftStopPlan",
    "DraftStopRow",
    "SummedDraftStopCounts",
    "plan_draft_stop",
    "sum_counts",
    "DraftLengthPlan",
    "DraftLengthRow",
    "conditional_acceptance",
    "leviathan_speedup",
    "plan_draft_length",
    "plan_from_conditional_rates",
]
