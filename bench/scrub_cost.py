"""The hit-rate cost of scrubbing: the same traces realigned raw and scrubbed, scored on the same
held-out prompts. Adds its figures to bench/results/scrub.json (``bench/scrub.py`` writes the rest).

    python bench/scrub_cost.py --quick   # 384 structured + 128 prose traces, 2 epochs (~15 min on 2 cores)
    python bench/scrub_cost.py           # 1,024 + 512 traces, 4 epochs

Setup, as ``bench/realign.py``'s (whose trace cache it shares): the committed reference target and
generic drafter; traces are the target's own greedy completions of structured (SQL and tool-call)
prompts of the validation split, plus prose traces replayed against forgetting. Structured traffic
carries personal data the way tool calls do: e-mail addresses in requests and in the calls that
answer them (``send_email``, ``INSERT INTO customers``). The scrubbed arm passes every trace (prompt
and completion together, a fresh key each, as the service stores them) through
``controlplane.traces.scrub.scrub_trace``; the raw arm keeps them as they are. Both arms realign the
generic drafter with the same configuration and seed, a fixed number of epochs (not a time budget,
so that machine load cannot give one arm more steps) and the target's top-K teacher.

Scored (batch size 1, greedy, k=4, hit rate = accepted / drafted) on held-out prompts of the test
split (other documents than any trace's; the bench asserts that no held-out prompt's normalised
text occurs among the training prompts), never scrubbed, as users send them:

* ``scrub_hit_rate_cost_points``: raw-arm hit rate minus scrubbed-arm hit rate, in points, on the
  held-out prompts whose answer (the test document's next line) holds personal data: where
  scrubbing can cost;
* ``scrub_hit_rate_cost_points_all_prompts``: the same on a sample of all held-out prompts.

The two arms differ only in the text of the traces, so the difference is the cost of scrubbing; its
noise is that of two realignments on the same data with one seed (the training order and held-out
split are the same in both arms; a repeated run reproduced the raw arm's hit rates exactly).

Measured (``--quick``, 2 shared cores), raw vs scrubbed on the 24 prompts whose answer holds an
address: 45.7% vs 45.0% (+0.7 points); 45.6% vs 46.1% on all prompts. Earlier surrogates cost
more: +4.6 points when an address's local part became pronounceable pseudo-words, +3.3 with other
names; this corpus spells each address from a name the request also writes (``Sara Cohen``,
``sara.cohen@example.com``), names are not scrubbed, and a surrogate that broke that link taught
the drafter to hedge where the target copies. Surrogates now keep such a name and change the
domain (``controlplane.traces.surrogates``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.realign import PRE_DRIFT, RESULTS, STOPS, load_reference, make_traces  # noqa: E402
from controlplane.traces.holdout import normalised_prompt  # noqa: E402
from controlplane.traces.scrub import scrub, scrub_trace  # noqa: E402
from workers import corpora  # noqa: E402
from workers.engine.decoder import SpeculativeDecoder  # noqa: E402
from workers.engine.model import Transformer  # noqa: E402
from workers.engine.proposers import DraftModelProposer  # noqa: E402
from workers.engine.tokenizer import Tokenizer  # noqa: E402
from workers.training.realign import RealignConfig, TraceText, realign  # noqa: E402

DOMAIN = "structured"
K = 4
EVAL_PROMPT_TOKENS = 256


def scrubbed(traces: list[TraceText]) -> list[TraceText]:
    """Each trace's prompt and completion scrubbed together, as the service stores them."""
    out = []
    for trace in traces:
        prompt, completion = scrub_trace([trace.prompt, trace.completion])
        out.append(replace(trace, prompt=prompt.text, completion=completion.text))
    return out


def has_personal_data(trace: TraceText) -> bool:
    return bool(scrub(trace.prompt).replacements or scrub(trace.completion).replacements)


def held_out_prompts(tokenizer: Tokenizer, n: int, seed: int) -> tuple[list[str], list[str]]:
    """Test-split prompts whose answer (the document's next line) holds personal data, and a
    sample of all test-split prompts: up to ``n`` of each."""
    with_data: list[str] = []
    sample: list[str] = []
    for prompt in corpora.prompts(DOMAIN, "test", n=400, seed=seed, min_prompt_chars=100):
        answer = prompt.reference.split("\n", 1)[0]
        if len(with_data) < n and scrub(answer).replacements:
            with_data.append(prompt.text)
        if len(sample) < n:
            sample.append(prompt.text)
    return with_data, sample


def hit_rate(
    target: Transformer, tokenizer: Tokenizer, drafter: Transformer, prompts: list[str], new_tokens: int
) -> float:
    decoder = SpeculativeDecoder(target, tokenizer, DraftModelProposer(drafter), k=K)
    drafted = accepted = 0
    for text in prompts:
        ids = tokenizer.encode(text)[-EVAL_PROMPT_TOKENS:]
        metrics = decoder.generate(ids, new_tokens, stop_at_eos=False, stop=STOPS.get(DOMAIN, ())).metrics
        drafted += metrics.drafted_tokens
        accepted += metrics.accepted_tokens
    return accepted / drafted if drafted else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer traces and epochs")
    parser.add_argument("--structured-traces", type=int, default=None)
    parser.add_argument("--prose-traces", type=int, default=None)
    parser.add_argument("--trace-tokens", type=int, default=128)
    parser.add_argument("--epochs", type=float, default=None)
    parser.add_argument("--eval-prompts", type=int, default=None, help="held-out prompts per set")
    parser.add_argument("--eval-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    structured_n = args.structured_traces or (384 if args.quick else 1024)
    prose_n = args.prose_traces or (128 if args.quick else 512)
    epochs = args.epochs or (2.0 if args.quick else 4.0)
    eval_n = args.eval_prompts or (24 if args.quick else 48)
    torch.set_num_threads(max(1, args.threads))
    started = time.perf_counter()

    target, tokenizer, generic = load_reference()
    raw_recent = [
        replace(t, category=DOMAIN)
        for t in make_traces(target, tokenizer, DOMAIN, structured_n, args.trace_tokens, args.seed)
    ]
    raw_older = [
        replace(t, category=PRE_DRIFT)
        for t in make_traces(target, tokenizer, PRE_DRIFT, prose_n, args.trace_tokens, args.seed)
    ]
    scrubbed_recent, scrubbed_older = scrubbed(raw_recent), scrubbed(raw_older)
    with_data = sum(has_personal_data(t) for t in raw_recent)
    changed = sum(a != b for a, b in zip(raw_recent, scrubbed_recent, strict=True))
    print(
        f"traces: {len(raw_recent)} {DOMAIN} ({with_data} hold personal data; {changed} changed by "
        f"scrubbing), {len(raw_older)} {PRE_DRIFT}",
        flush=True,
    )

    pii_prompts, all_prompts = held_out_prompts(tokenizer, eval_n, args.seed + 7)
    trained = {normalised_prompt(t.prompt) for t in raw_recent + raw_older + scrubbed_recent + scrubbed_older}
    overlap = sum(normalised_prompt(p) in trained for p in pii_prompts + all_prompts)
    assert overlap == 0, f"{overlap} held-out prompts occur among the training prompts"
    print(
        f"held-out prompts: {len(pii_prompts)} with personal data in the answer, {len(all_prompts)} sampled"
    )

    cfg = RealignConfig(
        seed=args.seed,
        time_budget_s=24 * 3600.0,
        max_epochs=epochs,
        teacher="topk",
        train_threads=args.threads,
    )
    arms: dict[str, dict[str, Any]] = {}
    for arm, recent, older in (("raw", raw_recent, raw_older), ("scrubbed", scrubbed_recent, scrubbed_older)):
        arm_started = time.perf_counter()
        result = realign(target, generic, tokenizer, recent, older, cfg)
        arms[arm] = {
            "hit_rate_personal_data_prompts": hit_rate(
                target, tokenizer, result.model, pii_prompts, args.eval_tokens
            ),
            "hit_rate_all_prompts": hit_rate(target, tokenizer, result.model, all_prompts, args.eval_tokens),
            "steps_run": result.metrics["steps_run"],
            "best_step": result.metrics["best_step"],
            "wall_s": round(time.perf_counter() - arm_started, 1),
        }
        print(
            f"{arm:>9}: hit rate {arms[arm]['hit_rate_personal_data_prompts']:.1%} on prompts with personal "
            f"data, {arms[arm]['hit_rate_all_prompts']:.1%} on all ({arms[arm]['steps_run']} steps, "
            f"{arms[arm]['wall_s']:.0f}s)",
            flush=True,
        )
    generic_rates = {
        "hit_rate_personal_data_prompts": hit_rate(target, tokenizer, generic, pii_prompts, args.eval_tokens),
        "hit_rate_all_prompts": hit_rate(target, tokenizer, generic, all_prompts, args.eval_tokens),
    }
    cost = 100 * (
        arms["raw"]["hit_rate_personal_data_prompts"] - arms["scrubbed"]["hit_rate_personal_data_prompts"]
    )
    cost_all = 100 * (arms["raw"]["hit_rate_all_prompts"] - arms["scrubbed"]["hit_rate_all_prompts"])
    figures = {
        "scrub_hit_rate_cost_points": round(cost, 2),
        "scrub_hit_rate_cost_points_all_prompts": round(cost_all, 2),
        "hit_rate_cost": {
            "mode": "quick" if args.quick else "full",
            "raw": arms["raw"],
            "scrubbed": arms["scrubbed"],
            "generic": generic_rates,
            "structured_traces": len(raw_recent),
            "structured_traces_with_personal_data": with_data,
            "prose_traces": len(raw_older),
            "epochs": epochs,
            "held_out_prompts_personal_data": len(pii_prompts),
            "held_out_prompts_all": len(all_prompts),
            "heldout_prompt_overlap": overlap,
            "eval_new_tokens": args.eval_tokens,
            "k": K,
            "wall_s": round(time.perf_counter() - started, 1),
            "load_average_1m_at_end": round(os.getloadavg()[0], 2),
        },
    }
    print(
        f"generic drafter: {generic_rates['hit_rate_personal_data_prompts']:.1%} / "
        f"{generic_rates['hit_rate_all_prompts']:.1%}\n"
        f"scrub_hit_rate_cost_points {cost:+.2f} (prompts whose answer holds personal data), "
        f"{cost_all:+.2f} on all prompts"
    )
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "scrub.json"
    kept = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**kept, **figures}, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
