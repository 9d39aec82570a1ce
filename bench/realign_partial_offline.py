"""The partial shift's realignment offline: the loop's traces, its settings, and held-out figures
per category, in minutes instead of the demo's quarter of an hour.

    python bench/realign_partial_offline.py [--recent 520] [--time-budget-s 150] [--set key=value ...]

Traces are made the way ``scenarios/partial_shift.toml`` makes them in a ``--fast`` demo: the
traffic driver's plan (``workers.serve.traffic.plan_requests``) of the calibration requests (speculation
off, one per domain), the prose phase before the shift and the first ``--recent`` requests of the
half-structured phase, each completed by the reference target greedily (``max_tokens`` and the
structured stop string of the scenario, the stop string kept as a trace keeps it), each labelled with
its category and source document as the router records them. The realignment runs from the generic
drafter with the realign task's settings (``RealignConfig`` defaults, the fast run's time budget);
``--set`` overrides any ``RealignConfig`` field (``--set lr=1e-3 --set replay_teacher=target``).

Measured on the demo's held-out probe prompts (the after phase at the probe's seed: documents reserved
for held-out phases, so none of them is a trace's document), greedy, k = 4, each request to the
phase's ``max_tokens`` under its stop string, per category: hit rate (accepted / drafted) of the
generic and of the realigned drafter on the very same prompts, and the drop in points. The first
``--probe`` requests are the demo's probe (its two warm-up pairs dropped); ``--extra`` more requests of
the same stream give each category more prompts. ``heldout_prompt_overlap`` counts evaluation requests
whose prompt or document is a trace's (0 unless the document partition leaks).

Traces are cached under bench/results/trace-cache. Writes bench/results/realign_partial_offline.json.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import sys
import time
import tomllib
from collections import Counter
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.realign import K, cut_at_stop, decode_figures, load_reference  # noqa: E402
from controlplane.traces.holdout import TrainedContent, content_key, content_of  # noqa: E402
from workers.demo import FAST_OVERRIDES, PAIRED_SEED_OFFSET, PAIRED_WARMUP_PAIRS  # noqa: E402
from workers.engine.decoder import generate_batch  # noqa: E402
from workers.engine.model import Transformer  # noqa: E402
from workers.engine.tokenizer import Tokenizer  # noqa: E402
from workers.serve.traffic import Phase, PlannedRequest, Scenario, plan_requests  # noqa: E402
from workers.training.realign import RealignConfig, TraceText, realign  # noqa: E402

SCENARIO = ROOT / "scenarios" / "partial_shift.toml"
RESULTS = ROOT / "bench" / "results" / "realign_partial_offline.json"
TRACE_CACHE = ROOT / "bench" / "results" / "trace-cache"
CALIBRATION_SEED = 99  # workers.demo's calibration phases
CUT_TOKENS = 8


def _requests(phase: Phase, n: int) -> list[PlannedRequest]:
    return list(itertools.islice(plan_requests(phase), n))


def _complete(
    target: Transformer, tokenizer: Tokenizer, phase: Phase, requests: list[PlannedRequest], tag: str
) -> list[TraceText]:
    """The target's greedy completions of ``requests`` as the reference server traces them (cached).

    Each prompt loses its first few tokens (fewer than ``CUT_TOKENS``) so that prompts of one
    length decode as one batch (minutes instead of most of an hour on a loaded 2-core machine);
    the trace's prompt is the text that was completed.
    """
    digest = hashlib.sha256(
        "\0".join([tag, str(phase.max_tokens), str(CUT_TOKENS), *(r.prompt for r in requests)]).encode()
    ).hexdigest()[:16]
    path = TRACE_CACHE / f"partial-{tag}-{digest}.json"
    if path.is_file():
        return [TraceText(*t) for t in json.loads(path.read_text())]
    ids = [tokenizer.encode(r.prompt) for r in requests]
    ids = [p[len(p) % CUT_TOKENS :] if len(p) >= CUT_TOKENS else p for p in ids]
    completions: dict[int, str] = {}
    for length in sorted({len(p) for p in ids}):
        group = [i for i, p in enumerate(ids) if len(p) == length]
        for lo in range(0, len(group), 64):
            batch = torch.tensor([ids[i] for i in group[lo : lo + 64]])  # [B, T]
            out = generate_batch(target, batch, phase.max_tokens)  # [B, max_tokens]
            for i, row in zip(group[lo : lo + 64], out.tolist(), strict=True):
                if tokenizer.eos_id is not None and tokenizer.eos_id in row:
                    row = row[: row.index(tokenizer.eos_id)]
                completions[i] = cut_at_stop(tokenizer.decode(row), phase.stop_for(requests[i].domain))
    traces = [
        TraceText(
            content_key(r.prompt, r.document),
            tokenizer.decode(ids[i]),
            completions[i],
            r.category,
            r.document,
        )
        for i, r in enumerate(requests)
    ]
    TRACE_CACHE.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([[t.key, t.prompt, t.completion, t.category, t.document] for t in traces]))
    return traces


def make_traces(
    target: Transformer,
    tokenizer: Tokenizer,
    phases: list[Phase],
    *,
    recent: int,
    before: int,
    calibration: int,
) -> tuple[list[TraceText], list[TraceText]]:
    """(recent, older): the shift phase's first ``recent`` requests; calibration and the phase before."""
    older: list[TraceText] = []
    for domain in sorted(phases[1].mix):
        cal = replace(phases[0], mix={domain: 1.0}, seed=CALIBRATION_SEED)
        older += _complete(target, tokenizer, cal, _requests(cal, calibration), f"cal-{domain}")
    older += _complete(target, tokenizer, phases[0], _requests(phases[0], before), "before")
    shift = _complete(target, tokenizer, phases[1], _requests(phases[1], recent), "shift")
    return shift, older


def probe_figures(
    target: Transformer,
    tokenizer: Tokenizer,
    drafters: dict[str, Transformer],
    phase: Phase,
    requests: list[PlannedRequest],
) -> dict[str, dict[str, dict[str, float]]]:
    """Per drafter, per domain: hit rate and tokens per step on ``requests`` (greedy, k = K)."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for name, drafter in drafters.items():
        out[name] = {}
        for domain in sorted({r.domain for r in requests}):
            ids = [tokenizer.encode(r.prompt) for r in requests if r.domain == domain]
            figures = decode_figures(
                target, tokenizer, drafter, ids, phase.max_tokens, phase.stop_for(domain)
            )
            out[name][domain] = {"prompts": len(ids), **{k: round(v, 4) for k, v in figures.items()}}
    return out


def _parse_sets(pairs: list[str]) -> dict[str, Any]:
    types = {f.name: f.type for f in fields(RealignConfig)}
    out: dict[str, Any] = {}
    for pair in pairs:
        name, _, raw = pair.partition("=")
        if name not in types:
            raise SystemExit(f"--set {pair}: RealignConfig has no field {name!r}")
        out[name] = None if raw == "None" else json.loads(raw) if raw[:1] in "0123456789.-[{tf" else raw
    return out


def main() -> None:
    if os.environ.get("PYTHONHASHSEED") != "0":
        # The structured traffic's generated values depend on str hashes: without a fixed hash
        # seed every process plans other structured prompts (and misses the trace cache).
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "PYTHONHASHSEED": "0"})
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recent", type=int, default=520, help="shift-phase traces the job trains on")
    parser.add_argument("--time-budget-s", type=float, default=150.0)
    parser.add_argument("--probe", type=int, default=int(FAST_OVERRIDES["paired_requests"]))
    parser.add_argument("--extra", type=int, default=32, help="more held-out requests beyond the probe")
    parser.add_argument("--set", dest="sets", action="append", default=[], help="RealignConfig field=value")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--label", default="")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    started = time.perf_counter()
    torch.manual_seed(0)
    torch.set_num_threads(1)  # a loaded 2-core machine: one thread waits on no descheduled twin
    scenario = Scenario.load(SCENARIO)
    phases = list(scenario.phases)
    target, tokenizer, generic = load_reference()
    fast = tomllib.loads(SCENARIO.read_text())["demo"]["fast"]
    recent, older = make_traces(
        target,
        tokenizer,
        phases,
        recent=args.recent,
        before=int(fast["phase_requests"][0]),
        calibration=int(FAST_OVERRIDES["calibration_requests"]),
    )
    print(
        f"traces: recent {dict(Counter(t.category for t in recent))} from "
        f"{len({t.document for t in recent if t.category == 'prose'})} prose documents; older "
        f"{dict(Counter(t.category for t in older))} ({time.perf_counter() - started:.0f}s)",
        flush=True,
    )
    cfg = RealignConfig(seed=args.seed, time_budget_s=args.time_budget_s, **_parse_sets(args.sets))

    def show(fraction: float, message: str) -> bool:
        print(f"  [{fraction:4.0%}] {message}", flush=True)
        return True

    torch.set_num_threads(max(1, os.cpu_count() or 1))  # as a worker trains
    result = realign(target, generic, tokenizer, recent, older, cfg, progress=show)
    probe_phase = replace(phases[2], seed=phases[2].seed + PAIRED_SEED_OFFSET)
    planned = _requests(probe_phase, PAIRED_WARMUP_PAIRS + args.probe + args.extra)[PAIRED_WARMUP_PAIRS:]
    trained = TrainedContent.of(t.content for t in (*recent, *older))
    overlap = sum(trained.overlaps(content_of(r.prompt, r.document)) for r in planned)
    torch.set_num_threads(1)  # decoding on one thread: see bench/drafters_realign.py
    drafters = {"generic": generic, "realigned": result.model}
    probe = probe_figures(target, tokenizer, drafters, probe_phase, planned[: args.probe])
    every = probe_figures(target, tokenizer, drafters, probe_phase, planned)

    def drops(figures: dict[str, dict[str, dict[str, float]]]) -> dict[str, float]:
        return {
            d: round(100 * (figures["generic"][d]["hit_rate"] - figures["realigned"][d]["hit_rate"]), 2)
            for d in figures["generic"]
        }

    m = result.metrics
    out = {
        "label": args.label,
        "config_overrides": _parse_sets(args.sets),
        "time_budget_s": args.time_budget_s,
        "recent_traces": len(recent),
        "older_traces": len(older),
        "heldout_prompt_overlap": overlap,
        "realign_heldout_prompt_overlap": m["heldout_prompt_overlap"],
        "probe": probe,
        "probe_drop_points": drops(probe),
        "heldout": every,
        "heldout_drop_points": drops(every),
        "realign": {
            k: m.get(k)
            for k in (
                "train_rows",
                "recent_rows",
                "replay_rows",
                "held_out_split",
                "held_out_by_category",
                "selection",
                "rows_per_document",
                "steps_planned",
                "steps_run",
                "best_step",
                "stop_reason",
                "lr",
                "teacher",
                "select_on",
                "select_old_weight",
                "held_out_new",
                "held_out_old",
                "replay_plan",
                "history",
                "wall_s",
            )
        },
        "k": K,
        "load_average_1m": round(os.getloadavg()[0], 2),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    for name, figures in (("probe", probe), ("held out", every)):
        line = ", ".join(
            f"{d} {figures['generic'][d]['hit_rate']:.1%} -> {figures['realigned'][d]['hit_rate']:.1%} "
            f"({figures['generic'][d]['prompts']} prompts)"
            for d in sorted(figures["generic"])
        )
        print(f"{name}: {line}")
    print(
        f"held-out drop points {out['heldout_drop_points']}, probe drop points {out['probe_drop_points']}; "
        f"heldout_prompt_overlap {overlap}; realign {m['wall_s']}s, best step {m['best_step']}/"
        f"{m['steps_run']}, lr {m['lr']:.2g}"
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
