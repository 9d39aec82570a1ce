"""The drafter figures in one table: every measurement module of the drafter work, run in order.

Each part is a module beside this one, ``bench/drafters_<part>.py``, exposing
``measure(quick: bool = False) -> dict`` of figures (plus whatever detail it likes):

- realign: the realigned drafter on the structured shift (hit rate, prose drop, share of the ceiling
  measured by a never-missing arm in the same run, and the analytic one beside it)
- partial: a shift of part of the traffic (the new part's hit rate, the old part's drop)
- day0: a deployment without a drafter (first promotion time, speed-up over no speculation)
- pays: a drafter that does not pay (requests to detect it, speed-up after the action)
- threshold: the tuned draft-stop threshold (speed-up gain on a stale and a realigned drafter)

Parts are imported by file path and run in this process one after another; a part whose module is
missing, fails to import, raises, or returns something other than a dict is reported as such (its
error text in the table and the JSON) and the others still run. Prints one table of every figure
beside its target and writes bench/results/drafters.json: one entry per figure (value, target,
``meets_target``: true / false, or null when the figure has no target or no value; ``error`` when
it has no value) and ``parts`` (per part: status, error, wall time, and what ``measure`` returned).

Usage: .venv/bin/python bench/drafters.py [--quick] [--only realign,partial,day0,pays,threshold]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
RESULTS = BENCH / "results"
PARTS = ("realign", "partial", "day0", "pays", "threshold")

Measure = Callable[..., Any]


@dataclass(frozen=True)
class Figure:
    """One figure: the part that measures it and its target (``op`` ">=" or "<="; None: reported only)."""

    key: str
    part: str
    op: str | None = None
    bound: float | None = None

    @property
    def target(self) -> str | None:
        return f"{self.op} {self.bound:g}" if self.op is not None and self.bound is not None else None

    def meets(self, value: float) -> bool | None:
        if self.op is None or self.bound is None:
            return None
        return value >= self.bound if self.op == ">=" else value <= self.bound


FIGURES = (
    Figure("realigned_structured_hit_rate", "realign", ">=", 0.85),
    Figure("prose_hit_rate_drop_points", "realign", "<=", 3),
    Figure("realigned_share_of_measured_ceiling", "realign", ">=", 0.75),
    Figure("realigned_share_of_analytic_ceiling", "realign"),
    Figure("partial_shift_new_part_hit_rate", "partial", ">=", 0.80),
    Figure("partial_shift_old_part_drop_points", "partial", "<=", 3),
    Figure("day0_first_promotion_s", "day0", "<=", 600),
    Figure("day0_speedup_vs_nospec", "day0"),
    Figure("unprofitable_detected_requests", "pays", "<=", 2000),
    Figure("after_action_speedup_vs_nospec", "pays", ">=", 1.0),
    Figure("tuned_threshold_speedup_gain_stale", "threshold", ">=", 1.0),
    Figure("tuned_threshold_speedup_gain_realigned", "threshold", ">=", 1.0),
)


@dataclass
class PartOutcome:
    """What running one part gave: status "ok", "missing" or "failed"."""

    part: str
    status: str
    figures: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    traceback: str | None = None
    wall_s: float = 0.0
    load_average_1m_after: float | None = None


def module_path(part: str) -> Path:
    return BENCH / f"drafters_{part}.py"


def load_measure(path: Path) -> Measure:
    """The ``measure`` function of the module at ``path`` (imported by file path, not by package)."""
    name = f"bench_drafters_part_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling inside the part look their module up here
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    measure = getattr(module, "measure", None)
    if not callable(measure):
        raise TypeError(f"{path.name} has no measure(quick: bool = False) -> dict")
    return measure


def run_part(part: str, path: Path, *, quick: bool) -> PartOutcome:
    """Import and run one part; never raises (but for Ctrl-C): a failure is the outcome."""
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    if not path.is_file():
        return PartOutcome(part, "missing", error=f"{shown} does not exist")
    started = time.perf_counter()
    try:
        result = load_measure(path)(quick=quick)
        if not isinstance(result, dict):
            raise TypeError(f"measure() returned {type(result).__name__}, not a dict")
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # SystemExit from a part's own argument parsing included
        return PartOutcome(
            part,
            "failed",
            error=f"{type(exc).__name__}: {exc}",
            traceback=traceback.format_exc(limit=8),
            wall_s=round(time.perf_counter() - started, 1),
            load_average_1m_after=round(os.getloadavg()[0], 2),
        )
    return PartOutcome(
        part,
        "ok",
        figures=result,
        wall_s=round(time.perf_counter() - started, 1),
        load_average_1m_after=round(os.getloadavg()[0], 2),
    )


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def assemble(outcomes: Mapping[str, PartOutcome], *, quick: bool = False) -> dict[str, Any]:
    """The JSON report: one entry per figure of FIGURES, then ``parts``. A part absent from
    ``outcomes`` was not selected (``--only``)."""
    report: dict[str, Any] = {}
    for fig in FIGURES:
        entry: dict[str, Any] = {"value": None, "target": fig.target, "meets_target": None, "part": fig.part}
        outcome = outcomes.get(fig.part)
        if outcome is None:
            entry["error"] = "not run (--only)"
        elif outcome.status != "ok":
            entry["error"] = f"{outcome.status}: {outcome.error}"
        elif fig.key not in outcome.figures or outcome.figures[fig.key] is None:
            entry["error"] = f"the {fig.part} part returned no {fig.key}"
        elif (value := _number(outcome.figures[fig.key])) is None:
            entry["error"] = f"not a finite number: {outcome.figures[fig.key]!r}"
        else:
            entry["value"] = outcome.figures[fig.key]
            entry["meets_target"] = fig.meets(value)
        report[fig.key] = entry
    report["parts"] = {
        part: {
            "status": o.status,
            "error": o.error,
            "traceback": o.traceback,
            "wall_s": o.wall_s,
            "quick": quick,
            "load_average_1m_after": o.load_average_1m_after,
            "module": module_path(part).name,
            "detail": o.figures,
        }
        for part, o in outcomes.items()
    }
    return report


def _shown(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, int):
        return str(value)
    return f"{value:.4g}"


def format_table(report: Mapping[str, Any]) -> str:
    """One row per figure (value, target, whether it is met, or why there is no value), then one
    line per part that ran."""
    width = max(len(f.key) for f in FIGURES) + 2
    lines = [f"{'figure':<{width}}{'value':>10}  {'target':<10}{'met':<5}part", "-" * (width + 40)]
    for fig in FIGURES:
        entry = report[fig.key]
        met = {True: "yes", False: "NO", None: "-"}[entry["meets_target"]]
        where = fig.part + (f" ({entry['error']})" if entry.get("error") else "")
        lines.append(
            f"{fig.key:<{width}}{_shown(entry['value']):>10}  {entry['target'] or '-':<10}{met:<5}{where}"
        )
    for part, detail in report["parts"].items():
        state = detail["status"] if detail["status"] != "ok" else f"ok in {detail['wall_s']:.0f}s"
        lines.append(f"{part}: {state}" + (f": {detail['error']}" if detail["error"] else ""))
    return "\n".join(lines)


def parse_only(value: str) -> tuple[str, ...]:
    chosen = tuple(p.strip() for p in value.split(",") if p.strip())
    unknown = [p for p in chosen if p not in PARTS]
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(
            f"unknown part(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(PARTS)}"
        )
    return tuple(p for p in PARTS if p in chosen)  # always in the documented order


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="each part's quick variant")
    parser.add_argument(
        "--only", type=parse_only, default=PARTS, metavar="PART,...", help=f"parts among {','.join(PARTS)}"
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "drafters.json")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))  # the parts import bench.*, workers.* and controlplane.*
    outcomes: dict[str, PartOutcome] = {}
    for part in args.only:
        print(f"\n=== drafters: {part} ({module_path(part).name}) ===", flush=True)
        outcomes[part] = run_part(part, module_path(part), quick=args.quick)
        outcome = outcomes[part]
        if outcome.status != "ok":
            print(f"{part}: {outcome.status}: {outcome.error}", flush=True)
            if outcome.traceback:
                print(outcome.traceback, file=sys.stderr, flush=True)
    report = assemble(outcomes, quick=args.quick)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1, default=str) + "\n")
    print("\n" + format_table(report))
    print(f"load average (1 min) {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; wrote {args.out}")
    return 0 if all(o.status == "ok" for o in outcomes.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
