"""bench/drafters.py: the table and JSON assembled from stub parts (missing, failing, partial, fine)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
MISSING = "bench/drafters_realign.py does not exist"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_drafters_under_test", ROOT / "bench" / "drafters.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


drafters = _load()

KEYS = {
    "realigned_structured_hit_rate",
    "prose_hit_rate_drop_points",
    "realigned_share_of_measured_ceiling",
    "realigned_share_of_analytic_ceiling",
    "partial_shift_new_part_hit_rate",
    "partial_shift_old_part_drop_points",
    "day0_first_promotion_s",
    "day0_speedup_vs_nospec",
    "unprofitable_detected_requests",
    "after_action_speedup_vs_nospec",
    "tuned_threshold_speedup_gain_stale",
    "tuned_threshold_speedup_gain_realigned",
}


def ok(part: str, **figures: object) -> object:
    return drafters.PartOutcome(part, "ok", figures=dict(figures), wall_s=1.0)


def test_every_figure_is_reported_with_its_target_and_whether_it_meets_it() -> None:
    outcomes = {
        "realign": ok(
            "realign",
            realigned_structured_hit_rate=0.87,
            prose_hit_rate_drop_points=3.5,  # over its bound of 3
            realigned_share_of_measured_ceiling=0.75,  # exactly on the bound: met
            realigned_share_of_analytic_ceiling=0.6,
            extra_detail=[1, 2],
        ),
        "partial": ok("partial", partial_shift_new_part_hit_rate=0.79, partial_shift_old_part_drop_points=1),
        "day0": ok("day0", day0_first_promotion_s=412, day0_speedup_vs_nospec=1.6),
        "pays": ok("pays", unprofitable_detected_requests=2000, after_action_speedup_vs_nospec=0.98),
        "threshold": ok(
            "threshold", tuned_threshold_speedup_gain_stale=1.2, tuned_threshold_speedup_gain_realigned=1.0
        ),
    }
    report = drafters.assemble(outcomes, quick=True)

    assert set(report) == KEYS | {"parts"}
    met = {key: report[key]["meets_target"] for key in KEYS}
    assert met == {
        "realigned_structured_hit_rate": True,
        "prose_hit_rate_drop_points": False,
        "realigned_share_of_measured_ceiling": True,
        "realigned_share_of_analytic_ceiling": None,  # printed beside it, no target
        "partial_shift_new_part_hit_rate": False,
        "partial_shift_old_part_drop_points": True,
        "day0_first_promotion_s": True,
        "day0_speedup_vs_nospec": None,  # reported without a target
        "unprofitable_detected_requests": True,
        "after_action_speedup_vs_nospec": False,
        "tuned_threshold_speedup_gain_stale": True,
        "tuned_threshold_speedup_gain_realigned": True,
    }
    assert report["realigned_structured_hit_rate"] == {
        "value": 0.87,
        "target": ">= 0.85",
        "meets_target": True,
        "part": "realign",
    }
    assert report["day0_first_promotion_s"]["target"] == "<= 600"
    assert report["day0_speedup_vs_nospec"]["target"] is None
    assert report["parts"]["realign"]["detail"]["extra_detail"] == [1, 2]
    assert report["parts"]["realign"]["quick"] is True
    json.dumps(report)  # what main() writes

    table = drafters.format_table(report)
    rows = {line.split()[0]: line for line in table.splitlines()}
    assert "NO" in rows["prose_hit_rate_drop_points"].split()
    assert "yes" in rows["realigned_structured_hit_rate"].split()
    assert "0.87" in rows["realigned_structured_hit_rate"]


def test_a_missing_or_failed_part_is_reported_and_the_others_still_count() -> None:
    outcomes = {
        "realign": drafters.PartOutcome(
            "realign", "missing", error="bench/drafters_realign.py does not exist"
        ),
        "partial": drafters.PartOutcome("partial", "failed", error="RuntimeError: no traces"),
        "day0": ok("day0", day0_first_promotion_s=700),  # day0_speedup_vs_nospec left out
        "pays": ok("pays", unprofitable_detected_requests="many", after_action_speedup_vs_nospec=math.nan),
        # threshold not selected (--only)
    }
    report = drafters.assemble(outcomes)

    assert set(report) == KEYS | {"parts"}
    for key in (
        "realigned_structured_hit_rate",
        "prose_hit_rate_drop_points",
        "realigned_share_of_measured_ceiling",
    ):
        assert report[key]["value"] is None and report[key]["meets_target"] is None
        assert report[key]["error"] == f"missing: {MISSING}"
    assert report["partial_shift_new_part_hit_rate"]["error"] == "failed: RuntimeError: no traces"
    assert report["day0_first_promotion_s"]["meets_target"] is False
    assert "error" not in report["day0_first_promotion_s"]
    assert report["day0_speedup_vs_nospec"]["error"] == "the day0 part returned no day0_speedup_vs_nospec"
    assert report["unprofitable_detected_requests"]["error"] == "not a finite number: 'many'"
    assert report["after_action_speedup_vs_nospec"]["value"] is None
    assert report["tuned_threshold_speedup_gain_stale"]["error"] == "not run (--only)"
    assert set(report["parts"]) == {"realign", "partial", "day0", "pays"}
    assert report["parts"]["partial"]["status"] == "failed"

    table = drafters.format_table(report)
    assert f"missing: {MISSING}" in table
    assert "RuntimeError: no traces" in table


def _stub(folder: Path, part: str, body: str) -> Path:
    path = folder / f"drafters_{part}.py"
    path.write_text(body)
    return path


def test_run_part_imports_by_path_and_turns_every_failure_into_an_outcome(tmp_path: Path) -> None:
    fine = _stub(tmp_path, "realign", "def measure(quick=False):\n    return {'quick': quick, 'x': 1}\n")
    raises = _stub(tmp_path, "partial", "def measure(quick=False):\n    raise ValueError('bad traces')\n")
    broken = _stub(tmp_path, "day0", "import a_module_that_does_not_exist\n")
    wrong = _stub(tmp_path, "pays", "def measure(quick=False):\n    return [1]\n")
    exits = _stub(tmp_path, "threshold", "def measure(quick=False):\n    raise SystemExit(2)\n")

    outcome = drafters.run_part("realign", fine, quick=True)
    assert (outcome.status, outcome.figures) == ("ok", {"quick": True, "x": 1})
    failed = drafters.run_part("partial", raises, quick=False)
    assert (failed.status, failed.error) == ("failed", "ValueError: bad traces")
    assert "bad traces" in (failed.traceback or "")
    assert drafters.run_part("day0", broken, quick=False).error.startswith("ModuleNotFoundError")
    assert (
        drafters.run_part("pays", wrong, quick=False).error
        == "TypeError: measure() returned list, not a dict"
    )
    assert drafters.run_part("threshold", exits, quick=False).status == "failed"
    missing = drafters.run_part("realign", tmp_path / "drafters_nothing.py", quick=False)
    assert missing.status == "missing" and "does not exist" in (missing.error or "")


def test_main_runs_the_chosen_parts_in_order_and_writes_the_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    order = tmp_path / "order.txt"
    for part in ("threshold", "realign"):
        _stub(
            tmp_path,
            part,
            f"def measure(quick=False):\n    open({str(order)!r}, 'a').write('{part} ')\n"
            f"    return {{'realigned_structured_hit_rate': 0.9, 'quick': quick}}\n",
        )
    monkeypatch.setattr(drafters, "BENCH", tmp_path)
    out = tmp_path / "drafters.json"

    status = drafters.main(["--quick", "--only", "threshold,realign,partial", "--out", str(out)])

    assert status == 1  # the partial module is missing
    assert order.read_text() == "realign threshold "
    report = json.loads(out.read_text())
    assert set(report) == KEYS | {"parts"}
    assert report["realigned_structured_hit_rate"]["meets_target"] is True
    assert report["parts"]["realign"]["detail"]["quick"] is True
    assert report["parts"]["partial"]["status"] == "missing"
    assert report["day0_first_promotion_s"]["error"] == "not run (--only)"
    printed = capsys.readouterr().out
    assert "realigned_structured_hit_rate" in printed and "drafters_partial.py does not exist" in printed


def test_only_names_known_parts() -> None:
    assert drafters.parse_only("pays, realign") == ("realign", "pays")
    with pytest.raises(argparse.ArgumentTypeError, match="unknown part"):
        drafters.parse_only("realign,nonsense")


def _load_part(stem: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"bench_{stem}_under_test", ROOT / "bench" / f"{stem}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_after_action_speedup_pools_pairs_and_its_interval_can_fall_below_one() -> None:
    pays = _load_part("drafters_pays")
    Pair = pays.PairTiming
    # Live faster on every prompt by 1.25x per token: the interval sits above 1 around 1.25.
    faster = [Pair(0.5 + 0.01 * i, 20, (0.5 + 0.01 * i) / 1.25, 20) for i in range(40)]
    out = pays.interleaved_speedup(faster, seed=1)
    assert out["speedup"] == pytest.approx(1.25, abs=1e-3)
    assert 1.2 < out["interval_95"][0] <= out["speedup"] <= out["interval_95"][1] < 1.3
    assert out["share_of_prompts_live_faster"] == 1.0 and out["pairs"] == 40
    # Live slower by 1.25x: the same figure comes out below 1, interval and all.
    slower = [Pair(p.live_s, 20, p.nospec_s, 20) for p in faster]
    worse = pays.interleaved_speedup(slower, seed=1)
    assert worse["speedup"] == pytest.approx(0.8, abs=1e-3) and worse["interval_95"][1] < 1.0
    assert worse["share_of_prompts_live_faster"] == 0.0
    # Pooled per token, not averaged per prompt: a long slow prompt weighs by its tokens.
    mixed = pays.interleaved_speedup([Pair(1.0, 10, 0.5, 10), Pair(1.0, 40, 2.0, 40)], seed=1)
    assert mixed["speedup"] == pytest.approx(2.0 / 2.5)
    # Failed requests (no tokens) leave the figure rather than divide by zero.
    assert pays.interleaved_speedup([Pair(1.0, 0, 1.0, 10)])["speedup"] is None


def test_pin_keys_land_on_their_arms_by_the_routers_own_rule() -> None:
    pays = _load_part("drafters_pays")
    from controlplane.router.arms import client_key, pick_arm
    from controlplane.router.follower import ArmSpec

    arms = (ArmSpec("live", 0.95, 3), ArmSpec("baseline", 0.05, None))
    keys = pays.pin_keys(arms, ["live", "baseline"])
    for arm, user in keys.items():
        assert pick_arm(arms, client_key({"user": user}, {}, None, "rid")).name == arm
    with pytest.raises(ValueError, match="canary:4"):
        pays.pin_keys((*arms, ArmSpec("canary:4", 0.0, 4)), ["live", "canary:4"])


def test_the_threshold_gain_is_reported_only_where_a_threshold_was_chosen() -> None:
    threshold = _load_part("drafters_threshold")
    cases = {
        "stale": {"chosen_threshold": 0.9, "gain": 1.31},
        "realigned": {
            "chosen_threshold": None,
            "gain": None,
            "gain_absent_reason": "no threshold chosen: no threshold beats no threshold by 2%",
        },
        threshold.MUST_CHOOSE: {"chosen_threshold": None, "gain": None},
    }
    figures = threshold.gain_figures(cases)
    assert figures["tuned_threshold_speedup_gain_stale"] == 1.31
    assert figures["tuned_threshold_speedup_gain_realigned"] is None
    assert "beats" in figures["tuned_threshold_speedup_gain_realigned_absent_reason"]
    assert "tuned_threshold_speedup_gain_stale_absent_reason" not in figures
    assert figures["tuned_threshold_must_choose_case_chose"] is False
    cases[threshold.MUST_CHOOSE] = {"chosen_threshold": 0.8, "gain": 0.97}
    figures = threshold.gain_figures(cases)
    assert figures["tuned_threshold_must_choose_case_chose"] is True
    assert figures[f"tuned_threshold_speedup_gain_{threshold.MUST_CHOOSE}"] == 0.97


def test_the_no_speculation_arm_is_the_standing_share_or_the_live_arm_once_speculation_is_off() -> None:
    pays = _load_part("drafters_pays")
    live = {"arm": "live", "weight": 0.95, "speculation": "draft_model", "k": 1, "drafter_version": 2}
    baseline = {"arm": "baseline", "weight": 0.05, "speculation": "disabled", "k": 0}
    state = pays.ServingState.of({"config_version": "v1", "arms": [live, baseline]}, warmup=3)
    assert state.nospec == "baseline" and set(state.keys) == {"live", "baseline"} and state.warm_left == 3
    off = {**live, "speculation": "disabled", "k": 0, "weight": 1.0, "drafter_version": None}
    alone = pays.ServingState.of({"config_version": "v2", "arms": [off]}, warmup=0)
    assert alone.nospec == "live" and set(alone.keys) == {"live"}
    with pytest.raises(RuntimeError, match="no arm without speculation"):
        pays.ServingState.of({"config_version": "v3", "arms": [live]}, warmup=0)
    # Server timings split a pair into decoding after the first token and the prefill.
    base_reply = pays.Served(1.0, 16, 200.0, 900.0)
    live_reply = pays.Served(0.9, 16, 260.0, 760.0, drafted=15, accepted=9)
    parts = pays.split_pairs([(base_reply, live_reply)])
    assert parts["server_decode"][0].ratio == pytest.approx(700.0 / 500.0)
    assert parts["server_prefill"][0].ratio == pytest.approx(200.0 / 260.0)
    assert pays.split_pairs([(pays.Served(1.0, 16, None, None), live_reply)])["server_decode"] == []
