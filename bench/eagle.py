"""A draft head beside the small-model drafter on the structured shift: hit rate, speed, ceiling.

Both are trained on the same traces (the target's own structured traces, the pre-drift prose
available for replay, exactly as ``bench/drafters_realign.py``) within the same time budget: the
generic drafter realigned by ``workers.training.realign``, an EAGLE-3-style head built for the
target (which has none) by ``workers.training.eagle``. Then, greedy, k = 4, batch size 1, on held-out
(test split) structured prompts each ending at its one-line answer:

- ``eagle_hit_rate_minus_draft_model_points``: the head's accepted / drafted minus the drafter's,
  in points;
- ``eagle_speedup_vs_draft_model``: decode tokens/s of the head's arm over the drafter's, both
  measured in one ``shadow_replay`` (arms interleaved per prompt, lossless check on);
- ``eagle_share_of_ceiling``: the head's decode speed-up over no speculation divided by that of a
  never-missing head measured in the same replay (``shadow_replay(ceiling_of="head")``: an arm
  that drafts the target's own greedy continuation through the head's real forwards, interleaved
  with the others); ``eagle_share_of_analytic_ceiling`` beside it divides by the Leviathan figure
  at acceptance 1 from the head's isolated costs instead,
  (k + 1) / (t_verify(k + 1) / t_target_step + k * c_head), a cross-check that leaves out the
  engine's per-round work;
- the per-step costs of both (c = one draft step / one target step, at a typical cache position),
  and the same arithmetic for an 8B target from published sizes (``published_8b``): at batch 1 a
  step reads every weight once, so a step's cost is its weight bytes over the target's.

Run as a script: writes bench/results/eagle.json. ``--quick``: fewer prompts, shorter budgets.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.engine import leviathan, measure_costs  # noqa: E402
from bench.realign import (  # noqa: E402
    PRE_DRIFT,
    STOPS,
    K,
    decode_figures,
    eval_prompts,
    load_reference,
    make_traces,
)
from workers.canary.replay import NEVER_MISSING, shadow_replay  # noqa: E402
from workers.engine.decoder import SpeculativeDecoder  # noqa: E402
from workers.engine.eagle import EagleHead, HeadProposer  # noqa: E402
from workers.engine.model import Transformer  # noqa: E402
from workers.training.eagle import HeadOptions, train_head  # noqa: E402
from workers.training.realign import RealignConfig, realign  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "eagle.json"
SHIFTED = "structured"
SHIFTED_TRACES = 1024
PROSE_TRACES = 512
TRACE_TOKENS = 128
EVAL_TOKENS = 96

# Published sizes (parameters) for the 8B arithmetic. Llama-3.1-8B: hidden 4096, 32 layers, MLP
# 14336, 8 KV heads of 128, vocabulary 128,256, untied: 8.03e9. Its EAGLE-3 head (one layer whose
# q/k/v read 2 x 4096, the MLP, a 32,000-id output projection; fc 3 x 4096 -> 4096 runs once a
# round on the target's states): per draft step it reads the layer and the output projection.
# A 0.5B drafter (Qwen2.5-0.5B's size: 0.49e9, 24 layers) reads all of itself per step.
PUBLISHED_8B = {
    "target_params": 8.03e9,
    "eagle3_head_params_per_step": 33_554_432 + 16_777_216 + 16_777_216 + 176_160_768 + 131_072_000,
    "eagle3_head_params_total": 424_689_664,
    "draft_model_params_per_step": 0.49e9,
    "verify_cost_k_plus_1": 1.0,  # memory-bound: k + 1 rows read the weights once, like one step
}


def measure_head_cost(target: Transformer, head: EagleHead, position: int, repeats: int = 100) -> float:
    """c of a head: one draft step (one pair through the layer, the output projection over the draft
    vocabulary) over one target step, medians of interleaved per-repetition ratios."""
    t_cache, h_cache = target.new_cache(1), head.new_cache()
    state = torch.zeros(1, 1, head.config.hidden_size)
    with torch.inference_mode():
        target.forward_cached(torch.randint(0, target.config.vocab_size, (1, position)), t_cache)
        head.forward_cached(
            torch.zeros(1, position, head.config.hidden_size),
            torch.zeros(1, position, dtype=torch.long),
            h_cache,
        )
        token = torch.tensor([[5]])
        ratios = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            target.forward_cached(token, t_cache)
            t1 = time.perf_counter()
            out = head.forward_cached(state, token, h_cache)
            int(head.logits(out)[0, -1].argmax())
            t2 = time.perf_counter()
            t_cache.rollback(position)
            h_cache.rollback(position)
            ratios.append((t2 - t1) / (t1 - t0))
    return statistics.median(ratios)


def published_arithmetic(drafter_hit: float, head_hit: float) -> dict[str, Any]:
    """Speed-ups over no speculation at k = K for an 8B target, costs from published sizes, at the
    hit rates measured here (i.i.d. acceptance: the Leviathan et al. formula)."""
    p = PUBLISHED_8B
    c_draft = p["draft_model_params_per_step"] / p["target_params"]
    c_head = p["eagle3_head_params_per_step"] / p["target_params"]
    verify = p["verify_cost_k_plus_1"]
    out = {"c_draft_model": round(c_draft, 4), "c_eagle3_head": round(c_head, 4), "k": K}
    for name, c, alpha in (("draft_model", c_draft, drafter_hit), ("eagle3_head", c_head, head_hit)):
        tokens, speedup = leviathan(alpha, K, c, verify)
        out[f"{name}_speedup_at_measured_hit_rate"] = round(speedup, 3)
        out[f"{name}_ceiling_speedup"] = round(leviathan(1.0, K, c, verify)[1], 3)
    out["eagle3_over_draft_model"] = round(
        out["eagle3_head_speedup_at_measured_hit_rate"] / out["draft_model_speedup_at_measured_hit_rate"], 3
    )
    out["sizes"] = PUBLISHED_8B
    return out


def measure(quick: bool = False, budget_s: float | None = None) -> dict[str, Any]:
    started = time.perf_counter()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    target, tokenizer, generic = load_reference()
    shifted = [
        replace(t, category=SHIFTED)
        for t in make_traces(target, tokenizer, SHIFTED, SHIFTED_TRACES, TRACE_TOKENS, 0)
    ]
    prose = [
        replace(t, category=PRE_DRIFT)
        for t in make_traces(target, tokenizer, PRE_DRIFT, PROSE_TRACES, TRACE_TOKENS, 0)
    ]
    budget = budget_s or (240.0 if quick else 900.0)

    def show(fraction: float, message: str) -> bool:
        print(f"  [{fraction:4.0%}] {message}", flush=True)
        return True

    cfg = RealignConfig(seed=0, time_budget_s=budget)
    print(f"drafter: realigning the generic drafter ({budget:.0f}s budget)", flush=True)
    drafted = realign(target, generic, tokenizer, shifted, prose, cfg, progress=show)
    print(f"head: building and training a head for the target ({budget:.0f}s budget)", flush=True)
    trained = train_head(target, None, tokenizer, shifted, prose, cfg, HeadOptions(), progress=show)
    drafter, head = drafted.model.eval(), trained.model.eval()

    n_eval = 8 if quick else 24
    stop = STOPS.get(SHIFTED, ())
    prompts = eval_prompts(tokenizer, SHIFTED, n_eval)
    drafter_fig = decode_figures(target, tokenizer, drafter, prompts, EVAL_TOKENS, stop)
    head_fig = decode_figures(target, tokenizer, HeadProposer(head), prompts, EVAL_TOKENS, stop)

    plain = SpeculativeDecoder(target, tokenizer, None, k=0)
    lengths = [
        max(1, plain.generate(ids, EVAL_TOKENS, stop_at_eos=False, stop=stop).metrics.generated_tokens)
        for ids in prompts
    ]
    replay = shadow_replay(
        target,
        tokenizer,
        {"baseline": None, "drafter": drafter, "head": HeadProposer(head)},
        prompts,
        K,
        lengths,
        repeats=1 if quick else 2,
        stop_at_eos=False,
        reference="baseline",
        measure_cost=False,
        ceiling_of="head",
    )
    base, d_arm, h_arm = (replay.arms[n] for n in ("baseline", "drafter", "head"))
    measured, nm_arm = replay.ceiling, replay.arms[NEVER_MISSING]
    assert measured is not None
    head_speedup = h_arm.decode_tokens_per_s / base.decode_tokens_per_s
    drafter_speedup = d_arm.decode_tokens_per_s / base.decode_tokens_per_s
    position = int(statistics.mean(len(p) for p in prompts) + statistics.mean(lengths) / 2)
    costs = measure_costs(target, drafter, position, repeats=30 if quick else 100)
    verify = costs["verify_cost"][str(K)]
    c_head = measure_head_cost(target, head, position, repeats=30 if quick else 100)
    head_ceiling = leviathan(1.0, K, c_head, verify)[1]
    drafter_ceiling = leviathan(1.0, K, costs["c"], verify)[1]
    return {
        "eagle_hit_rate_minus_draft_model_points": round(
            100 * (head_fig["hit_rate"] - drafter_fig["hit_rate"]), 2
        ),
        "eagle_speedup_vs_draft_model": round(h_arm.decode_tokens_per_s / d_arm.decode_tokens_per_s, 4),
        "eagle_share_of_ceiling": round(measured.share_of_ceiling, 4),
        "eagle_share_of_analytic_ceiling": round(head_speedup / head_ceiling, 4),
        "published_8b": published_arithmetic(drafter_fig["hit_rate"], head_fig["hit_rate"]),
        "measured": {
            "k": K,
            "head_hit_rate": round(head_fig["hit_rate"], 4),
            "drafter_hit_rate": round(drafter_fig["hit_rate"], 4),
            "head_tokens_per_step": round(head_fig["tokens_per_step"], 4),
            "drafter_tokens_per_step": round(drafter_fig["tokens_per_step"], 4),
            "target_step_ms": round(costs["target_step_ms"], 4),
            "drafter_step_ms": round(costs["drafter_step_ms"], 4),
            "c_drafter": round(costs["c"], 4),
            "c_head": round(c_head, 4),
            "head_step_ms": round(c_head * costs["target_step_ms"], 4),
            "verify_cost_k_plus_1": round(verify, 4),
            "cost_position": position,
            "head_speedup": round(head_speedup, 4),
            "drafter_speedup": round(drafter_speedup, 4),
            "head_ceiling_speedup": round(head_ceiling, 4),
            "head_measured_ceiling_speedup": round(measured.never_missing_speedup, 4),
            "head_measured_share_with_prefill": round(measured.share_of_ceiling_with_prefill, 4),
            "never_missing_head_hit_rate": measured.never_missing_hit_rate,
            "never_missing_head_propose_ms_per_step": round(nm_arm.propose_ms_per_step, 4),
            "drafter_ceiling_speedup": round(drafter_ceiling, 4),
            "drafter_share_of_analytic_ceiling": round(drafter_speedup / drafter_ceiling, 4),
            "head_propose_ms_per_step": round(h_arm.propose_ms_per_step, 4),
            "drafter_propose_ms_per_step": round(d_arm.propose_ms_per_step, 4),
            "head_score_ms_per_step": round(h_arm.score_ms_per_step, 4),
            "drafter_score_ms_per_step": round(d_arm.score_ms_per_step, 4),
            "plain_decode_tokens_per_s": round(base.decode_tokens_per_s, 2),
            "head_decode_tokens_per_s": round(h_arm.decode_tokens_per_s, 2),
            "drafter_decode_tokens_per_s": round(d_arm.decode_tokens_per_s, 2),
            "lossless": not replay.broken_arms,
            "head_params": sum(p.numel() for p in head.parameters()),
            "drafter_params": drafter.num_params(),
            "target_params": target.num_params(),
            "draft_vocab_size": head.config.draft_vocab_size,
            "aux_layers": list(head.config.aux_layers),
            "time_budget_s": budget,
            "drafter_train": {
                k: drafted.metrics[k] for k in ("wall_s", "steps_run", "stop_reason", "held_out_after")
            },
            "head_train": {
                k: trained.metrics[k]
                for k in ("wall_s", "steps_run", "stop_reason", "held_out_after", "teacher_s", "train_rows")
            },
            "eval_prompts": n_eval,
            "load_average_1m": round(os.getloadavg()[0], 2),
            "cpu_cores": os.cpu_count(),
            "wall_s": round(time.perf_counter() - started, 1),
        },
    }


def main() -> None:
    quick = "--quick" in sys.argv[1:]
    budget = next((float(a.split("=", 1)[1]) for a in sys.argv[1:] if a.startswith("--budget=")), None)
    out = measure(quick=quick, budget_s=budget)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=1) + "\n")
    m, p = out["measured"], out["published_8b"]
    rows = [
        ("", "head", "drafter"),
        ("hit rate", f"{m['head_hit_rate']:.1%}", f"{m['drafter_hit_rate']:.1%}"),
        ("tokens / verify step", f"{m['head_tokens_per_step']:.2f}", f"{m['drafter_tokens_per_step']:.2f}"),
        ("c (draft step / target step)", f"{m['c_head']:.3f}", f"{m['c_drafter']:.3f}"),
        ("decode speed-up vs none", f"{m['head_speedup']:.2f}x", f"{m['drafter_speedup']:.2f}x"),
        ("never-missing, measured", f"{m['head_measured_ceiling_speedup']:.2f}x", "-"),
        (
            "never-missing, analytic",
            f"{m['head_ceiling_speedup']:.2f}x",
            f"{m['drafter_ceiling_speedup']:.2f}x",
        ),
        (
            "8B arithmetic (published sizes)",
            f"{p['eagle3_head_speedup_at_measured_hit_rate']:.2f}x",
            f"{p['draft_model_speedup_at_measured_hit_rate']:.2f}x",
        ),
    ]
    for a, b, c in rows:
        print(f"{a:34s} {b:>10s} {c:>10s}")
    print(
        "eagle_hit_rate_minus_draft_model_points "
        f"{out['eagle_hit_rate_minus_draft_model_points']:+.1f} (>= 0); "
        f"eagle_speedup_vs_draft_model {out['eagle_speedup_vs_draft_model']:.2f}; "
        f"eagle_share_of_ceiling {out['eagle_share_of_ceiling']:.2f} (>= 0.75; of the analytic ceiling "
        f"{out['eagle_share_of_analytic_ceiling']:.2f}); target step "
        f"{m['target_step_ms']:.2f} ms, verify {m['verify_cost_k_plus_1']:.2f}x; "
        f"load {m['load_average_1m']:.1f}"
    )
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
