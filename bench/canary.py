"""Canary benchmark: the decision rule on simulated streams, and the three-arm table on
the reference setup after a prose -> code shift (``--domain structured`` for the tool-call domain).

Half one is ``bench/canary_sim.py``'s ``run_simulation`` (false promotion under continuous
monitoring beside a naive fixed-sample test, requests to decide per effect size).

Half two, on the committed reference models, greedy, batch size 1: the generic drafter is realigned
on the target's own traces of the shifted domain exactly as ``bench/realign.py`` does (its helpers,
its trace cache), then ``workers.canary.replay.shadow_replay`` runs held-out prompts of that domain
(test split, never trained on) through no speculation, the generic drafter and the realigned one,
interleaved per prompt, with the lossless check on every arm. k is chosen the way the service
chooses it: a first replay at k = K_PROBE measures the realigned drafter's per-position
conditional acceptance and the drafter/target and verify step costs, and
``controlplane.tuning.draft_length.plan_draft_length`` picks the k with the best expected speed-up
(falling back to measuring k = 2..8 directly if that module is missing). Then every arm runs at the
chosen k. Tokens per verify step are exact; tokens/s and latencies move with the machine's load,
which is recorded (1-minute load average).

Writes bench/results/canary.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.realign import eval_prompts, load_reference, realign_for_domain  # noqa: E402
from workers.canary.replay import ReplayResult, shadow_replay  # noqa: E402
from workers.training.realign import RealignConfig  # noqa: E402

RESULTS = ROOT / "bench" / "results"
K_PROBE = 8
LABELS = {"baseline": "no speculation", "incumbent": "generic drafter", "candidate": "realigned drafter"}


def choose_k(probe: ReplayResult) -> tuple[int, dict[str, Any]]:
    """Best k from the probe replay's per-position counts and measured costs (the service's tuner)."""
    arm = probe.arms["candidate"]
    costs = probe.costs
    assert costs is not None and costs.cost_ratio is not None
    try:
        from controlplane.tuning.draft_length import plan_draft_length
    except ImportError:  # the tuner is not there: the same arithmetic, without its extrapolation
        return _expected_best_k(probe), {"method": "inline E(k) / (k c + v(k)) over the probe"}
    plan = plan_draft_length(
        arm.accepted_per_position,
        arm.verify_steps,
        costs.cost_ratio,
        verify_cost=costs.verify_cost,
        max_k=K_PROBE,
    )
    return plan.best_k, {"method": "controlplane.tuning.draft_length.plan_draft_length", **plan.as_dict()}


def _expected_best_k(probe: ReplayResult) -> int:
    arm, costs = probe.arms["candidate"], probe.costs
    assert costs is not None and costs.cost_ratio is not None
    best, best_speedup, tokens, reach = 0, 1.0, 1.0, 1.0
    for k, beta in enumerate(arm.conditional_acceptance, start=1):
        reach *= beta
        tokens += reach
        speedup = tokens / (k * costs.cost_ratio + costs.verify_cost.get(k, 1.0))
        if speedup > best_speedup:
            best, best_speedup = k, speedup
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--domain", choices=["code", "structured"], default="code")
    parser.add_argument("--prompts", type=int, default=16, help="held-out prompts in the three-arm replay")
    parser.add_argument("--probe-prompts", type=int, default=8, help="prompts in the k-choosing probe")
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=1, help="runs per (prompt, arm); medians are kept")
    parser.add_argument("--k", type=int, default=None, help="skip the probe and use this k")
    parser.add_argument("--shifted-traces", type=int, default=384)
    parser.add_argument("--prose-traces", type=int, default=128)
    parser.add_argument("--trace-tokens", type=int, default=128)
    parser.add_argument("--time-budget-s", type=float, default=240.0)
    parser.add_argument("--quick-sim", action="store_true", help="fewer simulated streams")
    parser.add_argument("--skip-sim", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    started = time.perf_counter()
    out: dict[str, Any] = {"domain": args.domain}

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
    probe_prompts, replay_prompts = prompts[args.prompts :], prompts[: args.prompts]
    arms = {"baseline": None, "incumbent": generic, "candidate": result.model}

    if args.k is None:
        print(f"probe: k = {K_PROBE} on {len(probe_prompts)} prompts (per-position acceptance, step costs)")
        probe = shadow_replay(
            target,
            tokenizer,
            {"baseline": None, "candidate": result.model},
            probe_prompts,
            K_PROBE,
            args.new_tokens,
            stop_at_eos=False,
            reference="baseline",
        )
        k, plan = choose_k(probe)
        out["k_plan"] = plan
        out["probe"] = {
            "conditional_acceptance": probe.arms["candidate"].conditional_acceptance,
            "costs": probe.costs.to_dict() if probe.costs else None,
        }
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
        args.new_tokens,
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
        f"\nreference setup, prose -> {args.domain}, k = {k}, greedy, batch 1 ({len(replay_prompts)} prompts)"
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
