"""How a real chat model answers the generated chat traffic, per task kind.

    .venv/bin/python bench/chat_traffic_answers.py [--model var/models/smollm2-135m-instruct]
        [--per-kind 6] [--seed 21] [--new-tokens 80] [--threads 2]

Draws ``--per-kind`` requests of every task kind from the chat and chat_structured traffic streams
(``workers.corpora.traffic_prompts``, test split, the given stream seed), renders them with the
model folder's chat template, answers them greedily with transformers (float32, left-padded batches
of one kind) and reports per kind: exact answers (structured kinds only: the JSON equal to the
expected object, or the SQL equal up to white space, case and the final semicolon, after the
client's "\\n\\n" stop), answers that ended at the end-of-turn token before ``--new-tokens``, mean
new tokens, mean top-1 probability and the share of tokens whose top-1 probability is at least 0.5
(what a drafter copying the target can hope to match). Writes bench/results/chat_traffic_answers.json
with every answer.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from workers import corpora  # noqa: E402
from workers.corpora import chat  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "chat_traffic_answers.json"
KINDS = {
    "chat": ("explain", "howto", "advise", "rewrite", "summarise", "compose"),
    "chat_structured": ("extract_json", "tool_call", "sql"),
}


def exact(kind: str, answer: str, reference: str) -> bool | None:
    """Whether a structured answer is the expected one (None for open-ended chat)."""
    if not reference:
        return None
    answer = answer.split("\n\n")[0].strip()  # the client's stop
    if kind == "sql":

        def norm(s: str) -> str:
            return " ".join(s.strip().rstrip(";").split()).casefold()

        return norm(answer) == norm(reference)
    try:
        return bool(json.loads(answer) == json.loads(reference))
    except ValueError:
        return False


def draw(per_kind: int, seed: int) -> dict[str, list[corpora.Prompt]]:
    out: dict[str, list[corpora.Prompt]] = {}
    for domain, kinds in KINDS.items():
        for prompt in corpora.traffic_prompts(domain, "test", seed):
            if len(out.setdefault(prompt.kind, [])) < per_kind:
                out[prompt.kind].append(prompt)
            if all(len(out.get(k, [])) >= per_kind for k in kinds):
                break
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=ROOT / "var" / "models" / "smollm2-135m-instruct")
    ap.add_argument("--per-kind", type=int, default=6)
    ap.add_argument("--seed", type=int, default=21)
    ap.add_argument("--new-tokens", type=int, default=80)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import importlib

    import torch

    transformers: Any = importlib.import_module("transformers")  # untyped: kept behind Any
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
    tokenizer.padding_side = "left"
    eos = tokenizer.eos_token_id
    answers: list[dict[str, Any]] = []
    figures: dict[str, dict[str, Any]] = {}
    for kind, prompts in draw(args.per_kind, args.seed).items():
        texts = [
            tokenizer.apply_chat_template(list(p.messages), tokenize=False, add_generation_prompt=True)
            for p in prompts
        ]
        batch = tokenizer(texts, return_tensors="pt", padding=True)
        started = time.monotonic()
        with torch.no_grad():
            out = model.generate(
                **batch,
                max_new_tokens=args.new_tokens,
                do_sample=False,
                pad_token_id=eos,
                output_scores=True,
                return_dict_in_generate=True,
            )
        top1 = torch.stack([torch.softmax(s.float(), -1).max(-1).values for s in out.scores], 1)  # [B, T]
        rows = []
        for i, prompt in enumerate(prompts):
            ids = out.sequences[i, batch["input_ids"].shape[1] :].tolist()
            ended = eos in ids
            n = ids.index(eos) + 1 if ended else len(ids)
            text = tokenizer.decode(ids[: n - ended])
            probs = top1[i, :n].tolist()
            rows.append(
                {
                    "kind": kind,
                    "document": prompt.doc_id,
                    "request": chat.last_user_turn(prompt.messages),
                    "reference": prompt.reference,
                    "answer": text,
                    "exact": exact(kind, text, prompt.reference),
                    "ended": ended,
                    "tokens": n,
                    "mean_top1": statistics.mean(probs),
                    "share_top1_ge_half": sum(p >= 0.5 for p in probs) / n,
                }
            )
        answers += rows
        graded = [r["exact"] for r in rows if r["exact"] is not None]
        figures[kind] = {
            "requests": len(rows),
            "exact": sum(graded) if graded else None,
            "ended": sum(r["ended"] for r in rows),
            "mean_tokens": statistics.mean(r["tokens"] for r in rows),
            "mean_top1": statistics.mean(r["mean_top1"] for r in rows),
            "share_top1_ge_half": statistics.mean(r["share_top1_ge_half"] for r in rows),
            "seconds": round(time.monotonic() - started, 1),
        }
        f = figures[kind]
        print(
            f"{kind:13} exact {f['exact'] if f['exact'] is not None else '-':>2}/{f['requests']}  "
            f"ended {f['ended']}/{f['requests']}  tokens {f['mean_tokens']:.0f}  "
            f"top-1 {f['mean_top1']:.2f}  >=0.5 {f['share_top1_ge_half']:.0%}",
            flush=True,
        )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    report = {"model": str(args.model), "seed": args.seed, "by_kind": figures, "answers": answers}
    RESULTS.write_text(json.dumps(report, indent=1))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
