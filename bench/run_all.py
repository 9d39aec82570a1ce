"""`make bench`: every benchmark in turn; each prints its table and writes bench/results/*.json."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
SCRIPTS = [
    "traffic_repeats.py",
    "ingest.py",
    "fsync_probe.py",
    "dashboard.py",
    "engine.py",
    "draft_stop.py",
    "drift.py",
    "fleet.py",
    "realign.py",
    "domain_ceiling.py",
    "canary.py",
    "drafters.py",
    "eagle.py",
    "models.py",
    "real_model.py",
    "router.py",
    "scrub.py",
    "scrub_cost.py",
    "reliability.py",
    "demo_heldout.py",
    "house.py",
    # Last: gathers the figures above into bench/results/evidence.json.
    "evidence.py",
]


def main() -> int:
    failed = []
    for script in SCRIPTS:
        print(f"\n=== bench/{script} ===", flush=True)
        if subprocess.call([sys.executable, "-u", str(BENCH / script)]) != 0:
            failed.append(script)
    if failed:
        print(f"\nfailed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
