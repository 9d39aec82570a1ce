"""The native record's ``draft_stop_counts``: accepted as the engine reports it, and every broken
identity refused with a problem naming the field."""

from __future__ import annotations

from typing import Any

import pytest

from controlplane.ingest.formats import BatchValidationError, parse_batch, parse_record


def record(counts: object = None, **changes: Any) -> dict[str, Any]:
    """10 verify steps at k = 4, of which 9 drafted: 36 drafted, 17 accepted."""
    base: dict[str, Any] = {
        "request_id": "r1",
        "drafted_tokens": 36,
        "accepted_tokens": 17,
        "verify_steps": 10,
        "generated_tokens": 28,
        "accepted_per_position": [8, 5, 3, 1],
        "k": 4,
        "arm": "canary:3",
        "draft_stop_counts": counts,
    }
    base.update(changes)
    return base


def counts(**changes: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "thresholds": [0.3, 0.5, 0.8],
        "rounds": 9,
        "drafted": [30, 21, 12],
        "accepted": [16, 14, 10],
    }
    base.update(changes)
    return base


def problem_fields(value: object, **changes: Any) -> list[str]:
    with pytest.raises(BatchValidationError) as info:
        parse_batch({"format": "native", "records": [record(value, **changes)]})
    return [p.field for p in info.value.problems]


def test_counts_are_kept_as_sent_and_null_means_none() -> None:
    parsed = parse_record(record(counts()))
    assert parsed.draft_stop_counts == counts()
    assert parse_record(record(None)).draft_stop_counts is None
    without = record()
    del without["draft_stop_counts"]
    assert parse_record(without).draft_stop_counts is None
    # What the reference engine sends for a request it ran at threshold 0.5: the counts at 0.5
    # are the request's own.
    served = counts(thresholds=[0.5, 0.8], drafted=[36, 20], accepted=[17, 12])
    assert parse_record(record(served)).draft_stop_counts == served


@pytest.mark.parametrize(
    "value,field",
    [
        ([1, 2], "draft_stop_counts"),
        (counts(extra=1), "draft_stop_counts.extra"),
        (counts(thresholds=[]), "draft_stop_counts.thresholds"),
        (counts(thresholds=[0.5, 0.3, 0.8]), "draft_stop_counts.thresholds[1]"),
        (counts(thresholds=[0.3, 0.5, 1.0]), "draft_stop_counts.thresholds[2]"),
        (counts(thresholds=[0.0, 0.5, 0.8]), "draft_stop_counts.thresholds[0]"),
        (counts(thresholds=[0.3, True, 0.8]), "draft_stop_counts.thresholds[1]"),
        (counts(drafted=[30, 21]), "draft_stop_counts.drafted"),
        (counts(accepted=[16, 14, 10, 1]), "draft_stop_counts.accepted"),
        (counts(rounds=-1), "draft_stop_counts.rounds"),
        (counts(rounds=11), "draft_stop_counts.rounds"),  # more rounds than verify steps
        (counts(drafted=[30, 21, 8]), "draft_stop_counts.drafted[2]"),  # below one per round
        (counts(drafted=[37, 21, 12]), "draft_stop_counts.drafted[0]"),  # above drafted_tokens
        (counts(drafted=[30, 31, 12]), "draft_stop_counts.drafted[1]"),  # grows with the threshold
        (counts(accepted=[16, 22, 10]), "draft_stop_counts.accepted[1]"),  # above drafted
        (counts(accepted=[18, 14, 10]), "draft_stop_counts.accepted[0]"),  # above accepted_tokens
        (counts(accepted=[12, 14, 10]), "draft_stop_counts.accepted[1]"),  # grows with the threshold
        (counts(drafted=["30", 21, 12]), "draft_stop_counts.drafted[0]"),
        ({k: v for k, v in counts().items() if k != "accepted"}, "draft_stop_counts.accepted"),
    ],
)
def test_broken_counts_name_the_field(value: object, field: str) -> None:
    assert field in problem_fields(value)


def test_counts_above_rounds_times_k_are_refused() -> None:
    # 9 rounds at k = 2 draft at most 18, whatever the record's own drafted count says.
    fields = problem_fields(
        counts(drafted=[20, 18, 12]), k=2, accepted_per_position=[9, 8], drafted_tokens=36
    )
    assert "draft_stop_counts.drafted[0]" in fields
