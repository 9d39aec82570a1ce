"""bench/real_model.py's pure parts: arm rotation, paired speed-ups with their interval, the
results merge that lets parts add figures run by run, and the generated structured traffic."""

from __future__ import annotations

import importlib.util
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from workers.corpora import Prompt

ROOT = Path(__file__).resolve().parents[2]


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "bench_real_model_under_test", ROOT / "bench" / "real_model.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


rm = _load()


def test_every_arm_takes_every_position_once_per_rotation() -> None:
    arms = ("a", "b", "c")
    orders = rm.arm_orders(arms, 6)
    assert orders[0] == ["a", "b", "c"] and orders[1] == ["b", "c", "a"]
    for position in range(3):
        assert Counter(order[position] for order in orders) == {"a": 2, "b": 2, "c": 2}
    assert all(sorted(order) == sorted(arms) for order in orders)


def test_paired_speedup_pools_tokens_over_time() -> None:
    T = rm.Timing
    fast = [T(100, 1.0), T(10, 1.0)]
    slow = [T(100, 2.0), T(10, 1.0)]
    result = rm.paired_speedup(fast, slow, resamples=200)
    # Pooled: 110 tokens / 2 s against 110 tokens / 3 s, not the mean of per-prompt ratios (1.5).
    assert result["ratio"] == pytest.approx(1.5)
    assert result["per_prompt_median"] == pytest.approx(1.5)
    assert result["share_of_prompts_faster"] == 0.5
    lo, hi = result["ci95"]
    # Resamples hold prompt 0 only (ratio 2), prompt 1 only (ratio 1) or both: bounded by those.
    assert 1.0 <= lo <= result["ratio"] <= hi <= 2.0


def test_paired_speedup_interval_is_a_point_when_every_prompt_agrees() -> None:
    T = rm.Timing
    fast = [T(n, 1.0) for n in (20, 40, 60)]
    slow = [T(n, 2.0) for n in (20, 40, 60)]
    result = rm.paired_speedup(fast, slow, resamples=100)
    assert result["ratio"] == pytest.approx(2.0)
    assert result["ci95"] == [pytest.approx(2.0), pytest.approx(2.0)]


def test_paired_speedup_refuses_unpaired_timings() -> None:
    with pytest.raises(ValueError, match="paired"):
        rm.paired_speedup([rm.Timing(1, 1.0)], [])


def test_merge_keeps_other_parts_and_replaces_a_rerun_part() -> None:
    first = rm.merge_results({}, "costs", {"target_step_ms": 50.0, "detail": {"repeats": 40}}, 3.0)
    second = rm.merge_results(first, "loop", {"day0_speedup": 1.2}, 10.0)
    assert second["target_step_ms"] == 50.0 and second["day0_speedup"] == 1.2
    assert set(second["parts"]) == {"costs", "loop"}
    assert second["parts"]["costs"]["detail"] == {"repeats": 40}
    assert second["parts"]["loop"]["figures"] == ["day0_speedup"]
    assert "detail" not in second
    third = rm.merge_results(second, "costs", {"target_step_ms": 48.0}, 2.0)
    assert third["target_step_ms"] == 48.0 and third["day0_speedup"] == 1.2
    assert third["parts"]["costs"]["wall_s"] == 2.0
    assert first["target_step_ms"] == 50.0  # the earlier dict is not changed in place


def test_shifted_traffic_is_seeded_and_balanced_over_the_three_tasks() -> None:
    a = rm.shifted_traffic(9, seed=3)
    assert a == rm.shifted_traffic(9, seed=3)
    assert a != rm.shifted_traffic(9, seed=4)
    assert Counter(p.category for p in a) == {"extract_json": 3, "sql": 3, "tool_call": 3}
    for prompt in a:
        roles = [m["role"] for m in prompt.messages]
        # The task, worked turns, then the request.
        assert roles[0] == "system" and roles[-1] == "user" and "assistant" in roles
    assert len({p.messages[-1]["content"] for p in a}) == 9


def test_balanced_takes_kinds_in_turn_and_says_when_the_stream_runs_short() -> None:
    def stream(kinds: str) -> Iterator[Prompt]:
        for i, kind in enumerate(kinds):
            yield Prompt(
                "",
                "",
                "chat_structured",
                "chat_structured",
                str(i),
                kind,
                ({"role": "user", "content": str(i)},),
            )

    picked = rm._balanced(stream("aaaaab"), 4)
    # First 12 of the stream (all six here): b runs out after one, a fills the rest.
    assert [(p.category, p.messages[0]["content"]) for p in picked] == [
        ("a", "0"),
        ("b", "5"),
        ("a", "1"),
        ("a", "2"),
    ]
    with pytest.raises(ValueError, match="2 of 3"):
        rm._balanced(stream("ab"), 3)


def test_a_rerun_part_drops_the_figures_it_no_longer_gives() -> None:
    first = rm.merge_results({}, "comparison", {"old_key": 1.0, "kept": 2.0}, 1.0)
    second = rm.merge_results(first, "comparison", {"kept": 3.0}, 1.0)
    assert "old_key" not in second and second["kept"] == 3.0


def test_part_modules_are_found_and_loaded_by_name(tmp_path: Path) -> None:
    (tmp_path / "real_model_part_loop.py").write_text(
        "def measure(bench):\n    return {'day0_speedup': bench}\n"
    )
    (tmp_path / "real_model_part_bare.py").write_text("X = 1\n")
    (tmp_path / "real_model_loop_offline.py").write_text("")  # a script of its own, not a part
    found = rm.part_files(tmp_path)
    assert set(found) == {"loop", "bare"}
    assert rm.load_part("loop", tmp_path)(7) == {"day0_speedup": 7}
    assert rm.load_part("costs", tmp_path) is rm.part_costs
    with pytest.raises(TypeError, match="measure"):
        rm.load_part("bare", tmp_path)


def test_a_missing_model_names_the_command_that_imports_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert rm.main(["--model", str(tmp_path / "absent"), "--out", str(tmp_path / "r.json")]) == 2
    assert "make smollm2" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()


def test_a_failed_part_leaves_no_figures_of_an_earlier_run() -> None:
    first = rm.merge_results({}, "fidelity", {"greedy_identical": 1, "detail": {"prompts": 8}}, 1.0)
    failed = rm.record_failure(first, "fidelity", RuntimeError("transformers missing"), 0.5)
    assert "greedy_identical" not in failed
    entry = failed["parts"]["fidelity"]
    assert entry["status"] == "failed" and entry["error"] == "RuntimeError: transformers missing"
    assert entry["figures"] == [] and first["parts"]["fidelity"]["status"] == "ok"
