"""The demo's promoted drafter, measured held out: `make demo`'s loop on scenarios/demo.toml, read
for the figures that only prompts the drafter never trained on can give.

    .venv/bin/python bench/demo_heldout.py [--quick]

Runs the demo as a subprocess on its own embedded database (bench.drafters_partial.run_demo) and
keeps, from its summary: ``demo_promoted_hit_rate_heldout`` (the after phase's hit rate: its
documents are reserved for held-out phases, so no trace the drafter trained on came from them),
``demo_promoted_speedup_vs_nospec_heldout`` (prompts of the same reserved documents sent to the
live and the no-speculation arm, pinned, interleaved and warm) and ``heldout_prompt_overlap`` (the
measured requests whose normalised prompt or source document any earlier request of the run sent:
0 is the only honest value). `--quick` is the demo's `--fast` run. Writes
bench/results/demo_heldout.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.drafters_partial import run_demo  # noqa: E402

SCENARIO = ROOT / "scenarios" / "demo.toml"
RESULTS = ROOT / "bench" / "results" / "demo_heldout.json"
KEYS = ("demo_promoted_hit_rate_heldout", "demo_promoted_speedup_vs_nospec_heldout", "heldout_prompt_overlap")


def measure(quick: bool = False) -> dict[str, Any]:
    """Run the demo and return its held-out figures (and the loop's own, for context)."""
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="demo-heldout-") as folder:
        summary = run_demo(quick=quick, var_dir=Path(folder), scenario=SCENARIO, embedded=True)
    if "error" in summary:
        raise RuntimeError(f"the demo failed: {summary['error']}\n{summary.get('_output', '')[-3000:]}")
    out: dict[str, Any] = {key: summary.get(key) for key in KEYS}
    out.update(
        {
            "paired": summary.get("paired"),
            "decision": summary.get("decision"),
            "realigned_hit_rate_canary": summary.get("realigned_hit_rate"),
            "stale_hit_rate": summary.get("stale_hit_rate"),
            "shift_to_promotion_s": summary.get("shift_to_promotion_s"),
            "quick": quick,
            "wall_s": round(time.monotonic() - began, 1),
        }
    )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the demo's --fast run")
    args = parser.parse_args()
    result = measure(quick=args.quick)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    for name, value in result.items():
        print(f"{name:42s} {value}")
    print(f"written to {RESULTS}")
    return 0 if result["decision"] == "promote" and result["heldout_prompt_overlap"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
