"""What each traffic domain lets a drafter reach against the reference target, and why.

A drafter is only as good as the target is predictable: greedy speculation accepts a draft token
when it equals the target's argmax, so where the target itself hesitates between several tokens a
much smaller model guesses its choice less often, however it is trained. This bench measures, per
domain, on the target's own greedy continuations of held-out prompts (test split):

- the target's confidence on the tokens it chose: mean top-1 probability, and the share of
  positions where it is at least 0.9;
- structured requests end with their one-line answer (bench/realign.py's STOPS, as a client's
  OpenAI `stop` ends them): what the target writes after it is the next, randomly generated request;
- how repetitive those continuations are: the share of tokens that a 3-gram prompt lookup (the
  engine's NgramProposer, one token ahead) predicts from the text before them;
- for each drafter (the committed generic drafter, any realigned drafter ``bench/realign.py`` left
  under bench/results/realigned-<domain>, and any ``--drafter name=folder``): its teacher-forced
  greedy agreement with the target, and the hit rate and tokens per verify step greedy speculation
  with it reaches at k = 2, 4, 6, replayed exactly from that agreement
  (``workers.engine.metrics.replay_greedy_rounds``; one forward pass per drafter and domain);
- the per-token agreement a drafter whose misses were independent would need for an 80% hit rate
  at k = 4 (the hit rate the realigned drafter is expected to reach);
- per shifted domain, whether realignment can pay there: tokens per verify step at k = 4 of the
  generic drafter, of the best drafter scored (the one realigned on that domain when there is one)
  and of a ceiling drafter that agrees wherever the target is confident (top-1 >= 0.9) and where
  the best drafter agrees elsewhere (replayed exactly like the others). Drafters of one size cost
  the same per step, so a ratio of tokens per step is their speed-up over each other: a domain
  whose ceiling cannot beat the generic drafter by the canary bench's asked 3x cannot pay for a
  realignment on the reference target, and the line says why (how often the target is confident,
  how far the generic drafter already agrees). That is why the benches measure the prose ->
  structured shift by default and keep code behind a flag.

Exact counts, no timings: the figures do not depend on how busy the machine is. About a minute on
2 cores. Writes bench/results/domain_ceiling.json (``--split validation``: the modules realignment
trained on, as other requests would bring them; domain_ceiling-validation.json).
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

from bench.realign import STOPS  # noqa: E402
from workers import corpora  # noqa: E402
from workers.engine.decoder import StopStrings, generate_batch  # noqa: E402
from workers.engine.hf_io import load_hf_folder  # noqa: E402
from workers.engine.metrics import replay_greedy_rounds  # noqa: E402
from workers.engine.model import Transformer  # noqa: E402
from workers.engine.proposers import NgramProposer  # noqa: E402
from workers.engine.tokenizer import Tokenizer, ensure_same_tokenizer  # noqa: E402

REFERENCE = ROOT / "workers" / "models" / "reference"
RESULTS = ROOT / "bench" / "results"
DOMAINS = ("prose", "code", "structured")
KS = (2, 4, 6)
HIT_RATE_ASKED = 0.80
K_ASKED = 4
CONFIDENT = 0.9
NGRAM = 3
PROMPT_SEED = 100
SHIFTED = ("code", "structured")
REALIGNED_VS_GENERIC_ASKED = 3.0  # bench/canary.py's target for the realigned drafter over the generic one


def held_out_prompts(
    tokenizer: Tokenizer, domain: str, split: str, n: int, prompt_tokens: int
) -> list[list[int]]:
    """Up to ``n`` prompts of ``domain``'s ``split``, each its last ``prompt_tokens`` tokens (equal
    lengths let the target continue them as one batch); several seeds cut the documents elsewhere.
    Seeds from 100: bench/realign.py cuts its validation-split traces with seeds from 0, so even on
    that split these are other requests than the ones realignment trained on."""
    ids: list[list[int]] = []
    for seed in range(PROMPT_SEED, PROMPT_SEED + 8):
        for p in corpora.prompts(domain, split, n=n, seed=seed, min_prompt_chars=200):
            tokens = tokenizer.encode(p.text)
            if len(tokens) >= prompt_tokens:
                ids.append(tokens[-prompt_tokens:])
        if len(ids) >= n:
            break
    return ids[:n]


def request_lengths(
    tokenizer: Tokenizer, rows: torch.Tensor, prompt_tokens: int, stops: tuple[str, ...]
) -> list[int]:
    """Output tokens per request: the whole continuation, or with stop strings (a structured answer
    ends at its line's end) up to the token that completes the first one, where serving stops."""
    lengths = []
    for row in rows[:, prompt_tokens:].tolist():
        length = len(row)
        if stops:
            matcher = StopStrings(tokenizer, stops)
            length = next((j for j in range(1, len(row) + 1) if matcher.find(row[:j]) is not None), length)
        lengths.append(length)
    return lengths


def greedy_guesses(drafter: Transformer, rows: torch.Tensor, prompt_tokens: int) -> torch.Tensor:
    """[B, N]: the drafter's argmax for each continuation position, given the target's text before it."""
    with torch.inference_mode():
        return drafter(rows[:, :-1])[:, prompt_tokens - 1 :].argmax(-1)


def guesses_ending(
    tokenizer: Tokenizer,
    rows: torch.Tensor,
    guesses: torch.Tensor,
    prompt_tokens: int,
    stops: tuple[str, ...],
) -> list[list[bool]]:
    """Per position: does the drafter's guess there complete a stop string (the decoder then drafts
    nothing after it)? Only the last few tokens can matter, so only a short tail is decoded."""
    tail = max(len(s) for s in stops) + 4
    out = []
    for row, guessed in zip(rows[:, prompt_tokens:].tolist(), guesses.tolist(), strict=True):
        flags = []
        for j, g in enumerate(guessed):
            before = row[max(0, j - tail) : j]
            text, prior = tokenizer.decode([*before, g]), tokenizer.decode(before)
            flags.append(any(s in text and s not in prior for s in stops))
        out.append(flags)
    return out


def ngram_predictability(rows: torch.Tensor, prompt_tokens: int, lengths: list[int]) -> float:
    """Share of output tokens that the 3-gram lookup's first proposal gets right."""
    hits = total = 0
    for row, length in zip(rows.tolist(), lengths, strict=True):
        lookup = NgramProposer(NGRAM)
        lookup.start_request(row[:prompt_tokens])
        for j in range(prompt_tokens, prompt_tokens + length):
            proposal = lookup.propose(row[:j], 1).token_ids.tolist()
            hits += int(proposal[:1] == [row[j]])
            total += 1
    return hits / total


def replayed(
    agreement: torch.Tensor, lengths: list[int], guess_ends: list[list[bool]] | None, k: int
) -> dict[str, float]:
    """Hit rate and tokens per verify step of greedy speculation at ``k`` over all requests."""
    drafted = accepted = steps = 0
    for i, (row, length) in enumerate(zip(agreement.tolist(), lengths, strict=True)):
        ends = guess_ends[i] if guess_ends is not None else None
        m = replay_greedy_rounds(row, k, stop_after=length, guess_ends=ends)
        drafted += m.drafted_tokens
        accepted += m.accepted_tokens
        steps += m.verify_steps
    return {"hit_rate": round(accepted / drafted, 4), "tokens_per_step": round(1 + accepted / steps, 3)}


def agreement_needed(hit_rate: float, k: int) -> float:
    """The per-token agreement p with (p + p^2 + ... + p^k) / k = hit_rate (misses independent)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        p = (lo + hi) / 2
        if sum(p**i for i in range(1, k + 1)) / k < hit_rate:
            lo = p
        else:
            hi = p
    return round((lo + hi) / 2, 4)


def realignment_verdict(
    domain: str,
    generic: dict[str, float],
    best_name: str,
    best: dict[str, float],
    ceiling: dict[str, float],
    confident_share: float,
    generic_agreement: float,
) -> dict[str, object]:
    """Whether realignment can pay on ``domain`` (tokens per verify step at K_ASKED: ``generic``, the
    best drafter scored, the ceiling drafter), and the reason in one line."""
    base = generic["tokens_per_step"]
    best_gain = best["tokens_per_step"] / base
    ceiling_gain = ceiling["tokens_per_step"] / base
    asked = REALIGNED_VS_GENERIC_ASKED
    if best_gain >= asked:
        verdict = "pays"
        why = f"{best_name} runs {best_gain:.2f}x the generic drafter's tokens per step (asked {asked:g}x)"
    elif ceiling_gain >= asked:
        verdict = "can pay"
        why = (
            f"the ceiling is {ceiling_gain:.2f}x the generic drafter's tokens per step (asked {asked:g}x); "
            f"{best_name} reaches {best_gain:.2f}x so far"
        )
    else:
        verdict = "cannot pay"
        why = (
            f"a drafter agreeing wherever the target is confident, and elsewhere as often as {best_name}, "
            f"reaches only {ceiling_gain:.2f}x the generic drafter's tokens per step (asked {asked:g}x): "
            f"the target is confident (top-1 >= "
            f"{CONFIDENT}) on only {confident_share:.0%} of its own {domain} tokens, and the generic "
            f"drafter already agrees on {generic_agreement:.0%} of all its tokens (hit "
            f"{generic['hit_rate']:.0%} at k={K_ASKED})"
        )
    return {
        "verdict": verdict,
        "reason": why,
        "k": K_ASKED,
        "generic_tokens_per_step": generic["tokens_per_step"],
        "best_drafter": best_name,
        "best_tokens_per_step": best["tokens_per_step"],
        "ceiling_tokens_per_step": ceiling["tokens_per_step"],
        "ceiling_hit_rate": ceiling["hit_rate"],
        "best_over_generic": round(best_gain, 3),
        "ceiling_over_generic": round(ceiling_gain, 3),
        "asked_over_generic": asked,
    }


def drafters_to_score(extra: list[str]) -> dict[str, Path]:
    folders = {"generic": REFERENCE / "generic-drafter"}
    for domain in DOMAINS:
        realigned = RESULTS / f"realigned-{domain}"
        if (realigned / "model.safetensors").is_file():
            folders[f"realigned-{domain}"] = realigned
    for item in extra:
        name, sep, folder = item.partition("=")
        if not sep or not name or not Path(folder).is_dir():
            raise SystemExit(f"--drafter wants name=folder with an existing HF folder, got {item!r}")
        folders[name] = Path(folder)
    return folders


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=48, help="held-out prompts per domain")
    parser.add_argument(
        "--split",
        choices=corpora.SPLITS,
        default="test",
        help="test: modules no trace came from; validation: the modules of bench/realign.py's traces",
    )
    parser.add_argument("--prompt-tokens", type=int, default=96)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--drafter", action="append", default=[], metavar="NAME=FOLDER")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    torch.set_num_threads(max(1, args.threads))
    t0 = time.perf_counter()
    target, tokenizer = load_hf_folder(REFERENCE / "target")
    drafters: dict[str, Transformer] = {}
    for name, folder in drafters_to_score(args.drafter).items():
        model, drafter_tokenizer = load_hf_folder(folder)
        ensure_same_tokenizer(tokenizer, drafter_tokenizer, "reference target", name)
        drafters[name] = model
    needed = agreement_needed(HIT_RATE_ASKED, K_ASKED)
    out: dict[str, object] = {
        "k_values": list(KS),
        "agreement_needed_for_hit_rate": {"hit_rate": HIT_RATE_ASKED, "k": K_ASKED, "per_token": needed},
        "split": args.split,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "drafters": {name: str(folder) for name, folder in drafters_to_score(args.drafter).items()},
    }
    for domain in DOMAINS:
        prompts = held_out_prompts(tokenizer, domain, args.split, args.prompts, args.prompt_tokens)
        if not prompts:
            raise SystemExit(f"no {domain} {args.split} prompt has {args.prompt_tokens} tokens")
        batch = torch.tensor(prompts)
        with torch.inference_mode():
            continuation = generate_batch(target, batch, args.new_tokens)
            rows = torch.cat([batch, continuation], dim=1)
            probs = target(rows[:, :-1])[:, args.prompt_tokens - 1 :].float().softmax(-1)
        stops = STOPS.get(domain, ())
        lengths = request_lengths(tokenizer, rows, args.prompt_tokens, stops)
        served = torch.arange(args.new_tokens)[None, :] < torch.tensor(lengths)[:, None]  # [B, N]
        confident = probs.max(-1).values >= CONFIDENT  # [B, N]
        top1 = probs.max(-1).values[served]
        figures: dict[str, object] = {
            "prompts": len(prompts),
            "stop": list(stops),
            "mean_output_tokens": round(sum(lengths) / len(lengths), 1),
            "target_top1_probability": round(top1.mean().item(), 4),
            "target_confident_share": round((top1 >= CONFIDENT).float().mean().item(), 4),
            "ngram_predictable_share": round(ngram_predictability(rows, args.prompt_tokens, lengths), 4),
        }
        answers = rows[:, args.prompt_tokens :]
        guessed: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for name, drafter in drafters.items():
            guesses = greedy_guesses(drafter, rows, args.prompt_tokens)
            agreement = guesses == answers
            guessed[name] = (guesses, agreement)
            ends = guesses_ending(tokenizer, rows, guesses, args.prompt_tokens, stops) if stops else None
            figures[name] = {
                "agreement": round(agreement[served].float().mean().item(), 4),
                **{f"k{k}": replayed(agreement, lengths, ends, k) for k in KS},
            }
        if domain in SHIFTED:
            realigned = f"realigned-{domain}"
            best = (
                realigned if realigned in drafters else max(drafters, key=lambda n: figures[n]["agreement"])
            )
            guesses, agreement = guessed[best]
            # The ceiling drafter guesses the target's token wherever the target is confident.
            ceiling_guesses = torch.where(confident, answers, guesses)
            ends = (
                guesses_ending(tokenizer, rows, ceiling_guesses, args.prompt_tokens, stops) if stops else None
            )
            ceiling = replayed(agreement | confident, lengths, ends, K_ASKED)
            figures["realignment"] = realignment_verdict(
                domain,
                figures["generic"][f"k{K_ASKED}"],
                best,
                figures[best][f"k{K_ASKED}"],
                ceiling,
                float(figures["target_confident_share"]),
                float(figures["generic"]["agreement"]),
            )
        out[domain] = figures
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    RESULTS.mkdir(parents=True, exist_ok=True)
    suffix = "" if args.split == "test" else f"-{args.split}"
    written = RESULTS / f"domain_ceiling{suffix}.json"
    written.write_text(json.dumps(out, indent=1) + "\n")

    print(
        f"target's greedy continuations of {args.split}-split prompts ({args.prompts} per domain, "
        f"{args.new_tokens} tokens); hit rates replayed exactly from teacher-forced agreement"
    )
    print(f"{'domain':<12}{'tokens/request':>15}{'target top-1':>13}{'top-1 >= 0.9':>14}{'3-gram':>8}")
    for domain in DOMAINS:
        f = out[domain]
        assert isinstance(f, dict)
        print(
            f"{domain:<12}{f['mean_output_tokens']:>15}{f['target_top1_probability']:>13.3f}"
            f"{f['target_confident_share']:>14.1%}"
            f"{f['ngram_predictable_share']:>8.1%}"
        )
    hit_columns = "".join(f"{'hit k=' + str(k):>10}" for k in KS)
    print(f"\n{'drafter':<22}{'domain':<12}{'agreement':>10}{hit_columns}")
    for name in drafters:
        for domain in DOMAINS:
            f = out[domain]
            assert isinstance(f, dict)
            d = f[name]
            cells = "".join(f"{d[f'k{k}']['hit_rate']:>10.1%}" for k in KS)
            print(f"{name:<22}{domain:<12}{d['agreement']:>10.1%}{cells}")
    print(
        f"\nan {HIT_RATE_ASKED:.0%} hit rate at k={K_ASKED} needs per-token agreement {needed:.3f} "
        "if misses are independent"
    )
    print(
        f"\ncan realignment pay? tokens per verify step at k={K_ASKED} (drafters of one size cost the same "
        "per step: their ratio is the speed-up between them)"
    )
    print(f"{'domain':<12}{'generic':>9}{'best drafter':>24}{'ceiling':>9}  verdict")
    for domain in SHIFTED:
        f = out[domain]
        assert isinstance(f, dict)
        v = f["realignment"]
        best_cell = f"{v['best_drafter']} {v['best_tokens_per_step']:.2f}"
        print(
            f"{domain:<12}{v['generic_tokens_per_step']:>9.2f}{best_cell:>24}"
            f"{v['ceiling_tokens_per_step']:>9.2f}  {v['verdict']}"
        )
    for domain in SHIFTED:
        f = out[domain]
        assert isinstance(f, dict)
        print(f"  {domain}: {f['realignment']['verdict']}: {f['realignment']['reason']}")
    print(f"wall {out['wall_s']}s; wrote {written}")


if __name__ == "__main__":
    main()
