"""The demo's summary of mixed phases: stage names from the mix, the no-speculation cost of a mix
from each domain's calibration, and the partial-shift benchmark's figures from a summary."""

from __future__ import annotations

from typing import Any

import pytest

from bench.drafters_partial import figures
from workers.demo import Observed, heldout_drops, mix_label, nospec_ms_per_token, per_category_figures
from workers.serve.traffic import Group, Phase, PhaseReport, RequestResult


def _report(by_domain: dict[str, Group]) -> PhaseReport:
    return PhaseReport(
        name="p",
        requests=0,
        errors=0,
        hit_rate=None,
        tokens_per_s=0.0,
        latency_p50_s=None,
        latency_p95_s=None,
        ms_per_token=None,
        wall_s=1.0,
        completion_tokens=0,
        drafted_tokens=0,
        accepted_tokens=0,
        by_domain=by_domain,
    )


def test_stages_are_named_by_their_mix() -> None:
    assert mix_label(Phase(name="a", mix={"prose": 1.0}, requests=1)) == "prose"
    half = Phase(name="b", mix={"structured": 0.5, "prose": 0.5}, requests=1)
    assert mix_label(half) == "50% prose + 50% structured"
    mostly = Phase(name="c", mix={"prose": 0.25, "code": 0.75}, requests=1)
    assert mix_label(mostly) == "75% code + 25% prose"


def test_the_no_speculation_cost_of_a_mix_weighs_each_domain_by_its_tokens() -> None:
    calibration = {
        "prose": _report({}),
        "structured": _report({}),
    }
    calibration["prose"].ms_per_token = 30.0
    calibration["structured"].ms_per_token = 10.0
    mixed = _report({"prose": Group(completion_tokens=300), "structured": Group(completion_tokens=100)})
    assert nospec_ms_per_token(mixed, calibration) == pytest.approx((30.0 * 300 + 10.0 * 100) / 400)
    single = _report({"prose": Group(completion_tokens=50)})
    assert nospec_ms_per_token(single, calibration) == pytest.approx(30.0)
    # A domain never calibrated leaves no fair denominator.
    code = _report({"prose": Group(completion_tokens=50), "code": Group(completion_tokens=5)})
    assert nospec_ms_per_token(code, calibration) is None
    assert nospec_ms_per_token(_report({}), calibration) is None


def test_partial_shift_figures_come_from_the_per_category_stages() -> None:
    summary = {
        "decision": "promote",
        "shift_to_promotion_s": 120.5,
        "stages": {"before_shift": {"what": "generic drafter on prose"}},
        "per_category": {
            "before_shift": {"prose": {"hit_rate": 0.26, "requests": 90}},
            "after_shift_stale": {"prose": {"hit_rate": 0.25}, "structured": {"hit_rate": 0.04}},
            "after_realignment": {"structured": {"hit_rate": 0.7}},
            "after_promotion_live": {
                "prose": {"hit_rate": 0.245, "speedup_vs_nospec": 1.1},
                "structured": {"hit_rate": 0.74, "speedup_vs_nospec": 2.0},
            },
        },
        # The held-out probe: identical prompts before the shift and after the promotion.
        "heldout_drop_points_by_domain": {"prose": 2.25, "structured": -60.0},
        "probe_before_shift": {"hit_rate": 0.2, "per_prompt": [("prose", 1, 4)]},
        "paired": {"hit_rate": 0.5, "per_prompt": [("prose", 2, 4)], "speedup_vs_nospec": 1.3},
    }
    out = figures(summary)
    assert out["partial_shift_new_part_hit_rate"] == 0.74
    # The old part's drop is the probe's (identical held-out prompts); the live phases compare
    # different documents and stay beside it.
    assert out["partial_shift_old_part_drop_points"] == 2.25
    assert out["prose_drop_points_live_phases_other_documents"] == pytest.approx(1.5)
    assert "per_prompt" not in out["heldout_probe_after_promotion"]
    assert out["promoted_speedup_vs_nospec_heldout_paired"] is None  # the demo's own key, absent here
    assert (out["structured_hit_rate_stale"], out["prose_hit_rate_after"]) == (0.04, 0.245)
    assert out["structured_speedup_vs_nospec_after"] == 2.0
    assert out["shift_to_promotion_s"] == 120.5
    assert out["stages"] == {"before_shift": "generic drafter on prose"}
    with pytest.raises(RuntimeError, match="boom"):
        figures({"error": "boom"})


class _FakeStatsApi:
    """Answers stats queries with a hit rate that names the query, and records every query."""

    def __init__(self) -> None:
        self.queries: list[dict[str, Any]] = []

    def stats(self, **params: Any) -> dict[str, Any]:
        self.queries.append(params)
        return {"hit_rate": 0.5, "requests": len(self.queries), "drafted_tokens": 8}


def _result(domain: str, arm: str, latency_s: float, tokens: int) -> RequestResult:
    return RequestResult("shift", 0, "r", domain, True, latency_s, completion_tokens=tokens, arm=arm)


def test_per_category_figures_read_each_stage_through_the_category_filter() -> None:
    before_phase = Phase(name="before", mix={"prose": 1.0}, requests=1)
    half = Phase(name="shift", mix={"prose": 0.5, "structured": 0.5}, requests=1)
    calibration = {"prose": _report({}), "structured": _report({})}
    calibration["prose"].ms_per_token = 40.0
    calibration["structured"].ms_per_token = 20.0
    before = _report({"prose": Group(ms_per_token=20.0)})
    after = _report({"prose": Group(ms_per_token=10.0), "structured": Group(ms_per_token=5.0)})
    observed = Observed(
        drift_event={"detected_at": "2026-12-02T08:00:00+00:00"},
        canary={"candidate_version": 3, "decided_at": "2026-12-02T08:05:00+00:00"},
    )
    shift_results = [
        _result("structured", "live", 1.0, 50),  # 20 ms per token: no faster than no speculation
        _result("structured", "canary:3", 0.5, 50),
        _result("prose", "live", 1.0, 40),
    ]
    api = _FakeStatsApi()
    stages = per_category_figures(
        api, [before_phase, half, half], calibration, before, after, observed, 1_764_662_000.0, shift_results
    )
    assert list(stages) == ["before_shift", "after_shift_stale", "after_realignment", "after_promotion_live"]
    assert list(stages["before_shift"]) == ["prose"]
    assert list(stages["after_promotion_live"]) == ["prose", "structured"]
    assert stages["before_shift"]["prose"]["speedup_vs_nospec"] == pytest.approx(2.0)
    assert stages["after_shift_stale"]["structured"]["speedup_vs_nospec"] == pytest.approx(1.0)
    assert stages["after_realignment"]["structured"]["speedup_vs_nospec"] == pytest.approx(2.0)
    assert stages["after_promotion_live"]["structured"]["speedup_vs_nospec"] == pytest.approx(4.0)
    by_stage = {(q["category"], q.get("arm"), q.get("drafter_version"), q.get("start")) for q in api.queries}
    assert ("structured", "canary:3", None, None) in by_stage
    assert ("prose", "live", 3, None) in by_stage
    stale = next(q for q in api.queries if q.get("start") == "2026-12-02T08:00:00+00:00")
    assert stale["end"] == "2026-12-02T08:05:00+00:00" and stale["arm"] == "live"


def test_heldout_drops_compare_the_same_domains_of_both_probes() -> None:
    before = {"by_domain": {"prose": {"hit_rate": 0.30}, "structured": {"hit_rate": 0.05}}}
    after = {"by_domain": {"prose": {"hit_rate": 0.275}, "structured": {"hit_rate": 0.81}}}
    assert heldout_drops(before, after) == {"prose": 2.5, "structured": -76.0}
    # A domain one probe never drafted in has no drop rather than a made-up one.
    assert heldout_drops(before, {"by_domain": {"prose": {"hit_rate": None}}}) == {
        "prose": None,
        "structured": None,
    }
