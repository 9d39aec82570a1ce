"""Draft stopping tuned from live counts: does the tuner's threshold pay, for a stale and a realigned drafter?

Setup: the committed reference target, on the structured (tool-call) domain, with two drafters:
the generic one (distilled on prose: stale here) and one realigned on structured traces
(bench/results/realigned-structured when bench/realign.py or a full run of this bench left one
there, else trained now with bench/realign.py's `realign_for_domain`: 240 s budget, 60 s with
--quick). For each drafter:

1. Count: greedy decoding at k=4 without a threshold on tuning prompts (validation split), the
   engine reporting per request what each threshold of its grid would have drafted and had
   accepted (workers.engine.metrics ``draft_stop_counts``), exactly as the reference server sends
   them to the control plane. Per-step costs are measured in the same run: the target's one-token
   step (plain decoding), the drafter's step (propose time per draft) and the verify pass of k+1
   tokens (score time per round), so the cost ratio and v(k) are this machine's.
2. Choose: controlplane.tuning.draft_stop picks a threshold (or none) from the summed counts and
   those costs, as the canary does at promotion (with ``min_rounds`` scaled to the bench's size).
3. Measure: ms per token of the same drafter with the chosen threshold against without one, on
   held-out prompts (test split), interleaved over repetitions, median kept (the machine is
   shared: only ratios measured side by side count). The gain is without / with, reported only
   where a threshold was chosen: when the tuner keeps drafting without one, both arms would be the
   same decoder and a gain of 1.0 would say nothing, so the figure is None and
   ``..._absent_reason`` says why.

A third case must choose: the stale drafter at k=8 (``late_positions_poor``), whose drafts past
the first few are mostly rejected and whose low confidence there says so, so that stopping early
saves drafter and verify work for few lost tokens. ``tuned_threshold_must_choose_case_chose``
says whether the tuner did; a False there is a failure of the tuner (or of that premise), not a
figure to leave out.

Each structured request ends with its one-line answer (stop "\\n", as its client ends it).
`measure(quick)` returns the figures; run as a script it writes bench/results/drafters_threshold.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.realign import RESULTS, STOPS, K, load_reference, realign_for_domain  # noqa: E402
from controlplane.tuning.draft_stop import plan_draft_stop, sum_counts  # noqa: E402
from workers import corpora  # noqa: E402
from workers.engine.decoder import SpeculativeDecoder  # noqa: E402
from workers.engine.hf_io import load_hf_folder, save_hf_folder  # noqa: E402
from workers.engine.model import Transformer  # noqa: E402
from workers.engine.proposers import DraftModelProposer  # noqa: E402
from workers.engine.tokenizer import Tokenizer  # noqa: E402
from workers.training.realign import RealignConfig  # noqa: E402

DOMAIN = "structured"
REALIGNED = RESULTS / f"realigned-{DOMAIN}"


def _prompts(tokenizer: Tokenizer, split: str, n: int, seed: int) -> list[list[int]]:
    return [
        tokenizer.encode(p.text)[-128:]
        for p in corpora.prompts(DOMAIN, split, n=n, seed=seed, min_prompt_chars=100)
    ]


def realigned_drafter(
    target: Transformer, tokenizer: Tokenizer, generic: Transformer, quick: bool
) -> tuple[Transformer, str]:
    """The structured-realigned drafter bench/realign.py left, else one trained now."""
    if (REALIGNED / "model.safetensors").is_file():
        drafter, _ = load_hf_folder(REALIGNED)
        return drafter, str(REALIGNED.relative_to(ROOT))
    cfg = RealignConfig(seed=0, time_budget_s=60.0 if quick else 240.0)
    result, _ = realign_for_domain(
        target,
        tokenizer,
        generic,
        DOMAIN,
        shifted_traces=384,  # what bench/realign.py generates (and caches)
        prose_traces=32 if quick else 128,
        trace_tokens=128,
        seed=0,
        cfg=cfg,
        verbose=False,
    )
    if not quick:  # kept, as bench/realign.py keeps its own, for the next run
        save_hf_folder(result.model, tokenizer, REALIGNED)
    return result.model, f"trained now ({cfg.time_budget_s:.0f} s budget)"


def count_and_cost(
    target: Transformer,
    tokenizer: Tokenizer,
    drafter: Transformer,
    prompts: list[list[int]],
    new_tokens: int,
    k: int = K,
) -> tuple[list[tuple[dict[str, Any] | None, int, int]], dict[str, Any]]:
    """The tuning run: each request's draft-stop counts (with its drafted and accepted tokens) and
    the per-step costs measured in situ."""
    stop = STOPS[DOMAIN]
    plain = SpeculativeDecoder(target, tokenizer, None, k=0)
    counting = SpeculativeDecoder(target, tokenizer, DraftModelProposer(drafter), k=k)
    records: list[tuple[dict[str, Any] | None, int, int]] = []
    plain_ms = plain_steps = propose_ms = drafts = score_ms = rounds = 0.0
    for ids in prompts:
        m = plain.generate(ids, new_tokens, stop_at_eos=False, stop=stop).metrics
        plain_ms += m.score_ms
        plain_steps += m.verify_steps
        m = counting.generate(ids, new_tokens, stop_at_eos=False, stop=stop).metrics
        records.append((m.to_native("r")["draft_stop_counts"], m.drafted_tokens, m.accepted_tokens))
        propose_ms += m.propose_ms
        drafts += m.drafted_tokens
        drafting_rounds = sum(1 for d in m.per_step_drafted if d)
        # Rounds without drafts are one-token steps: their share of score time is left out.
        score_ms += m.score_ms * drafting_rounds / max(1, m.verify_steps)
        rounds += drafting_rounds
    target_step_ms = plain_ms / plain_steps
    drafter_step_ms = propose_ms / drafts
    verify_ms = score_ms / rounds
    mean_drafted = drafts / rounds
    costs = {
        "target_step_ms": round(target_step_ms, 4),
        "drafter_step_ms": round(drafter_step_ms, 4),
        "verify_round_ms": round(verify_ms, 4),
        "mean_drafted_per_round": round(mean_drafted, 3),
        "cost_ratio": round(drafter_step_ms / target_step_ms, 4),
        # v(d) at the mean draft count of the counting run (the tuner interpolates from v(0) = 1).
        "verify_cost": {round(mean_drafted): round(max(1.0, verify_ms / target_step_ms), 4)},
    }
    return records, costs


def ms_per_token(
    decoders: dict[str, SpeculativeDecoder], prompts: list[list[int]], new_tokens: int, reps: int
) -> dict[str, float]:
    """Median ms per generated token of each decoder, interleaved: every decoder once per repetition."""
    stop = STOPS[DOMAIN]
    times: dict[str, list[float]] = {name: [] for name in decoders}
    for _ in range(reps):
        for name, dec in decoders.items():
            tokens = 0
            start = time.perf_counter()
            for ids in prompts:
                tokens += dec.generate(ids, new_tokens, stop_at_eos=False, stop=stop).metrics.generated_tokens
            times[name].append((time.perf_counter() - start) * 1000 / tokens)
    return {name: statistics.median(values) for name, values in times.items()}


def tune_and_measure(
    target: Transformer,
    tokenizer: Tokenizer,
    drafter: Transformer,
    *,
    tune_prompts: list[list[int]],
    eval_prompts: list[list[int]],
    new_tokens: int,
    reps: int,
    min_rounds: int,
    k: int = K,
) -> dict[str, Any]:
    records, costs = count_and_cost(target, tokenizer, drafter, tune_prompts, new_tokens, k)
    counts = sum_counts(records)
    assert counts is not None, "the counting run reported no draft-stop counts"
    plan = plan_draft_stop(
        counts,
        float(costs["cost_ratio"]),
        verify_cost={int(k): float(v) for k, v in costs["verify_cost"].items()},
        min_rounds=min_rounds,
    )
    out: dict[str, Any] = {
        "k": k,
        "chosen_threshold": plan.choice,
        "reason": plan.reason,
        "rounds_counted": counts.rounds,
        "costs": costs,
        "expected": {
            str(r.threshold): {
                "speedup": round(r.expected_speedup, 4),
                "pessimistic_speedup": round(r.pessimistic_speedup, 4),
                "hit_rate": round(r.hit_rate, 4) if r.hit_rate is not None else None,
                "drafted_per_round": round(r.drafted_per_round, 3),
            }
            for r in plan.rows
        },
    }
    if plan.choice is None:
        # Both arms would be one decoder: no gain to measure, so none is reported.
        out.update(gain=None, measured=False, gain_absent_reason=f"no threshold chosen: {plan.reason}")
        return out
    decoders = {
        "without": SpeculativeDecoder(target, tokenizer, DraftModelProposer(drafter), k=k),
        "tuned": SpeculativeDecoder(
            target, tokenizer, DraftModelProposer(drafter, confidence_threshold=plan.choice), k=k
        ),
    }
    times = ms_per_token(decoders, eval_prompts, new_tokens, reps)
    out.update(
        gain=round(times["without"] / times["tuned"], 4),
        measured=True,
        ms_per_token={name: round(ms, 4) for name, ms in times.items()},
    )
    return out


# The case that must choose: the stale drafter drafting twice as far, into positions it rarely gets right.
MUST_CHOOSE = "late_positions_poor"
MUST_CHOOSE_K = 8


def gain_figures(cases: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """``tuned_threshold_speedup_gain_<case>`` per case: the measured gain where a threshold was
    chosen, else None beside ``..._absent_reason``; the chosen thresholds; and whether the case
    that must choose did."""
    out: dict[str, Any] = {}
    for name, result in cases.items():
        key = f"tuned_threshold_speedup_gain_{name}"
        chosen = result["chosen_threshold"] is not None
        out[key] = result["gain"] if chosen else None
        if not chosen:
            out[f"{key}_absent_reason"] = result.get("gain_absent_reason") or "no threshold chosen"
        out[f"chosen_threshold_{name}"] = result["chosen_threshold"]
    if MUST_CHOOSE in cases:
        out["tuned_threshold_must_choose_case_chose"] = cases[MUST_CHOOSE]["chosen_threshold"] is not None
    return out


def measure(quick: bool = False) -> dict[str, Any]:
    """Tune the threshold of the stale and the realigned drafter on structured traffic, and of the
    stale one at k=8 (the case that must choose), and measure what each chosen one gains (see the
    module doc)."""
    target, tokenizer, generic = load_reference()
    realigned, realigned_source = realigned_drafter(target, tokenizer, generic, quick)
    n_tune, n_eval = (24, 12) if quick else (64, 24)
    new_tokens = 48 if quick else 64
    reps = 3 if quick else 5
    min_rounds = 200 if quick else 500
    tune = _prompts(tokenizer, "validation", n_tune, seed=21)
    held_out = _prompts(tokenizer, "test", n_eval, seed=7)
    setups = {"stale": (generic, K), "realigned": (realigned, K), MUST_CHOOSE: (generic, MUST_CHOOSE_K)}
    cases: dict[str, dict[str, Any]] = {}
    with torch.inference_mode():
        for name, (drafter, k) in setups.items():
            cases[name] = tune_and_measure(
                target,
                tokenizer,
                drafter,
                tune_prompts=tune,
                eval_prompts=held_out,
                new_tokens=new_tokens,
                reps=reps,
                min_rounds=min_rounds,
                k=k,
            )
    return {
        **gain_figures(cases),
        **{f"costs_{name}": result["costs"] for name, result in cases.items()},
        **cases,
        "realigned_drafter": realigned_source,
        "method": f"greedy, batch 1, k={K} (k={MUST_CHOOSE_K} for {MUST_CHOOSE}), structured domain; counts "
        "on validation-split prompts, speed on test-split prompts; median ms/token over interleaved "
        "repetitions; a gain only where a threshold was chosen",
        "quick": quick,
        "tune_prompts": n_tune,
        "eval_prompts": n_eval,
        "new_tokens": new_tokens,
        "reps": reps,
        "min_rounds": min_rounds,
        "threads": torch.get_num_threads(),
        "load_average_1m_at_end": round(os.getloadavg()[0], 2),
        "targets": {
            "tuned_threshold_speedup_gain_stale": ">= 1.0 where a threshold was chosen",
            "tuned_threshold_speedup_gain_realigned": ">= 1.0 where a threshold was chosen",
            f"tuned_threshold_speedup_gain_{MUST_CHOOSE}": ">= 1.0",
            "tuned_threshold_must_choose_case_chose": "true",
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer prompts and repetitions")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(max(1, args.threads))
    out = measure(quick=args.quick)
    for name in ("stale", "realigned", MUST_CHOOSE):
        r = out[name]
        shown = "none" if r["chosen_threshold"] is None else r["chosen_threshold"]
        gain = "not reported (no threshold)" if r["gain"] is None else f"x{r['gain']:.3f}"
        print(
            f"{name:>19}: k={r['k']}, threshold {shown} (cost ratio {r['costs']['cost_ratio']}, "
            f"{r['rounds_counted']} rounds): speed-up gain {gain}; {r['reason']}"
        )
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "drafters_threshold.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"load average (1 min) {out['load_average_1m_at_end']:.2f}; wrote {path}")


if __name__ == "__main__":
    main()
