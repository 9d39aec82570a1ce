"""Canary benchmark: the decision rule on simulated streams, and the three-arm table on the
reference setup after a prose -> structured shift (``--domain code`` for the code domain, which the
reference target cannot make pay: ``bench/domain_ceiling.py`` prints why).

Half one is ``bench/canary_sim.py``'s ``run_simulation`` (false promotion under continuous
monitoring beside a naive fixed-sample test, requests to decide per effect size).

Half two, on the committed reference models, greedy, batch size 1: the generic drafter is realigned
on the target's own traces of the shifted domain exactly as ``bench/realign.py`` does (its helpers,
its trace cache), then ``workers.canary.replay.shadow_replay`` runs held-out prompts of that domain
(test split, never trained on) through no speculation, the generic drafter and the realigned one,
interleaved per prompt, with the lossless check on every arm. Each request is replayed at the
length it is served: a structured request ends with its one-line answer (stop "\\n", as the demo's
client ends it: ``bench/realign.py``'s STOPS), so it is replayed through the token that completes
the stop string, exactly as the service's shadow replay replays a served request; what the target
writes after the answer is the next, randomly generated request, which no drafter can guess.

k is chosen the way the service chooses it: a first replay at k = K_PROBE measures the realigned
drafter's per-position conditional acceptance and the drafter/target and verify step costs, and
``controlplane.tuning.draft_length.plan_draft_length`` picks the k with the best expected speed-up.
Beside it, the k the live canary's tuner settles on (``controlplane.canary.evaluate``: the same
function over the counts of drafts at the deployment's k, scenarios/demo.toml's
``draft_token_count``, extrapolating deeper positions by their smallest 90 % Wilson lower bound),
computed from the probe's own counts of those first positions, and the reason they differ when
they do. (The demo's live canary settled on k = 5 in the 2026-12-01 runs of docs/benchmarks.md.)
Then every arm runs at the chosen k. Tokens per verify step are exact; tokens/s and latencies move
with the machine's load, which is recorded (1-minute load average).

``--quick``: fewer prompts, the quick simulation and the demo's 150-s training budget.
Writes bench/results/canary.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.realign import STOPS, eval_prompts, load_reference, realign_for_domain  # noqa: E402
from controlplane.tuning.draft_length import DraftLengthPlan, plan_draft_length  # noqa: E402
from workers.canary.replay import ReplayResult, shadow_replay  # noqa: E402
from workers.engine.decoder import SpeculativeDecoder  # noqa: E402
from workers.engine.model import Transformer  # noqa: E402
from workers.engine.tokenizer import Tokenizer  # noqa: E402
from workers.training.realign import RealignConfig  # noqa: E402

RESULTS = ROOT / "bench" / "results"
DEMO_SCENARIO = ROOT / "scenarios" / "demo.toml"
K_PROBE = 8
DEFAULT_LIVE_K = 4  # the demo deployment's draft_token_count when the scenario does not say
LABELS = {"baseline": "no speculation", "incumbent": "generic drafter", "candidate": "realigned drafter"}
QUICK = {"prompts": 8, "probe_prompts": 8, "quick_sim": True, "time_budget_s": 150.0}


def served_lengths(
    target: Transformer,
    tokenizer: Tokenizer,
    prompts: Sequence[Sequence[int]],
    new_tokens: int,
    stops: tuple[str, ...],
) -> list[int]:
    """Output tokens each request is served: ``new_tokens``, or with stop strings up to the token
    that completes the first one (plain greedy decoding; the count includes the stop string, as a
    served request's trace keeps it and the service's shadow replay replays that many tokens)."""
    if not stops:
        return [new_tokens] * len(prompts)
    plain = SpeculativeDecoder(target, tokenizer, None, k=0)
    return [
        plain.generate(list(ids), new_tokens, stop_at_eos=False, stop=stops).metrics.generated_tokens
        for ids in prompts
    ]


def live_draft_length(scenario: Path = DEMO_SCENARIO) -> int:
    """The k the demo's deployment serves at, so the k its live canary drafts at."""
    if not scenario.is_file():
        return DEFAULT_LIVE_K
    demo = tomllib.loads(scenario.read_text()).get("demo", {})
    return int(demo.get("draft_token_count", DEFAULT_LIVE_K))


def _plan(probe: ReplayResult, observed_k: int, max_k: int | None) -> DraftLengthPlan:
    arm, costs = probe.arms["candidate"], probe.costs
    assert costs is not None and costs.cost_ratio is not None
    return plan_draft_length(
        arm.accepted_per_position[:observed_k],
        arm.verify_steps,
        costs.cost_ratio,
        verify_cost=costs.verify_cost,
        max_k=max_k,
    )


def compare_k(probe: ReplayResult, live_k: int) -> dict[str, Any]:
    """The probe's k (positions 1..K_PROBE observed) beside the live canary tuner's (1..live_k
    observed, as ``controlplane.canary.evaluate`` calls it), and why they differ when they do."""
    probe_plan = _plan(probe, K_PROBE, K_PROBE)
    live_plan = _plan(probe, live_k, None)  # the canary passes no max_k: the tuner's default
    a, b = probe_plan.best_k, live_plan.best_k
    arm = probe.arms["candidate"]
    # Rounds that drafted fewer than K_PROBE tokens because the request's end was nearer: a short
    # answer never reaches the deep positions, which lowers their conditional rates for every tuner.
    full = arm.drafted_per_position[K_PROBE - 1] if len(arm.drafted_per_position) >= K_PROBE else 0
    short_share = 1.0 - full / arm.verify_steps if arm.verify_steps else 0.0
    out: dict[str, Any] = {
        "probe_k": a,
        "probe_expected_speedup": round(probe_plan.best_speedup, 4),
        "live_k_drafted": live_k,
        "live_tuner_k": b,
        "live_tuner_expected_speedup": round(live_plan.best_speedup, 4),
        "live_tuner_extrapolated_acceptance": live_plan.extrapolated_acceptance,
        "probe_conditional_acceptance": [
            round(r.conditional_acceptance or 0.0, 4) for r in probe_plan.rows[1:]
        ],
        "probe_rounds_cut_short": round(short_share, 4),
        "agree": a == b,
    }
    if a == b:
        out["reason"] = f"both pick k = {a}"
        return out
    deeper = [round(r.conditional_acceptance or 0.0, 3) for r in probe_plan.rows[live_k + 1 :]]
    extrapolated = live_plan.extrapolated_acceptance or 0.0

    def probe_speedup(k: int) -> float:
        return probe_plan.rows[k].expected_speedup if k < len(probe_plan.rows) else float("nan")

    out["reason"] = (
        f"positions 1..{live_k} have the same counts and costs in both, so the plans differ only "
        f"beyond k = {live_k}: the live canary drafts {live_k} tokens and assumes every deeper position "
        f"accepts at {extrapolated:.3f} (the smallest 90% Wilson lower bound of those it saw), where the "
        f"probe measured {deeper} at positions {live_k + 1}..{K_PROBE}; by the probe's own rates k = {a} "
        f"expects {probe_speedup(a):.3f}x and k = {b} {probe_speedup(b):.3f}x; {short_share:.0%} of the "
        f"probe's rounds drafted fewer than {K_PROBE} tokens because the answer ended first"
    )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--domain",
        choices=["structured", "code"],
        default="structured",
        help="the shifted domain (the reference target cannot make code pay: bench/domain_ceiling.py)",
    )
    parser.add_argument("--quick", action="store_true", help="fewer prompts and streams, shorter training")
    parser.add_argument("--prompts", type=int, default=16, help="held-out prompts in the three-arm replay")
    parser.add_argument("--probe-prompts", type=int, default=8, help="prompts in the k-choosing probe")
    parser.add_argument("--new-tokens", type=int, default=96, help="at most this many tokens per request")
    parser.add_argument("--repeats", type=int, default=1, help="runs per (prompt, arm); medians are kept")
    parser.add_argument("--k", type=int, default=None, help="skip the probe and use this k")
    parser.add_argument("--shifted-traces", type=int, default=384)
    parser.add_argument("--prose-traces", type=int, default=256)  # as bench/realign.py
    parser.add_argument("--trace-tokens", type=int, default=128)
    parser.add_argument("--time-budget-s", type=float, default=240.0)
    parser.add_argument("--quick-sim", action="store_true", help="fewer simulated streams")
    parser.add_argument("--skip-sim", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    if args.quick:  # the quick values, unless given on the command line
        parser.set_defaults(**QUICK)
        args = parser.parse_args(argv)
    started = time.perf_counter()
    stops = STOPS.get(args.domain, ())
    out: dict[str, Any] = {"domain": args.domain, "stop": list(stops), "quick": args.quick}
    if args.domain == "code":
        print("code: the reference target cannot make it pay (bench/domain_ceiling.py says why)", flush=True)

    if not args.skip_sim:
        from bench.canary_sim import run_simulation

        sim = run_simulation(quick=args.quick_sim, seed=args.seed)
        out["false_promotion_rate"] = sim["false_promotion_rate"]
        out["naive_false_promotion_rate"] = sim["naive_false_promotion_rate"]
        out["simulation"] = {k: v for k, v in sim.items() if k not in ("policy", "decide_cross_checks")}

    torch.set_num_threads(max(1, args.threads))
    target, tokenizer, generic = load_reference()
    cfg = RealignConfig(seed=args.seed, time_budget_s=args.time_budget_s)
    print(f"\nrealigning the generic drafter on {args.domain} traces", flush=True)
    result, _ = realign_for_domain(
        target,
        tokenizer,
        generic,
        args.domain,
        shifted_traces=args.shifted_traces,
        prose_traces=args.prose_traces,
        trace_tokens=args.trace_tokens,
        seed=args.seed,
        cfg=cfg,
    )
    m = result.metrics
    out["realign"] = {
        k: m[k] for k in ("wall_s", "teacher", "train_s", "train_tokens_per_s", "steps_run", "held_out_after")
    }
    prompts = eval_prompts(tokenizer, args.domain, args.prompts + args.probe_prompts)
    lengths = served_lengths(target, tokenizer, prompts, args.new_tokens, stops)
    probe_prompts, replay_prompts = prompts[args.prompts :], prompts[: args.prompts]
    probe_lengths, replay_lengths = lengths[args.prompts :], lengths[: args.prompts]
    arms = {"baseline": None, "incumbent": generic, "candidate": result.model}
    ending = f"ending at {stops!r}" if stops else f"{args.new_tokens} tokens each"
    mean_output = sum(replay_lengths) / len(replay_lengths)
    print(f"requests {ending}: mean {mean_output:.1f} output tokens", flush=True)

    live_k = live_draft_length()
    if args.k is None:
        print(f"probe: k = {K_PROBE} on {len(probe_prompts)} prompts (per-position acceptance, step costs)")
        probe = shadow_replay(
            target,
            tokenizer,
            {"baseline": None, "candidate": result.model},
            probe_prompts,
            K_PROBE,
            probe_lengths,
            stop_at_eos=False,
            reference="baseline",
        )
        comparison = compare_k(probe, live_k)
        k = comparison["probe_k"]
        out["k_plan"] = {
            "method": "controlplane.tuning.draft_length.plan_draft_length",
            **_plan(probe, K_PROBE, K_PROBE).as_dict(),
        }
        out["k_comparison"] = comparison
        out["probe"] = {
            "conditional_acceptance": probe.arms["candidate"].conditional_acceptance,
            "accepted_per_position": probe.arms["candidate"].accepted_per_position,
            "verify_steps": probe.arms["candidate"].verify_steps,
            "hit_rate": probe.arms["candidate"].hit_rate,
            "costs": probe.costs.to_dict() if probe.costs else None,
        }
        print(
            f"k: the probe (positions 1..{K_PROBE} observed) picks {k} "
            f"({comparison['probe_expected_speedup']:.2f}x expected); the live canary's tuner "
            f"(drafting at k = {live_k}) would settle on {comparison['live_tuner_k']} "
            f"({comparison['live_tuner_expected_speedup']:.2f}x expected): {comparison['reason']}",
            flush=True,
        )
    else:
        k = args.k
        out["k_plan"] = {"method": "given on the command line"}
    print(
        f"chosen k = {k}; three-arm replay of {len(replay_prompts)} held-out {args.domain} prompts",
        flush=True,
    )

    # k = 0 means speculation does not pay at all; the table still shows the drafters at k = 1.
    replay = shadow_replay(
        target,
        tokenizer,
        arms,
        replay_prompts,
        max(1, k),
        replay_lengths,
        repeats=args.repeats,
        stop_at_eos=False,
    )
    out.update(
        {
            "chosen_k": k,
            "realigned_speedup_vs_nospec": round(replay.speedup("candidate", "baseline"), 3),
            "realigned_speedup_vs_generic": round(replay.speedup("candidate", "incumbent"), 3),
            "generic_speedup_vs_nospec": round(replay.speedup("incumbent", "baseline"), 3),
            "paired_median_speedup": {
                "realigned_vs_nospec": round(replay.paired_speedup("candidate", "baseline"), 3),
                "realigned_vs_generic": round(replay.paired_speedup("candidate", "incumbent"), 3),
            },
            "broken_arms": replay.broken_arms,
            "table": {
                LABELS[name]: {
                    "hit_rate": arm.hit_rate,
                    "tokens_per_step": round(arm.mean_accepted_length, 4),
                    "tokens_per_s": round(arm.tokens_per_s, 2),
                    "inter_token_ms_p50": arm.inter_token_ms_p50,
                    "inter_token_ms_p95": arm.inter_token_ms_p95,
                    "ttft_ms_p50": arm.ttft_ms_p50,
                    "per_position_acceptance": [round(x, 4) for x in arm.per_position_acceptance],
                }
                for name, arm in replay.arms.items()
            },
            "replay": replay.to_dict(),
            "prompts": len(replay_prompts),
            "new_tokens": args.new_tokens,
            "mean_output_tokens": round(mean_output, 1),
            "repeats": args.repeats,
            "threads": torch.get_num_threads(),
            "cpu_cores": os.cpu_count(),
            "load_average_1m_at_end": round(os.getloadavg()[0], 2),
            "wall_s": round(time.perf_counter() - started, 1),
            "targets": {"realigned_speedup_vs_nospec": ">= 2.2", "realigned_speedup_vs_generic": ">= 3"},
        }
    )
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "canary.json").write_text(json.dumps(out, indent=1) + "\n")

    print(
        f"\nreference setup, prose -> {args.domain}, k = {k}, greedy, batch 1 "
        f"({len(replay_prompts)} prompts, {ending})"
    )
    print(f"{'arm':<19}{'hit rate':>9}{'tok/step':>9}{'tok/s':>8}{'ITL p50':>9}{'ITL p95':>9}")
    for name, arm in replay.arms.items():
        hit = f"{arm.hit_rate:.1%}" if arm.hit_rate is not None else "-"
        print(
            f"{LABELS[name]:<19}{hit:>9}{arm.mean_accepted_length:>9.2f}{arm.tokens_per_s:>8.1f}"
            f"{arm.inter_token_ms_p50 or 0:>8.1f}ms{arm.inter_token_ms_p95 or 0:>7.1f}ms"
        )
    print(
        f"realigned vs no speculation {out['realigned_speedup_vs_nospec']:.2f}x (target >= 2.2), "
        f"vs generic {out['realigned_speedup_vs_generic']:.2f}x (target >= 3); lossless: "
        f"{'yes' if not replay.broken_arms else 'BROKEN ' + ', '.join(replay.broken_arms)}"
    )
    print(f"load average (1 min) {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    print(f"wrote {RESULTS / 'canary.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
