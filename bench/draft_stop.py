"""Dynamic draft length: does ending a round at the first token the drafter doubts pay?

`DraftModelProposer(confidence_threshold=t)` stops drafting once the drafter gives its own token
less than probability t (Hugging Face's assistant_confidence_threshold does the same). Measured on
the committed reference pair (12.2M target, generic drafter distilled on prose), batch size 1,
greedy, on held-out prompts of each domain: prose (the drafter's home ground) and the structured
domain (where the generic drafter is stale), each structured request ending with its one-line
answer (stop "\n", bench/realign.py's STOPS, as the demo's client ends it); ``--with-code`` adds
code, which the reference target cannot make pay (bench/domain_ceiling.py says why). For each k
and threshold: hit rate (accepted / drafted), tokens per verify step, drafted tokens per round (all
exact), and ms per token against plain decoding. Arms are interleaved over --reps repetitions on
the same prompts and the median time is kept: this machine is shared, so only ratios measured side
by side count.
Writes bench/results/draft_stop.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.realign import STOPS  # noqa: E402
from workers import corpora  # noqa: E402
from workers.engine.decoder import SpeculativeDecoder  # noqa: E402
from workers.engine.hf_io import load_hf_folder  # noqa: E402
from workers.engine.proposers import DraftModelProposer  # noqa: E402

REFERENCE = ROOT / "workers" / "models" / "reference"
RESULTS = ROOT / "bench" / "results"
DOMAINS = ("prose", "structured")  # --with-code adds "code"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=8, help="prompts per domain")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--ks", type=int, nargs="+", default=[4, 6])
    ap.add_argument("--thresholds", type=float, nargs="+", default=[0.0, 0.3, 0.5])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--with-code", action="store_true", help="measure the code domain too")
    args = ap.parse_args()
    domains = (*DOMAINS, "code") if args.with_code else DOMAINS
    torch.set_num_threads(args.threads)
    target, tokenizer = load_hf_folder(REFERENCE / "target")
    drafter, _ = load_hf_folder(REFERENCE / "generic-drafter")
    prompts = {
        d: [tokenizer.encode(p.text)[-192:] for p in corpora.prompts(d, "test", n=args.prompts, seed=5)]
        for d in domains
    }
    arms: dict[str, SpeculativeDecoder] = {"nospec": SpeculativeDecoder(target, tokenizer, None, k=0)}
    for k in args.ks:
        for t in args.thresholds:
            proposer = DraftModelProposer(drafter, confidence_threshold=t)
            arms[f"k{k}_t{t:g}"] = SpeculativeDecoder(target, tokenizer, proposer, k=k)
    rows: dict[str, dict[str, dict[str, float]]] = {}
    with torch.inference_mode():
        for domain in domains:
            stop = STOPS.get(domain, ())
            times: dict[str, list[float]] = {name: [] for name in arms}
            counts: dict[str, tuple[int, int, int, int]] = {}
            for _ in range(args.reps):
                for name, dec in arms.items():  # interleaved: every arm once per repetition
                    drafted = accepted = steps = tokens = 0
                    start = time.perf_counter()
                    for ids in prompts[domain]:
                        res = dec.generate(ids, args.new_tokens, stop_at_eos=False, stop=stop)
                        m = res.metrics
                        drafted += m.drafted_tokens
                        accepted += m.accepted_tokens
                        steps += m.verify_steps
                        tokens += m.generated_tokens
                    times[name].append((time.perf_counter() - start) * 1000 / tokens)
                    counts[name] = (drafted, accepted, steps, tokens)
            base = statistics.median(times["nospec"])
            rows[domain] = {}
            for name in arms:
                drafted, accepted, steps, tokens = counts[name]
                ms = statistics.median(times[name])
                rows[domain][name] = {
                    "hit_rate": round(accepted / drafted, 4) if drafted else 0.0,
                    "tokens_per_step": round(tokens / steps, 3) if steps else 1.0,
                    "drafted_per_round": round(drafted / steps, 3) if steps else 0.0,
                    "ms_per_token": round(ms, 3),
                    "speedup_vs_nospec": round(base / ms, 3),
                }
            print(f"\n{domain}: plain decoding {base:.2f} ms/token")
            print(
                f"{'arm':<12}{'hit rate':>9}{'tok/step':>10}{'drafted/round':>15}"
                f"{'ms/token':>10}{'speed-up':>10}"
            )
            for name, r in rows[domain].items():
                if name == "nospec":
                    continue
                print(
                    f"{name:<12}{r['hit_rate']:>9.1%}{r['tokens_per_step']:>10.2f}{r['drafted_per_round']:>15.2f}"
                    f"{r['ms_per_token']:>10.2f}{r['speedup_vs_nospec']:>9.2f}x"
                )
    out = {
        "method": "greedy, batch 1, generic drafter; median ms/token over interleaved repetitions",
        "prompts_per_domain": args.prompts,
        "new_tokens": args.new_tokens,
        "stop": {d: list(STOPS.get(d, ())) for d in domains},
        "reps": args.reps,
        "threads": args.threads,
        "load_average_1m_at_end": round(os.getloadavg()[0], 2),
        "domains": rows,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "draft_stop.json").write_text(json.dumps(out, indent=1) + "\n")
    print(f"\nload average (1 min) {os.getloadavg()[0]:.2f}; wrote {RESULTS / 'draft_stop.json'}")


if __name__ == "__main__":
    main()
