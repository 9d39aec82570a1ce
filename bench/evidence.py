"""The evidence table: every figure that decides whether the loop's numbers can be trusted, gathered
from the benches' own result files into bench/results/evidence.json, each beside its target.

    .venv/bin/python bench/evidence.py [--results bench/results]

It measures nothing itself: `make bench` runs it last, after the benches that measure (the file
each figure comes from is named in FIGURES and in the JSON). A figure whose bench did not run, or
did not report it, is listed with its value null and the reason, never filled in. A figure is
found by its exact key anywhere in its source file (a bench may nest it under a part, or as
``{"value": ...}`` in bench/drafters.py's table). ``heldout_prompt_overlap`` is the largest value
reported anywhere in any result file, with the number of held-out figures that reported one: every
figure presented as held out prints its overlap with training, and one non-zero overlap is enough
to fail the table.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"
OVERLAP_KEY = "heldout_prompt_overlap"


@dataclass(frozen=True)
class Figure:
    """One figure: its key, the result files that may hold it (first found wins), its target."""

    key: str
    sources: tuple[str, ...]
    op: str | None = None  # ">=", "<=", "==" or None (printed only)
    bound: float | None = None
    rerun: str = ""

    @property
    def target(self) -> str | None:
        return f"{self.op} {self.bound:g}" if self.op is not None and self.bound is not None else None

    def meets(self, value: float) -> bool | None:
        if self.op is None or self.bound is None:
            return None
        if self.op == ">=":
            return value >= self.bound
        if self.op == "<=":
            return value <= self.bound
        return value == self.bound


_DRAFTERS = "drafters.json"
FIGURES = (
    Figure("scenario_repeat_share_max", ("traffic.json",), "<=", 0.02, "bench/traffic_repeats.py"),
    Figure(OVERLAP_KEY, (), "==", 0, "every held-out figure below"),
    Figure(
        "partial_shift_old_part_drop_points",
        ("drafters_partial.json", _DRAFTERS),
        "<=",
        3,
        "bench/drafters_partial.py",
    ),
    Figure(
        "partial_shift_new_part_hit_rate",
        ("drafters_partial.json", _DRAFTERS),
        ">=",
        0.80,
        "bench/drafters_partial.py",
    ),
    Figure("demo_promoted_hit_rate_heldout", ("demo_heldout.json",), None, None, "bench/demo_heldout.py"),
    Figure(
        "demo_promoted_speedup_vs_nospec_heldout", ("demo_heldout.json",), None, None, "bench/demo_heldout.py"
    ),
    Figure(
        "realigned_share_of_measured_ceiling",
        ("drafters_realign.json", _DRAFTERS),
        ">=",
        0.75,
        "bench/drafters_realign.py",
    ),
    Figure(
        "realigned_share_of_analytic_ceiling",
        ("drafters_realign.json", _DRAFTERS),
        None,
        None,
        "bench/drafters_realign.py",
    ),
    Figure(
        "after_action_speedup_vs_nospec",
        ("drafters_pays.json", _DRAFTERS),
        ">=",
        1.0,
        "bench/drafters_pays.py",
    ),
    Figure(
        "rollup_double_counted_records", ("reliability.json",), "==", 0, "bench/reliability.py --only ingest"
    ),
    Figure("records_lost", ("reliability.json",), "==", 0, "bench/reliability.py --only ingest"),
    Figure("idor_probes", ("reliability.json",), ">=", 500, "bench/reliability.py --only tenants"),
    Figure("idor_leaks", ("reliability.json",), "==", 0, "bench/reliability.py --only tenants"),
    Figure("pii_recall_out_of_sample", ("scrub.json", "reliability.json"), ">=", 0.95, "bench/scrub.py"),
    Figure(
        "pii_false_positive_rate_out_of_sample",
        ("scrub.json", "reliability.json"),
        "<=",
        0.01,
        "bench/scrub.py",
    ),
    Figure("fuzz_state_changing_2xx", ("reliability.json",), ">=", 200, "bench/reliability.py --only fuzz"),
    Figure("fuzz_server_errors", ("reliability.json",), "==", 0, "bench/reliability.py --only fuzz"),
    Figure("fuzz_transport_errors", ("reliability.json",), "==", 0, "bench/reliability.py --only fuzz"),
    Figure("fleet_capacity_requests_per_s", ("fleet.json",), None, None, "bench/fleet.py"),
    Figure("scrub_hit_rate_cost_points", ("scrub.json",), None, None, "bench/scrub.py (aim <= 2)"),
)


def occurrences(node: Any, key: str) -> Iterator[Any]:
    """Every value stored under ``key`` in a JSON tree, outermost first (a ``{"value": v}`` entry,
    as bench/drafters.py writes its table, gives ``v``)."""
    if isinstance(node, dict):
        if key in node:
            value = node[key]
            yield value.get("value") if isinstance(value, dict) and "value" in value else value
        for name, child in node.items():
            if name != key:
                yield from occurrences(child, key)
    elif isinstance(node, list):
        for child in node:
            yield from occurrences(child, key)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def load_results(folder: Path) -> dict[str, Any]:
    """Every result file in ``folder`` by name (a file that does not parse is reported, not used)."""
    out: dict[str, Any] = {}
    for path in sorted(folder.glob("*.json")):
        if path.name == "evidence.json":
            continue
        try:
            out[path.name] = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            out[path.name] = {"_unreadable": str(exc)}
    return out


def gather(results: dict[str, Any]) -> dict[str, Any]:
    """The evidence report: one entry per figure (value, target, meets_target, source or error)."""
    report: dict[str, Any] = {}
    for fig in FIGURES:
        entry: dict[str, Any] = {
            "value": None,
            "target": fig.target,
            "meets_target": None,
            "rerun": fig.rerun,
        }
        if fig.key == OVERLAP_KEY:
            found = [
                (name, v)
                for name, tree in results.items()
                for v in occurrences(tree, OVERLAP_KEY)
                if v is not None
            ]
            numbers = [(name, _number(v)) for name, v in found]
            bad = [name for name, v in numbers if v is None]
            if not found:
                entry["error"] = "no result file reports a held-out overlap"
            elif bad:
                entry["error"] = f"not a number in {sorted(set(bad))}"
            else:
                worst = max(v for _, v in numbers if v is not None)
                entry["value"] = int(worst) if worst.is_integer() else worst
                entry["meets_target"] = fig.meets(worst)
                entry["reported_by"] = sorted({name for name, _ in numbers})
                entry["figures_reporting"] = len(numbers)
            report[fig.key] = entry
            continue
        for source in fig.sources:
            if source not in results:
                continue
            value = next((v for v in occurrences(results[source], fig.key) if v is not None), None)
            if value is None:
                continue
            number = _number(value)
            entry["source"] = source
            if number is None:
                entry["error"] = f"not a finite number: {value!r}"
            else:
                entry["value"] = value
                entry["meets_target"] = fig.meets(number)
            break
        else:
            present = [s for s in fig.sources if s in results]
            entry["error"] = (
                f"{', '.join(present)} holds no {fig.key}"
                if present
                else f"not measured: no {' or '.join(fig.sources)} (run {fig.rerun})"
            )
        report[fig.key] = entry
    return report


def format_table(report: dict[str, Any]) -> str:
    width = max(len(f.key) for f in FIGURES) + 2
    lines = [f"{'figure':<{width}}{'value':>12}  {'target':<9}{'met':<5}from", "-" * (width + 60)]
    for fig in FIGURES:
        entry = report[fig.key]
        value = entry["value"]
        shown = "-" if value is None else (str(value) if isinstance(value, int) else f"{value:.4g}")
        met = {True: "yes", False: "NO", None: "-"}[entry["meets_target"]]
        where = entry.get("error") or entry.get("source") or ", ".join(entry.get("reported_by", []))
        lines.append(f"{fig.key:<{width}}{shown:>12}  {entry['target'] or '-':<9}{met:<5}{where}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    report = gather(load_results(args.results))
    out = args.results / "evidence.json"
    args.results.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(format_table(report))
    print(f"wrote {out}")
    return 0 if all(e["meets_target"] is not False for e in report.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
