"""Realignment on the reference setup: does retraining on the deployment's own traffic pay, and how fast?

Setup: the committed reference target and generic drafter (distilled on prose only). Traffic shifts
to the code domain: the traces are the target's own greedy completions of code prompts (train
split of workers.corpora), plus pre-drift prose traces for the replay share. Realignment runs
``workers.training.realign.realign`` from the generic drafter under its default time budget.

Measured, batch size 1, greedy, k=4, with the engine's SpeculativeDecoder metrics (hit rate =
accepted / drafted): the generic and the realigned drafter on held-out code prompts (test split)
and on held-out prose prompts; the wall time of realignment (dataset, target pass, training) and
the training throughput in completion tokens per second. Writes bench/results/realign.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from workers import corpora  # noqa: E402
from workers.engine.decoder import SpeculativeDecoder, generate_batch  # noqa: E402
from workers.engine.hf_io import load_hf_folder  # noqa: E402
from workers.engine.model import Transformer  # noqa: E402
from workers.engine.proposers import DraftModelProposer  # noqa: E402
from workers.engine.tokenizer import Tokenizer  # noqa: E402
from workers.training.realign import RealignConfig, TraceText, realign  # noqa: E402

REFERENCE = ROOT / "workers" / "models" / "reference"
RESULTS = ROOT / "bench" / "results"
PROMPT_TOKENS = 160  # equal-length prompts let the target continue a whole batch at once
K = 4


def make_traces(
    target: Transformer, tokenizer: Tokenizer, domain: str, n: int, new_tokens: int, seed: int
) -> list[TraceText]:
    """The target's greedy continuations of ``n`` train-split prompts of ``domain``, as text traces."""
    ids: list[list[int]] = []
    rounds = 0
    while len(ids) < n and rounds < 20:
        # One prompt per document per round; another seed cuts the documents elsewhere.
        for p in corpora.prompts(domain, "train", n=n, seed=seed + rounds, min_prompt_chars=400):
            tokens = tokenizer.encode(p.text)
            if len(tokens) >= PROMPT_TOKENS:
                ids.append(tokens[-PROMPT_TOKENS:])
        rounds += 1
    ids = ids[:n]
    traces: list[TraceText] = []
    with torch.inference_mode():
        for lo in range(0, len(ids), 64):
            batch = torch.tensor(ids[lo : lo + 64])
            out = generate_batch(target, batch, new_tokens)  # [B, new_tokens]
            for row, prompt in zip(out.tolist(), ids[lo : lo + 64], strict=True):
                if tokenizer.eos_id is not None and tokenizer.eos_id in row:
                    row = row[: row.index(tokenizer.eos_id)]
                key = f"{domain}-{len(traces)}"
                traces.append(TraceText(key, tokenizer.decode(prompt), tokenizer.decode(row)))
    return traces


def hit_rate(
    target: Transformer, tokenizer: Tokenizer, drafter: Transformer, prompts: list[list[int]], new_tokens: int
) -> float:
    decoder = SpeculativeDecoder(target, tokenizer, DraftModelProposer(drafter), k=K)
    drafted = accepted = 0
    for ids in prompts:
        m = decoder.generate(ids, new_tokens, stop_at_eos=False).metrics
        drafted += m.drafted_tokens
        accepted += m.accepted_tokens
    return accepted / drafted if drafted else 0.0


def eval_prompts(tokenizer: Tokenizer, domain: str, n: int) -> list[list[int]]:
    return [tokenizer.encode(p.text)[-256:] for p in corpora.prompts(domain, "test", n=n, seed=7)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--code-traces", type=int, default=384)
    parser.add_argument("--prose-traces", type=int, default=128)
    parser.add_argument("--trace-tokens", type=int, default=128)
    parser.add_argument("--eval-prompts", type=int, default=24)
    parser.add_argument("--eval-tokens", type=int, default=96)
    parser.add_argument("--time-budget-s", type=float, default=240.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    torch.set_num_threads(max(1, args.threads))
    target, tokenizer = load_hf_folder(REFERENCE / "target")
    generic, _ = load_hf_folder(REFERENCE / "generic-drafter")
    print(f"cpu threads {torch.get_num_threads()}, torch {torch.__version__}", flush=True)

    t0 = time.perf_counter()
    code = make_traces(target, tokenizer, "code", args.code_traces, args.trace_tokens, args.seed)
    prose = make_traces(target, tokenizer, "prose", args.prose_traces, args.trace_tokens, args.seed)
    print(f"traces: {len(code)} code, {len(prose)} prose ({time.perf_counter() - t0:.0f}s, not timed)")

    code_eval = eval_prompts(tokenizer, "code", args.eval_prompts)
    prose_eval = eval_prompts(tokenizer, "prose", args.eval_prompts)
    generic_code = hit_rate(target, tokenizer, generic, code_eval, args.eval_tokens)
    generic_prose = hit_rate(target, tokenizer, generic, prose_eval, args.eval_tokens)

    def show(fraction: float, message: str) -> bool:
        print(f"  [{fraction:4.0%}] {message}", flush=True)
        return True

    cfg = RealignConfig(seed=args.seed, time_budget_s=args.time_budget_s)
    result = realign(target, generic, tokenizer, code, prose, cfg, progress=show)
    m = result.metrics
    realigned_code = hit_rate(target, tokenizer, result.model, code_eval, args.eval_tokens)
    realigned_prose = hit_rate(target, tokenizer, result.model, prose_eval, args.eval_tokens)

    out = {
        "generic_code_hit_rate": round(generic_code, 4),
        "realigned_code_hit_rate": round(realigned_code, 4),
        "generic_prose_hit_rate": round(generic_prose, 4),
        "realigned_prose_hit_rate": round(realigned_prose, 4),
        "prose_hit_rate_drop_points": round(100 * (generic_prose - realigned_prose), 2),
        "wall_s": m["wall_s"],
        "train_tokens_per_s": m["train_tokens_per_s"],
        "teacher_s": m["teacher_s"],
        "train_s": m["train_s"],
        "steps_run": m["steps_run"],
        "stop_reason": m["stop_reason"],
        "held_out_before": m["held_out_before"],
        "held_out_after": m["held_out_after"],
        "train_rows": m["train_rows"],
        "replay_rows": m["replay_rows"],
        "train_completion_tokens": m["train_completion_tokens"],
        "k": K,
        "eval_prompts_per_domain": args.eval_prompts,
        "eval_new_tokens": args.eval_tokens,
        "device": m["device"],
        "threads": torch.get_num_threads(),
        "cpu_cores": os.cpu_count(),
        # Other jobs on the machine slow every figure above; the 1-minute load says how busy it was.
        "load_average_1m_at_end": round(os.getloadavg()[0], 2),
        "targets": {
            "realigned_code_hit_rate": ">= 0.80",
            "prose_hit_rate_drop_points": "<= 5",
            "wall_s": "<= 300 on 2 CPU cores",
            "train_tokens_per_s": ">= 5000",
        },
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "realign.json").write_text(json.dumps(out, indent=1) + "\n")
    print(f"\n{'drafter':<12}{'code hit':>10}{'prose hit':>11}")
    print(f"{'generic':<12}{generic_code:>10.1%}{generic_prose:>11.1%}")
    print(f"{'realigned':<12}{realigned_code:>10.1%}{realigned_prose:>11.1%}")
    print(
        f"\nrealignment wall {m['wall_s']:.0f}s (target pass {m['teacher_s']:.0f}s, "
        f"training {m['train_s']:.0f}s, "
        f"{m['steps_run']} steps, {m['stop_reason']}); training {m['train_tokens_per_s']:.0f} tokens/s; "
        f"prose drop {out['prose_hit_rate_drop_points']:+.1f} points"
    )
    print(f"wrote {RESULTS / 'realign.json'}")


if __name__ == "__main__":
    main()
