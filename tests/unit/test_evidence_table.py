"""bench/evidence.py gathers figures from result files; it never invents one."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _evidence():
    spec = importlib.util.spec_from_file_location("bench_evidence", ROOT / "bench" / "evidence.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_evidence"] = module
    spec.loader.exec_module(module)
    return module


def test_figures_found_nested_and_in_drafters_table_form(tmp_path: Path) -> None:
    ev = _evidence()
    (tmp_path / "reliability.json").write_text(json.dumps({"tenants": {"idor_probes": 640, "idor_leaks": 0}}))
    (tmp_path / "drafters.json").write_text(
        json.dumps({"after_action_speedup_vs_nospec": {"value": 0.93, "target": ">= 1"}})
    )
    report = ev.gather(ev.load_results(tmp_path))
    assert report["idor_probes"]["value"] == 640 and report["idor_probes"]["meets_target"] is True
    assert report["idor_leaks"]["meets_target"] is True
    assert report["after_action_speedup_vs_nospec"]["value"] == 0.93
    assert report["after_action_speedup_vs_nospec"]["meets_target"] is False
    # Never filled in: a figure no file reports has no value and says why.
    assert report["fleet_capacity_requests_per_s"]["value"] is None
    assert "not measured" in report["fleet_capacity_requests_per_s"]["error"]


def test_one_nonzero_heldout_overlap_anywhere_fails_the_table(tmp_path: Path) -> None:
    ev = _evidence()
    (tmp_path / "traffic.json").write_text(json.dumps({"phases": [{"heldout_prompt_overlap": 0}]}))
    (tmp_path / "drafters_realign.json").write_text(json.dumps({"eval": {"heldout_prompt_overlap": 3}}))
    report = ev.gather(ev.load_results(tmp_path))
    entry = report["heldout_prompt_overlap"]
    assert entry["value"] == 3 and entry["meets_target"] is False
    assert entry["figures_reporting"] == 2
    assert ev.main(["--results", str(tmp_path)]) == 1
    assert json.loads((tmp_path / "evidence.json").read_text())["heldout_prompt_overlap"]["value"] == 3
