"""Speculative-decoding engine benchmark on the committed reference pair (hit rate, speed-up, cost ratios).

Batch size 1, greedy, on CPU, every ratio measured in one run. Per domain (prose and structured;
``--with-code`` adds code, which the reference target cannot make pay: bench/domain_ceiling.py says
why) and k in {2, 4, 6}: hit rate (accepted / drafted), mean accepted length per verify step, tokens/s of
plain greedy decoding, of draft-model speculation with the generic drafter and of n-gram prompt
lookup, and the speed-ups over plain decoding. Beside them: the measured cost ratio c (drafter step /
target step), the measured cost of verifying k+1 tokens vs one, the Leviathan et al. prediction
from the measured α and those costs, and our engine against Hugging Face
`generate(assistant_model=...)` on the same pair, prompts and k. A structured request ends with
its one-line answer (stop "\n", bench/realign.py's STOPS, as the demo's client ends it); the others
run to --new-tokens. Transformers runs each request to the length ours served.

Timing on a shared machine drifts, so arms are interleaved (every arm runs on a prompt before the
next prompt; arm order shuffled per prompt with a fixed seed), repeated, and summarised by medians
over repetitions of paired ratios. Hit rates and tokens per verify step are exact counts (greedy
decoding is deterministic), so they do not need repetitions.

Prints a table and writes bench/results/engine.json.

Usage: .venv/bin/python bench/engine.py [--prompts 8] [--new-tokens 128] [--reps 3] [--with-code]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.realign import STOPS  # noqa: E402
from workers import corpora  # noqa: E402
from workers.engine.decoder import SpeculativeDecoder  # noqa: E402
from workers.engine.hf_io import load_hf_folder  # noqa: E402
from workers.engine.model import NUMPY_STEP_ROWS, Transformer  # noqa: E402
from workers.engine.proposers import DraftModelProposer, NgramProposer  # noqa: E402
from workers.engine.tokenizer import Tokenizer, ensure_same_tokenizer  # noqa: E402

REFERENCE = ROOT / "workers" / "models" / "reference"
RESULTS = ROOT / "bench" / "results" / "engine.json"
KS = (2, 4, 6)
DOMAINS = ("prose", "structured")  # --with-code adds "code"
NGRAM_N = 3
# Prompts stay short enough that prompt + new tokens fit the 512-token window with room to spare,
# and inside the positions the drafter was distilled on (<= 448).
MAX_PROMPT_CHARS = 700
MAX_PROMPT_TOKENS = 256


@dataclass
class Cell:
    """Counts of one (domain, arm) over all prompts, and timings per sample (one request: a prompt in a
    repetition), so that every ratio pairs runs made seconds apart on the same prompt."""

    drafted: int = 0
    accepted: int = 0
    steps: int = 0
    rejections: int = 0  # verify steps that ended on a rejected draft (for the MLE of α)
    generated: int = 0
    # Per sample: wall time, tokens, the engine's own split of decode time into proposing (drafter)
    # and scoring (target verify forwards), verify rounds, accepted drafts and rejections.
    seconds: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    propose_s: list[float] = field(default_factory=list)
    score_s: list[float] = field(default_factory=list)
    rounds: list[int] = field(default_factory=list)
    acc: list[int] = field(default_factory=list)
    rej: list[int] = field(default_factory=list)
    # Output tokens of each request (the first repetition): its length up to the stop string, if any.
    request_tokens: list[int] = field(default_factory=list)

    def tps(self) -> list[float]:
        return [t / s for t, s in zip(self.tokens, self.seconds, strict=True)]

    def start_rep(self) -> None:
        for series in (
            self.seconds,
            self.tokens,
            self.propose_s,
            self.score_s,
            self.rounds,
            self.acc,
            self.rej,
        ):
            series.append(0)


def load_pair(folder: Path) -> tuple[Transformer, Transformer, Tokenizer]:
    target, tok_t = load_hf_folder(folder / "target")
    drafter, tok_d = load_hf_folder(folder / "generic-drafter")
    ensure_same_tokenizer(tok_t, tok_d, "reference target", "generic drafter")
    return target, drafter, tok_t


def make_prompts(tokenizer: Tokenizer, n: int, domains: tuple[str, ...]) -> dict[str, list[list[int]]]:
    out = {}
    for domain in domains:
        prompts = corpora.prompts(domain, "test", n, seed=1, max_prompt_chars=MAX_PROMPT_CHARS)
        out[domain] = [tokenizer.encode(p.text)[-MAX_PROMPT_TOKENS:] for p in prompts]
    return out


def arms(target: Transformer, drafter: Transformer, tokenizer: Tokenizer) -> dict[str, SpeculativeDecoder]:
    decoders = {"plain": SpeculativeDecoder(target, tokenizer, None, k=0)}
    for k in KS:
        decoders[f"draft_k{k}"] = SpeculativeDecoder(target, tokenizer, DraftModelProposer(drafter), k=k)
        decoders[f"ngram_k{k}"] = SpeculativeDecoder(target, tokenizer, NgramProposer(NGRAM_N), k=k)
    return decoders


def run_speculation(
    decoders: dict[str, SpeculativeDecoder],
    prompts: dict[str, list[list[int]]],
    new_tokens: int,
    reps: int,
    seed: int,
) -> dict[str, dict[str, Cell]]:
    cells = {d: {a: Cell() for a in decoders} for d in prompts}
    rng = random.Random(seed)
    reference: dict[tuple[str, int], list[int]] = {}
    for rep in range(reps):
        t_rep = time.perf_counter()
        for domain, plist in prompts.items():
            for i, ids in enumerate(plist):
                for cell in cells[domain].values():
                    cell.start_rep()
                order = list(decoders)
                rng.shuffle(order)
                for name in order:
                    stop = STOPS.get(domain, ())
                    res = decoders[name].generate(ids, new_tokens, stop_at_eos=False, stop=stop)
                    m = res.metrics
                    cell = cells[domain][name]
                    cell.seconds[-1] += m.total_ms / 1000.0
                    cell.tokens[-1] += m.generated_tokens
                    cell.propose_s[-1] += m.propose_ms / 1000.0
                    cell.score_s[-1] += m.score_ms / 1000.0
                    cell.rounds[-1] += m.verify_steps
                    cell.acc[-1] += m.accepted_tokens
                    rejections = sum(
                        1 for d, a in zip(m.per_step_drafted, m.per_step_accepted, strict=True) if a < d
                    )
                    cell.rej[-1] += rejections
                    # Every arm must emit exactly plain greedy's tokens: a wrong speed-up is no speed-up.
                    key = (domain, i)
                    if key not in reference:
                        reference[key] = res.token_ids
                    elif res.token_ids != reference[key]:
                        raise AssertionError(f"{name} diverged from greedy on {domain} prompt {i}")
                    if rep == 0:
                        cell.drafted += m.drafted_tokens
                        cell.accepted += m.accepted_tokens
                        cell.steps += m.verify_steps
                        cell.generated += m.generated_tokens
                        cell.rejections += rejections
                        cell.request_tokens.append(m.generated_tokens)
        print(f"  repetition {rep + 1}/{reps} took {time.perf_counter() - t_rep:.0f}s", flush=True)
    return cells


@torch.inference_mode()
def measure_costs(
    target: Transformer, drafter: Transformer, position: int, repeats: int = 100
) -> dict[str, Any]:
    """Isolated costs at a typical cache position: one target step, a (k+1)-token verify, one drafter step.

    The forwards are interleaved within each repetition and summarised as medians of per-repetition
    ratios, so a burst of load on the machine moves numerator and denominator together.
    """
    caches = {"target": target.new_cache(1), "drafter": drafter.new_cache(1)}
    for name, model in (("target", target), ("drafter", drafter)):
        model.forward_cached(torch.randint(0, model.config.vocab_size, (1, position)), caches[name])
    inputs = {n: torch.randint(0, target.config.vocab_size, (1, n)) for n in (1, *(k + 1 for k in KS))}

    def timed(model: Transformer, cache_name: str, n: int) -> float:
        cache = caches[cache_name]
        t0 = time.perf_counter()
        model.forward_cached(inputs[n], cache)
        dt = time.perf_counter() - t0
        cache.rollback(position)
        return dt

    t1s, d1s = [], []
    verify: dict[int, list[float]] = {k: [] for k in KS}
    for _ in range(repeats):
        t1 = timed(target, "target", 1)
        t1s.append(t1)
        d1s.append(timed(drafter, "drafter", 1) / t1)
        for k in KS:
            verify[k].append(timed(target, "target", k + 1) / t1)
    return {
        "position": position,
        "target_step_ms": statistics.median(t1s) * 1e3,
        "drafter_step_ms": statistics.median(t1s) * statistics.median(d1s) * 1e3,
        "c": statistics.median(d1s),
        "verify_cost": {str(k): statistics.median(v) for k, v in verify.items()},
    }


def leviathan(alpha: float, k: int, c: float, verify_cost: float) -> tuple[float, float]:
    """(expected tokens per verify step, predicted speed-up) for i.i.d. acceptance α."""
    e = (1 - alpha ** (k + 1)) / (1 - alpha) if alpha < 1 else k + 1.0
    return e, e / (verify_cost + k * c)


def hf_assisted(
    folder: Path,
    prompts: dict[str, list[list[int]]],
    lengths: dict[str, list[int]],
    k: int,
    reps: int,
    ours: dict[str, Any],
) -> dict[str, Any]:
    """tokens/s of transformers' assisted generation on the same pair, prompts and k, each request
    run to the length ours served (``lengths``, per domain and prompt)."""
    try:
        import transformers
        from transformers import AutoModelForCausalLM
    except ImportError:
        return {"skipped": "transformers is not installed"}
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    target = AutoModelForCausalLM.from_pretrained(folder / "target", dtype=torch.float32).eval()
    drafter = AutoModelForCausalLM.from_pretrained(folder / "generic-drafter", dtype=torch.float32).eval()
    gen_kwargs: dict[str, Any] = {
        "do_sample": False,
        "assistant_model": drafter,
        "num_assistant_tokens": k,
        "num_assistant_tokens_schedule": "constant",
        "assistant_confidence_threshold": 0.0,  # draft exactly k, like our engine
        "pad_token_id": 0,
    }
    drafter.generation_config.num_assistant_tokens = k
    drafter.generation_config.num_assistant_tokens_schedule = "constant"
    drafter.generation_config.assistant_confidence_threshold = 0.0
    out: dict[str, Any] = {"transformers": transformers.__version__, "k": k, "per_domain": {}}
    with torch.inference_mode():
        target.generate(torch.tensor([prompts["prose"][0]]), max_new_tokens=8, min_new_tokens=8, **gen_kwargs)
        for domain, plist in prompts.items():
            tps = []
            for _ in range(reps):
                tokens, seconds = 0, 0.0
                for ids, n in zip(plist, lengths[domain], strict=True):
                    x = torch.tensor([ids])
                    t0 = time.perf_counter()
                    # The same number of tokens as our run (which ignores end-of-text).
                    y = target.generate(
                        x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n, **gen_kwargs
                    )
                    seconds += time.perf_counter() - t0
                    tokens += y.shape[1] - x.shape[1]
                tps.append(tokens / seconds)
            hf = statistics.median(tps)
            out["per_domain"][domain] = {
                "hf_tokens_per_s": hf,
                "ours_tokens_per_s": ours[domain],
                "ratio": ours[domain] / hf,
            }
    out["ratio_min"] = min(v["ratio"] for v in out["per_domain"].values())
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reference", type=Path, default=REFERENCE)
    p.add_argument("--prompts", type=int, default=8, help="prompts per domain")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--hf-reps", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-hf", action="store_true", help="skip the transformers comparison")
    p.add_argument(
        "--numpy-steps",
        action="store_true",
        help="decode one-row steps in NumPy (off by default in the engine: see workers/engine/model.py)",
    )
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument(
        "--with-code",
        action="store_true",
        help="measure the code domain too (the reference target cannot make it pay: bench/domain_ceiling.py)",
    )
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()

    target, drafter, tokenizer = load_pair(args.reference)
    domains = (*DOMAINS, "code") if args.with_code else DOMAINS
    prompts = make_prompts(tokenizer, args.prompts, domains)
    kernel, other = ("numpy", "torch") if args.numpy_steps else ("torch", "numpy")

    def use_steps(name: str) -> None:
        for model in (target, drafter):
            model.numpy_step_rows = NUMPY_STEP_ROWS if name == "numpy" else 0

    n_prompt = {d: statistics.mean(len(x) for x in v) for d, v in prompts.items()}
    print(
        f"target {target.num_params():,} params, generic drafter {drafter.num_params():,}; "
        f"{args.prompts} prompts/domain (mean prompt tokens {n_prompt}), {args.new_tokens} new tokens, "
        f"{args.reps} repetitions, {torch.get_num_threads()} threads",
        flush=True,
    )

    mean_len = int(statistics.mean(len(x) for v in prompts.values() for x in v)) + args.new_tokens // 2
    # Both step kernels' costs, measured back to back; the run then uses the chosen one.
    use_steps(other)
    other_costs = measure_costs(target, drafter, mean_len)
    use_steps(kernel)
    costs = measure_costs(target, drafter, mean_len)
    print(
        f"decoding steps on {kernel} (target step {costs['target_step_ms']:.2f} ms, drafter step "
        f"{costs['drafter_step_ms']:.3f} ms); on {other}: target step "
        f"{other_costs['target_step_ms']:.2f} ms, drafter step {other_costs['drafter_step_ms']:.3f} ms, "
        "verify k+1 vs 1: " + ", ".join(f"k={k}: {v:.2f}x" for k, v in other_costs["verify_cost"].items()),
        flush=True,
    )
    print(
        f"costs at position {mean_len}: target step {costs['target_step_ms']:.2f} ms, drafter step "
        f"{costs['drafter_step_ms']:.3f} ms, c = {costs['c']:.3f}, verify k+1 vs 1: "
        + ", ".join(f"k={k}: {v:.2f}x" for k, v in costs["verify_cost"].items()),
        flush=True,
    )

    decoders = arms(target, drafter, tokenizer)
    for dec in decoders.values():  # warm up every path once
        dec.generate(prompts["prose"][0], 16, stop_at_eos=False)
    cells = run_speculation(decoders, prompts, args.new_tokens, args.reps, args.seed)

    rows: list[dict[str, Any]] = []
    efficiency: list[float] = []
    for domain, by_arm in cells.items():
        plain = by_arm["plain"].tps()
        for k in KS:
            row: dict[str, Any] = {"domain": domain, "k": k, "plain_tokens_per_s": statistics.median(plain)}
            for kind in ("draft", "ngram"):
                cell = by_arm[f"{kind}_k{k}"]
                tps = cell.tps()
                ratios = [a / b for a, b in zip(tps, plain, strict=True)]
                row[f"{kind}_hit_rate"] = cell.accepted / cell.drafted if cell.drafted else 0.0
                row[f"{kind}_tokens_per_step"] = cell.generated / cell.steps if cell.steps else 1.0
                row[f"{kind}_tokens_per_s"] = statistics.median(tps)
                row[f"{kind}_speedup"] = statistics.median(ratios)
            cell, base = by_arm[f"draft_k{k}"], by_arm["plain"]
            # MLE of a per-token acceptance probability from truncated geometric runs.
            alpha = (
                cell.accepted / (cell.accepted + cell.rejections) if cell.accepted + cell.rejections else 0.0
            )
            # Per request, from the same interleaved runs as the speed-ups: its own α and in-situ costs
            # (one plain target step, one verify of k+1 tokens, one drafter forward; k of them a round).
            step = [sc / r for sc, r in zip(base.score_s, base.rounds, strict=True)]
            v = [sc / r / t for sc, r, t in zip(cell.score_s, cell.rounds, step, strict=True)]
            c = [p / r / k / t for p, r, t in zip(cell.propose_s, cell.rounds, step, strict=True)]
            alphas = [a / (a + j) if a + j else 0.0 for a, j in zip(cell.acc, cell.rej, strict=True)]
            preds = [leviathan(a, k, ci, vi)[1] for a, ci, vi in zip(alphas, c, v, strict=True)]
            ratios = [a / b for a, b in zip(cell.tps(), base.tps(), strict=True)]
            iso = leviathan(alpha, k, costs["c"], costs["verify_cost"][str(k)])[1]
            row.update(
                alpha=alpha,
                c_in_situ=statistics.median(c),
                verify_cost_in_situ=statistics.median(v),
                leviathan_tokens_per_step=leviathan(alpha, k, 0.0, 1.0)[0],
                leviathan_speedup=statistics.median(preds),
                efficiency_vs_leviathan=statistics.median(
                    [r / p for r, p in zip(ratios, preds, strict=True)]
                ),
                leviathan_speedup_isolated_costs=iso,
                # The ceiling of any drafter at this k and these costs: every draft accepted.
                perfect_drafter_speedup=statistics.median(
                    [leviathan(1.0, k, ci, vi)[1] for ci, vi in zip(c, v, strict=True)]
                ),
            )
            efficiency.append(row["efficiency_vs_leviathan"])
            rows.append(row)

    header = (
        f"{'domain':<11}{'k':>2} {'plain t/s':>9} | {'draft hit':>9} {'tok/step':>8} {'t/s':>6} "
        f"{'speedup':>7} {'c':>5} {'V(k+1)':>6} {'Leviathan':>9} {'eff':>5} | "
        f"{'ngram hit':>9} {'tok/step':>8} {'t/s':>6} {'speedup':>7}"
    )
    print("\n" + header + "\n" + "-" * len(header))
    for r in rows:
        print(
            f"{r['domain']:<11}{r['k']:>2} {r['plain_tokens_per_s']:>9.0f} | {r['draft_hit_rate']:>9.1%} "
            f"{r['draft_tokens_per_step']:>8.2f} {r['draft_tokens_per_s']:>6.0f} {r['draft_speedup']:>6.2f}x "
            f"{r['c_in_situ']:>5.3f} {r['verify_cost_in_situ']:>6.2f} "
            f"{r['leviathan_speedup']:>8.2f}x {r['efficiency_vs_leviathan']:>5.2f} | "
            f"{r['ngram_hit_rate']:>9.1%} "
            f"{r['ngram_tokens_per_step']:>8.2f} {r['ngram_tokens_per_s']:>6.0f} {r['ngram_speedup']:>6.2f}x"
        )

    by = {(r["domain"], r["k"]): r for r in rows}
    hf: dict[str, Any] = {"skipped": "--no-hf"}
    if not args.no_hf:
        ours = {d: by[(d, 4)]["draft_tokens_per_s"] for d in cells}
        lengths = {d: cells[d]["plain"].request_tokens for d in cells}
        hf = hf_assisted(args.reference, prompts, lengths, 4, args.hf_reps, ours)
        if "per_domain" in hf:
            print("\nHF generate(assistant_model=generic drafter), k=4 vs our engine (tokens/s):")
            for d, v in hf["per_domain"].items():
                print(
                    f"  {d:<11} HF {v['hf_tokens_per_s']:6.0f}   ours {v['ours_tokens_per_s']:6.0f}   "
                    f"{v['ratio']:.2f}x"
                )

    result: dict[str, Any] = {}
    for d in cells:
        result[f"generic_{d}_hit_rate"] = by[(d, 4)]["draft_hit_rate"]
        result[f"generic_{d}_speedup"] = by[(d, 4)]["draft_speedup"]
    result |= {
        "efficiency_vs_leviathan": min(efficiency),
        # What a drafter that never misses would reach at k=4 with the costs measured in situ: the
        # most any realignment can give, and so the most it can beat the generic drafter by.
        "perfect_drafter_speedup_k4": {d: by[(d, 4)]["perfect_drafter_speedup"] for d in cells},
        "speedup_vs_hf_assisted": hf.get("ratio_min"),
        "costs": costs,
        "step_kernel": kernel,
        f"costs_with_{other}_steps": other_costs,
        "hf_assisted": hf,
        "cells": rows,
        "settings": {
            "prompts_per_domain": args.prompts,
            "new_tokens": args.new_tokens,
            "reps": args.reps,
            "threads": torch.get_num_threads(),
            "ngram_n": NGRAM_N,
            "greedy": True,
            "batch_size": 1,
            "mean_prompt_tokens": n_prompt,
            "domains": list(cells),
            "stop": {d: list(STOPS.get(d, ())) for d in cells},
            "mean_output_tokens": {d: statistics.mean(cells[d]["plain"].request_tokens) for d in cells},
            # Timing depends on what else the machine runs: record its load beside the numbers.
            "loadavg_at_end": os.getloadavg(),
            "reference": str(args.reference),
        },
        "wall_s": time.perf_counter() - t_start,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    per_domain = "; ".join(
        f"{d} hit {result[f'generic_{d}_hit_rate']:.1%} {result[f'generic_{d}_speedup']:.2f}x" for d in cells
    )
    print(
        f"\ngeneric drafter, k=4: {per_domain}; lowest efficiency vs Leviathan "
        f"{result['efficiency_vs_leviathan']:.2f}; vs HF assisted {result['speedup_vs_hf_assisted']}"
    )
    ceiling = result["perfect_drafter_speedup_k4"]
    print(
        "a drafter that never misses, k=4, these costs: "
        + ", ".join(f"{d} {ceiling[d]:.2f}x" for d in cells)
        + " (the most realignment can reach; over the generic drafter's speed-up, the most it can beat it by)"
    )
    print(f"wrote {args.out} in {result['wall_s']:.0f}s")


if __name__ == "__main__":
    main()
