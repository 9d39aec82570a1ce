"""A partial shift end to end: the demo on scenarios/partial_shift.toml (half the traffic moves to
structured requests, half stays prose), measured per request category.

    python bench/drafters_partial.py [--quick]

Runs `python -m workers.demo --scenario scenarios/partial_shift.toml --summary ...` as a
subprocess (real API, worker, beat, reference server and router, like the end-to-end test; on the
embedded SQLite default unless CONTROLPLANE_DATABASE_URL says otherwise) and reads the per-category
hit rates the demo took from the stats API's category filter. The figures that decide: the new
part's hit rate once the realigned drafter serves it, and how many points the old part lost
against the generic drafter before the shift. `--quick` is the demo's `--fast` run (a few
minutes); the full run sends the scenario's own request counts. Writes
bench/results/drafters_partial.json.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SCENARIO = ROOT / "scenarios" / "partial_shift.toml"
RESULTS = ROOT / "bench" / "results" / "drafters_partial.json"
TIMEOUT_S = 3600


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_demo(
    *,
    quick: bool,
    var_dir: Path,
    scenario: Path = SCENARIO,
    embedded: bool = False,
    timeout_s: float = TIMEOUT_S,
) -> dict[str, Any]:
    """The demo's summary on ``scenario`` (its output tail under "_output"), run in ``var_dir``;
    ``embedded`` drops CONTROLPLANE_* settings so it runs on its own SQLite database there."""
    summary = var_dir / "summary.json"
    inherited = {k: v for k, v in os.environ.items() if not (embedded and k.startswith("CONTROLPLANE_"))}
    env = {
        **inherited,
        "CONTROLPLANE_ENVIRONMENT": inherited.get("CONTROLPLANE_ENVIRONMENT", "development"),
        "CONTROLPLANE_VAR_DIR": str(var_dir / "var"),
        "CONTROLPLANE_ARTIFACT_DIR": str(var_dir / "var" / "artifacts"),
        "CONTROLPLANE_API_PORT": str(_free_port()),
    }
    command = [
        sys.executable,
        "-m",
        "workers.demo",
        "--scenario",
        str(scenario),
        "--summary",
        str(summary),
        "--serve-port",
        str(_free_port()),
        "--router-port",
        str(_free_port()),
        *(["--fast"] if quick else []),
    ]
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    if not summary.exists():
        raise RuntimeError(f"the demo wrote no summary:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(summary.read_text())
    result["_output"] = proc.stdout[-6000:] + proc.stderr[-3000:]
    return result


def figures(summary: dict[str, Any]) -> dict[str, Any]:
    """The partial shift's figures from a demo summary: per category and stage, from the stats API."""
    if "error" in summary:
        raise RuntimeError(f"the demo failed: {summary['error']}")
    stages = summary.get("per_category") or {}

    def hit(stage: str, category: str) -> float | None:
        value = (stages.get(stage) or {}).get(category, {}).get("hit_rate")
        return float(value) if isinstance(value, int | float) else None

    def speedup(stage: str, category: str) -> float | None:
        value = (stages.get(stage) or {}).get(category, {}).get("speedup_vs_nospec")
        return float(value) if isinstance(value, int | float) else None

    prose_before, prose_after = hit("before_shift", "prose"), hit("after_promotion_live", "prose")
    structured_stale = hit("after_shift_stale", "structured")
    structured_after = hit("after_promotion_live", "structured")
    # The old part's drop on identical held-out prompts: the generic drafter's prose hit rate
    # probed before the shift minus the promoted drafter's on the very same prompts (documents
    # reserved for held-out phases, never traced). The live phases' figures compare different
    # documents (the after phase draws only reserved ones), so they stay beside it as context.
    drop = (summary.get("heldout_drop_points_by_domain") or {}).get("prose")
    live_drop = None
    if prose_before is not None and prose_after is not None:
        live_drop = round((prose_before - prose_after) * 100, 2)
    return {
        "partial_shift_new_part_hit_rate": structured_after,
        "partial_shift_old_part_drop_points": drop,
        "prose_drop_points_live_phases_other_documents": live_drop,
        "heldout_probe_before_shift": _probe(summary.get("probe_before_shift")),
        "heldout_probe_after_promotion": _probe(summary.get("paired")),
        "prose_hit_rate_before": prose_before,
        "prose_hit_rate_stale": hit("after_shift_stale", "prose"),
        "prose_hit_rate_after": prose_after,
        "structured_hit_rate_stale": structured_stale,
        "structured_hit_rate_realigned_canary": hit("after_realignment", "structured"),
        "structured_hit_rate_after": structured_after,
        "prose_speedup_vs_nospec_after": speedup("after_promotion_live", "prose"),
        "structured_speedup_vs_nospec_after": speedup("after_promotion_live", "structured"),
        # The after phase draws from documents reserved for held-out phases: how many of its
        # requests (and of the paired ones) any earlier request of the run had sent (0: held out).
        "heldout_prompt_overlap": summary.get("heldout_prompt_overlap"),
        "promoted_speedup_vs_nospec_heldout_paired": summary.get("demo_promoted_speedup_vs_nospec_heldout"),
        "shift_to_promotion_s": summary.get("shift_to_promotion_s"),
        "detection_delay_requests": summary.get("detection_delay_requests"),
        "decision": summary.get("decision"),
        "decision_reason": summary.get("decision_reason"),
        "chosen_k": summary.get("chosen_k"),
        "stages": {name: stage.get("what") for name, stage in (summary.get("stages") or {}).items()},
    }


def _probe(probe: Any) -> dict[str, Any] | None:
    """A held-out probe's figures without its per-prompt list."""
    if not isinstance(probe, dict):
        return None
    return {k: v for k, v in probe.items() if k != "per_prompt"}


def measure(quick: bool = False) -> dict[str, Any]:
    """Run the demo on the partial-shift scenario and return its per-category figures."""
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="drafters-partial-") as folder:
        summary = run_demo(quick=quick, var_dir=Path(folder))
    out = figures(summary)
    out.update({"quick": quick, "wall_s": round(time.monotonic() - began, 1), "scenario": str(SCENARIO.name)})
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the demo's --fast run")
    args = parser.parse_args()
    result = measure(quick=args.quick)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    for name, value in result.items():
        print(f"{name:40s} {value}")
    print(f"written to {RESULTS}")
    return 0 if result["decision"] == "promote" else 1


if __name__ == "__main__":
    raise SystemExit(main())
