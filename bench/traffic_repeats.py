"""How often scenario traffic repeats itself, planned without a server.

    .venv/bin/python bench/traffic_repeats.py [--scenarios scenarios]

Plans every scenario under scenarios/ as the traffic driver would send it (the same plan, seeds and
ledger: `workers.serve.traffic.plan_figures`), at its full request counts and at the demo's `--fast`
counts (the scenario's [demo.fast] `phase_requests`, else workers/demo.py's), and reports per phase
the share of requests whose normalised prompt (`controlplane.traces.holdout.prompt_hash`) an earlier
request of the same run already sent, and for each held-out phase how many of its requests share a
normalised prompt or a source document with a phase that is not held out, and apart: the distinct
normalised prompts, source documents and (for chat requests) normalised last user turns it shares
with them. Writes bench/results/traffic.json with `scenario_repeat_share_max` (the largest share over
every phase of every scenario and count), `heldout_prompt_overlap` (the largest over every held-out
phase) and `heldout_shared_max` (the largest of the three shared counts over every held-out phase).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
import tomllib
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from controlplane.traces.holdout import normalised_prompt, prompt_hash  # noqa: E402
from workers.corpora.chat import last_user_turn  # noqa: E402
from workers.demo import FAST_OVERRIDES  # noqa: E402
from workers.serve.traffic import Phase, PlannedRequest, Scenario, plan_figures, plan_requests  # noqa: E402

RESULTS = ROOT / "bench" / "results"
REPEAT_SHARE_BOUND = 0.02


def fast_phases(raw: dict[str, Any], phases: tuple[Phase, ...]) -> tuple[Phase, ...] | None:
    """The phases at the demo's `--fast` counts (None for a scenario the demo cannot run)."""
    sizes = raw.get("demo", {}).get("fast", {}).get("phase_requests", FAST_OVERRIDES["phase_requests"])
    if "demo" not in raw or len(sizes) != len(phases):
        return None
    return tuple(replace(p, requests=int(n)) for p, n in zip(phases, sizes, strict=True))


def _content(requests: list[PlannedRequest]) -> dict[str, set[str]]:
    return {
        "prompts": {prompt_hash(r.prompt) for r in requests},
        "documents": {r.document for r in requests},
        "questions": {normalised_prompt(last_user_turn(r.messages)) for r in requests if r.messages},
    }


def shared_with_open(phases: tuple[Phase, ...]) -> list[dict[str, int] | None]:
    """Per held-out phase: how many distinct normalised prompts, source documents and chat questions
    (last user turns) it shares with the phases that are not held out (None for those)."""
    planned = [list(itertools.islice(plan_requests(p), p.requests)) for p in phases]
    open_side = _content([r for p, rs in zip(phases, planned, strict=True) if not p.heldout for r in rs])
    return [
        {f"shared_{key}": len(found & open_side[key]) for key, found in _content(rs).items()}
        if p.heldout
        else None
        for p, rs in zip(phases, planned, strict=True)
    ]


def measure(path: Path) -> dict[str, list[dict[str, Any]]]:
    with open(path, "rb") as f:
        raw = tomllib.load(f)
    scenario = Scenario.from_dict(raw)
    variants = {"full": scenario.phases}
    fast = fast_phases(raw, scenario.phases)
    if fast is not None:
        variants["fast"] = fast
    out: dict[str, list[dict[str, Any]]] = {}
    for label, phases in variants.items():
        rows = []
        shared = shared_with_open(phases)
        for phase, figures, counts in zip(phases, plan_figures(phases), shared, strict=True):
            row: dict[str, Any] = {
                "phase": phase.name,
                "mix": phase.mix,
                "requests": figures.requests,
                "heldout": phase.heldout,
                "repeats": figures.repeats,
                "repeat_share": figures.repeat_share,
            }
            if phase.heldout:
                row["heldout_prompt_overlap"] = figures.heldout_prompt_overlap
                row.update(counts or {})
            rows.append(row)
        out[label] = rows
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenarios", type=Path, default=ROOT / "scenarios")
    ap.add_argument("--out", type=Path, default=RESULTS / "traffic.json")
    args = ap.parse_args()
    started = time.monotonic()
    scenarios = {path.name: measure(path) for path in sorted(args.scenarios.glob("*.toml"))}
    rows = [row for variants in scenarios.values() for phases in variants.values() for row in phases]
    if not rows:
        raise SystemExit(f"no scenario under {args.scenarios}")
    share_max = max(row["repeat_share"] for row in rows)
    overlaps = [row["heldout_prompt_overlap"] for row in rows if row["heldout"]]
    shared = [row[key] for row in rows if row["heldout"] for key in row if key.startswith("shared_")]
    result = {
        "scenario_repeat_share_max": share_max,
        "scenario_repeat_share_bound": REPEAT_SHARE_BOUND,
        "heldout_prompt_overlap": max(overlaps) if overlaps else None,
        "heldout_shared_max": max(shared) if shared else None,
        "heldout_phases": len(overlaps),
        "scenarios": scenarios,
        "seconds": round(time.monotonic() - started, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))

    header = ("scenario", "counts", "phase", "requests", "repeats", "share", "overlap", "shared p/d/q")
    print("{:<20} {:<6} {:<58} {:>8} {:>8} {:>7} {:>8} {:>12}".format(*header))
    for name, variants in scenarios.items():
        for label, phases in variants.items():
            for row in phases:
                overlap = str(row["heldout_prompt_overlap"]) if row["heldout"] else "-"
                counts = (
                    f"{row['shared_prompts']}/{row['shared_documents']}/{row['shared_questions']}"
                    if row["heldout"]
                    else "-"
                )
                print(
                    f"{name:<20} {label:<6} {row['phase'][:58]:<58} {row['requests']:>8} {row['repeats']:>8} "
                    f"{row['repeat_share']:>7.2%} {overlap:>8} {counts:>12}"
                )
    print(
        f"scenario_repeat_share_max {share_max:.2%} (bound {REPEAT_SHARE_BOUND:.0%}); "
        f"heldout_prompt_overlap {result['heldout_prompt_overlap']} over {len(overlaps)} held-out phases "
        f"(shared prompts, documents or chat questions at most {result['heldout_shared_max']}); "
        f"wrote {args.out}"
    )
    ok = share_max <= REPEAT_SHARE_BOUND and not any(overlaps) and not any(shared)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
