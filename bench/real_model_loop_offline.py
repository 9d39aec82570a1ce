"""The drafter loop on a real open model, offline: SmolLM2-135M-Instruct's day-0 first drafter on
general chat and its realignment on structured work, measured held out, in minutes.

    python bench/real_model_loop_offline.py [--model var/models/smollm2-135m-instruct]
        [--chat-train 320] [--structured-train 320] [--day0-budget-s 300] [--realign-budget-s 300]
        [--set-day0 key=value ...] [--set-realign key=value ...] [--stage day0|realign|all]

Traces: the scenario's own chat traffic (``workers.corpora``' ``chat`` domain: explanations,
how-to questions, advice, rewrites, summaries, messages; and ``chat_structured``: JSON extraction,
JSON tool calls and SQL after two or three worked turns), training requests from the open side of
the document partition and evaluation requests from the held-out side (no document or request in
common), rendered with the model folder's chat template as the server renders them
(``workers.serve.chat.render_chat``), completed by the
target greedily up to ``--chat-tokens`` / ``--structured-tokens`` new tokens or its end-of-turn
token, batched (left padding, ``transformers``' generate on the same float32 weights, one thread)
and cached under bench/results/trace-cache. Before 2026-12-08 the bench drew from generators of its
own (the figures below); they are the scenario's streams now.

The drafter is trained with the realign task's own code path: ``narrow_drafter_from_target`` then
``workers.training.realign.realign`` with the first drafter's epoch cap (day 0), and the day-0
drafter realigned on the structured traces with the chat traces as the older window (the shift).

Figures, on held-out prompts, greedy, k = 4 (``--k``): teacher-forced greedy agreement of the
drafter with the target's output, replayed into rounds exactly as the decoder would run them
(``workers.engine.metrics.replay_greedy_rounds``): hit rate (accepted / drafted) and tokens per
verify step; the speed-up that implies from measured costs (``bench.engine.measure_costs``: one
target step, a (k+1)-row verify pass, a drafter step), and optionally (``--decode N``) real
decoding of N held-out prompts with and without speculation, interleaved. Writes
bench/results/real_model_loop_offline.json.

Measured on the shared 2-core machine while three other jobs ran (target step 150-340 ms against
~50 ms idle; c 0.061-0.078, a 5-row verify 0.84-0.97 of a step), 253 chat and 332 structured
training rows (51 of them replayed chat), 48 held-out prompts of each kind:
- day 0 on chat, 200-300 s: held-out greedy agreement 0.10-0.17, hit rate 0.03-0.05 at k = 4,
  implied 0.9-1.0x (1.05-1.12x at k = 2). 76-117 steps of 16 rows; the from-scratch two-layer
  drafter is short of training by orders of magnitude, not of a setting.
- the shift, from that drafter: at 1.5e-3 (the old cap) and 300 s, agreement 0.40, hit 0.16,
  1.35x; at 4e-3 and 200 steps (the 10-epoch cap, ~400 s), 0.74, hit 0.44, 2.16x; with 25 epochs
  (402 steps, 900 s budget, the lr rule's 3.7e-3), 0.79, hit 0.52 (SQL 0.72, tool calls 0.46,
  JSON extraction 0.35), 2.43x; chat 0.5 points lower in both.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import sys
import time
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from workers import corpora  # noqa: E402
from workers.engine.decoder import SpeculativeDecoder  # noqa: E402
from workers.engine.hf_io import load_hf_folder, save_hf_folder  # noqa: E402
from workers.engine.metrics import replay_greedy_rounds  # noqa: E402
from workers.engine.model import Transformer  # noqa: E402
from workers.engine.proposers import DraftModelProposer  # noqa: E402
from workers.engine.tokenizer import Tokenizer  # noqa: E402
from workers.serve.chat import render_chat  # noqa: E402
from workers.training.first_drafter import FIRST_DRAFTER_MAX_EPOCHS, narrow_drafter_from_target  # noqa: E402
from workers.training.realign import RealignConfig, TraceText, realign  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "real_model_loop_offline.json"
DAY0_DRAFTER = ROOT / "bench" / "results" / "smollm2-day0-drafter"  # the last day-0 drafter trained
TRACE_CACHE = ROOT / "bench" / "results" / "trace-cache"
DEFAULT_MODEL = ROOT / "var" / "models" / "smollm2-135m-instruct"
FALLBACK_MODEL = Path("/tmp/smol/hf")
# Draft lengths replayed beside --k (bench.engine.measure_costs times their verify passes).
OTHER_KS = (2, 6)

# ------------------------------------------------------------------------------------------ prompts

TRAFFIC_SPLIT = "test"  # the scenarios' split: training and held-out prompts are its two sides


def requests(domain: str, held_out: bool, n: int, seed: int) -> list[tuple[str, list[dict[str, str]], str]]:
    """(category, messages, document) of the first ``n`` requests of ``domain``'s scenario traffic
    (``workers.corpora.traffic_prompts``, the stream scenarios/smollm2.toml sends) on the held-out
    or the open side of its document partition: the two sides share no document and no request."""
    stream = corpora.traffic_prompts(domain, TRAFFIC_SPLIT, seed, heldout=held_out)
    return [
        (f"{domain}-{p.kind}", [dict(m) for m in p.messages], f"{domain}:{p.doc_id}")
        for p in itertools.islice(stream, n)
    ]


# ------------------------------------------------------------------------------------------- traces


def complete(
    folder: Path,
    tokenizer: Tokenizer,
    requests: list[tuple[str, list[dict[str, str]], str]],
    new_tokens: int,
    tag: str,
    batch: int = 16,
) -> tuple[list[TraceText], float]:
    """The target's greedy completions of ``requests`` as traces (cached); seconds spent (0: cached)."""
    prompts = [render_chat(str(folder), messages) for _, messages, _ in requests]
    digest = hashlib.sha256("\0".join([tag, str(new_tokens), *prompts]).encode()).hexdigest()[:16]
    path = TRACE_CACHE / f"smollm2-{tag}-{digest}.json"
    if path.is_file():
        return [TraceText(*t) for t in json.loads(path.read_text())], 0.0
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    model.train(False)
    eos = tokenizer.eos_id
    assert eos is not None
    ids = [tokenizer.encode(p) for p in prompts]
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))  # similar lengths share a batch
    completions: dict[int, str] = {}
    generated = 0
    for lo in range(0, len(order), batch):
        picks = order[lo : lo + batch]
        width = max(len(ids[i]) for i in picks)
        rows = torch.full((len(picks), width), eos, dtype=torch.long)
        mask = torch.zeros((len(picks), width), dtype=torch.long)
        for r, i in enumerate(picks):
            rows[r, width - len(ids[i]) :] = torch.tensor(ids[i])
            mask[r, width - len(ids[i]) :] = 1
        with torch.no_grad():
            out = model.generate(
                input_ids=rows,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=eos,
            )
        for r, i in enumerate(picks):
            new = out[r, width:].tolist()
            if eos in new:
                new = new[: new.index(eos)]
            generated += len(new)
            completions[i] = tokenizer.decode(new)
        print(
            f"  {tag}: {min(lo + batch, len(order))}/{len(order)} prompts, {time.perf_counter() - t0:.0f}s",
            flush=True,
        )
    seconds = time.perf_counter() - t0
    traces = [
        TraceText(
            key=document,
            prompt=prompt,
            completion=completions[i],
            category=category,
            document=document,
        )
        for i, ((category, _, document), prompt) in enumerate(zip(requests, prompts, strict=True))
    ]
    TRACE_CACHE.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([[t.key, t.prompt, t.completion, t.category, t.document] for t in traces]))
    print(f"  {tag}: {generated} tokens in {seconds:.0f}s ({generated / seconds:.1f} tokens/s)", flush=True)
    return traces, seconds


# ------------------------------------------------------------------------------------------ figures


@torch.no_grad()
def replayed_figures(
    target: Transformer, drafter: Transformer, tokenizer: Tokenizer, traces: list[TraceText], k: int
) -> dict[str, Any]:
    """Held-out greedy agreement and the decoder's hit rate at ``k``, replayed from teacher forcing
    (the completions are the target's greedy output), per category and overall."""
    per: dict[str, list[int]] = {}
    drafter.train(False)
    for t in traces:
        p, c = tokenizer.encode(t.prompt), tokenizer.encode(t.completion)
        if len(c) < 2:
            continue
        row = torch.tensor([p + c])
        guess = drafter(row[:, :-1])[0, len(p) - 1 :].argmax(-1)  # [len(c)]
        agreement = [bool(g == w) for g, w in zip(guess.tolist(), c, strict=True)]
        m = replay_greedy_rounds(agreement, k)
        for key in ("all", t.category or "none"):
            acc = per.setdefault(key, [0, 0, 0, 0, 0])
            acc[0] += sum(agreement[1:])
            acc[1] += len(agreement) - 1
            acc[2] += m.accepted_tokens
            acc[3] += m.drafted_tokens
            acc[4] += m.verify_steps
        for other in OTHER_KS:
            m = replay_greedy_rounds(agreement, other)
            acc = per.setdefault(f"all@k={other}", [0, 0, 0, 0, 0])
            acc[2] += m.accepted_tokens
            acc[3] += m.drafted_tokens
            acc[4] += m.verify_steps
    return {
        key: {
            **({"greedy_agreement": round(a / max(n, 1), 4), "positions": n} if n else {}),
            "hit_rate": round(acc / max(d, 1), 4),
            "tokens_per_step": round(1 + acc / max(s, 1), 4),
        }
        for key, (a, n, acc, d, s) in per.items()
    }


@torch.no_grad()
def argmax_share(target: Transformer, tokenizer: Tokenizer, traces: list[TraceText]) -> float:
    """Share of the traces' completion tokens that are the engine's own target argmax there (1.0:
    the batched generation wrote exactly what the engine's greedy decoding writes)."""
    same = total = 0
    for t in traces:
        p, c = tokenizer.encode(t.prompt), tokenizer.encode(t.completion)
        if not c:
            continue
        guess = target(torch.tensor([p + c])[:, :-1])[0, len(p) - 1 :].argmax(-1)  # [len(c)]
        same += int((guess == torch.tensor(c)).sum())
        total += len(c)
    return same / max(total, 1)


def costs(target: Transformer, drafter: Transformer, k: int, position: int = 200) -> dict[str, float]:
    """One target step, the drafter's step ratio c and the (k+1)-row verify ratio, interleaved."""
    from bench.engine import measure_costs

    measured = measure_costs(target, drafter, position=position, repeats=30)
    return {
        "target_step_ms": round(measured["target_step_ms"], 2),
        "drafter_step_ms": round(measured["drafter_step_ms"], 2),
        "c": round(measured["c"], 4),
        "verify_ratio": round(measured["verify_cost"][str(k)], 4),
        **{f"verify_ratio@k={n}": round(float(v), 4) for n, v in measured["verify_cost"].items()},
    }


def implied_speedup(tokens_per_step: float, verify_ratio: float, c: float, k: int) -> float:
    """Tokens per verify step over the cost of a round in target steps (verify pass + k drafter steps)."""
    return tokens_per_step / (verify_ratio + k * c)


def implied_by_k(figures: dict[str, Any], cost: dict[str, float], k: int) -> dict[str, float]:
    """The implied speed-up at every replayed draft length whose verify pass was timed."""
    out = {str(k): implied_speedup(figures["all"]["tokens_per_step"], cost["verify_ratio"], cost["c"], k)}
    for other in OTHER_KS:
        verify = cost.get(f"verify_ratio@k={other}")
        if verify is not None:
            out[str(other)] = implied_speedup(
                figures[f"all@k={other}"]["tokens_per_step"], verify, cost["c"], other
            )
    return {n: round(v, 3) for n, v in out.items()}


def decode_pairs(
    target: Transformer,
    drafter: Transformer,
    tokenizer: Tokenizer,
    traces: list[TraceText],
    k: int,
    new_tokens: int,
) -> dict[str, Any]:
    """Real decoding of the traces' prompts, speculation and none interleaved: wall-clock ratio."""
    spec = SpeculativeDecoder(target, tokenizer, DraftModelProposer(drafter), k=k)
    plain = SpeculativeDecoder(target, tokenizer, None, k=k)
    spec_s = plain_s = 0.0
    drafted = accepted = same = 0
    for t in traces:
        ids = tokenizer.encode(t.prompt)
        a = plain.generate(ids, new_tokens)
        b = spec.generate(ids, new_tokens)
        plain_s += (a.metrics.total_ms or 0.0) / 1000
        spec_s += (b.metrics.total_ms or 0.0) / 1000
        drafted += b.metrics.drafted_tokens
        accepted += b.metrics.accepted_tokens
        same += a.token_ids == b.token_ids
    return {
        "requests": len(traces),
        "speedup_vs_nospec": round(plain_s / max(spec_s, 1e-9), 3),
        "hit_rate": round(accepted / max(drafted, 1), 4),
        "identical_outputs": same,
    }


# -------------------------------------------------------------------------------------------- main


def _parse_sets(pairs: list[str]) -> dict[str, Any]:
    types = {f.name: f.type for f in fields(RealignConfig)}
    out: dict[str, Any] = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        if key not in types:
            raise SystemExit(f"RealignConfig has no field {key!r}")
        out[key] = (
            None
            if value == "None"
            else json.loads(value)
            if value[:1].isdigit() or value[:1] in "-[{"
            else value
        )
    return out


def _show(fraction: float, message: str) -> bool:
    print(f"  [{fraction:4.0%}] {message}", flush=True)
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL if DEFAULT_MODEL.is_dir() else FALLBACK_MODEL)
    ap.add_argument("--chat-train", type=int, default=320)
    ap.add_argument("--chat-heldout", type=int, default=48)
    ap.add_argument("--structured-train", type=int, default=320)
    ap.add_argument("--structured-heldout", type=int, default=48)
    ap.add_argument("--chat-tokens", type=int, default=96)
    ap.add_argument("--structured-tokens", type=int, default=64)
    ap.add_argument("--day0-budget-s", type=float, default=300.0)
    ap.add_argument("--realign-budget-s", type=float, default=300.0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--decode", type=int, default=0, help="held-out prompts decoded for real per stage")
    ap.add_argument("--day0-from", type=Path, help="a day-0 drafter folder to realign (no day-0 training)")
    ap.add_argument("--stage", choices=("traces", "day0", "all"), default="all")
    ap.add_argument("--set-day0", action="append", default=[])
    ap.add_argument("--set-realign", action="append", default=[])
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    target, tokenizer = load_hf_folder(args.model, max_seq_len=2048)
    result: dict[str, Any] = {"model": str(args.model), "k": args.k, "threads": args.threads}
    chat_train, s1 = complete(
        args.model, tokenizer, requests("chat", False, args.chat_train, 1), args.chat_tokens, "chat-train"
    )
    chat_held, s2 = complete(
        args.model, tokenizer, requests("chat", True, args.chat_heldout, 2), args.chat_tokens, "chat-heldout"
    )
    struct_train: list[TraceText] = []
    struct_held: list[TraceText] = []
    s3 = s4 = 0.0
    if args.stage != "day0":
        struct_train, s3 = complete(
            args.model,
            tokenizer,
            requests("chat_structured", False, args.structured_train, 3),
            args.structured_tokens,
            "structured-train",
        )
        struct_held, s4 = complete(
            args.model,
            tokenizer,
            requests("chat_structured", True, args.structured_heldout, 4),
            args.structured_tokens,
            "structured-heldout",
        )
    torch.set_num_threads(args.threads)
    result["trace_generation_s"] = round(s1 + s2 + s3 + s4, 1)
    result["traces"] = {
        "chat_train": len(chat_train),
        "chat_heldout": len(chat_held),
        "structured_train": len(struct_train),
        "structured_heldout": len(struct_held),
    }
    if args.stage == "traces":
        print(json.dumps(result, indent=2))
        return

    result["completions_that_are_engine_argmax"] = round(argmax_share(target, tokenizer, chat_held[:6]), 4)
    print("argmax share", result["completions_that_are_engine_argmax"], flush=True)
    first = narrow_drafter_from_target(target)
    cost = costs(target, first, args.k)
    first.invalidate_fast_path()  # the timed steps packed its weights, which deepcopy cannot copy
    result["costs"] = cost
    print("costs", cost, flush=True)

    day0_cfg = replace(
        RealignConfig(time_budget_s=args.day0_budget_s, max_epochs=FIRST_DRAFTER_MAX_EPOCHS),
        **_parse_sets(args.set_day0),
    )
    t0 = time.perf_counter()
    if args.day0_from is not None:  # a day-0 drafter this bench saved before: the shift alone
        drafter, _ = load_hf_folder(args.day0_from, max_seq_len=2048)
        day0_metrics, day0_history = {"loaded_from": str(args.day0_from)}, []
    else:
        day0 = realign(target, first, tokenizer, chat_train, (), day0_cfg, progress=_show)
        drafter = day0.model
        day0_metrics = {k: v for k, v in day0.metrics.items() if k not in ("history", "config")}
        day0_history = day0.metrics["history"]
        save_hf_folder(drafter, tokenizer, DAY0_DRAFTER)
    day0_s = time.perf_counter() - t0
    chat_fig = replayed_figures(target, drafter, tokenizer, chat_held, args.k)
    result["day0"] = {
        "wall_s": round(day0_s, 1),
        "train_metrics": day0_metrics,
        "history": day0_history,
        "chat_heldout": chat_fig,
        "implied_speedup_by_k": implied_by_k(chat_fig, cost, args.k),
        "implied_speedup_vs_nospec": round(
            implied_speedup(chat_fig["all"]["tokens_per_step"], cost["verify_ratio"], cost["c"], args.k), 3
        ),
    }
    if args.decode:
        result["day0"]["decoded"] = decode_pairs(
            target, drafter, tokenizer, chat_held[: args.decode], args.k, args.chat_tokens
        )
    print(
        json.dumps(result["day0"]["chat_heldout"]["all"]),
        result["day0"]["implied_speedup_by_k"],
        flush=True,
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    if args.stage == "day0":
        return

    stale = replayed_figures(target, drafter, tokenizer, struct_held, args.k)
    realign_cfg = replace(RealignConfig(time_budget_s=args.realign_budget_s), **_parse_sets(args.set_realign))
    older = [replace(t, category="chat") for t in chat_train]
    t0 = time.perf_counter()
    re = realign(target, drafter, tokenizer, struct_train, older, realign_cfg, progress=_show)
    realign_s = time.perf_counter() - t0
    new = re.model
    struct_after = replayed_figures(target, new, tokenizer, struct_held, args.k)
    chat_after = replayed_figures(target, new, tokenizer, chat_held, args.k)
    m = re.metrics
    result["realign"] = {
        "wall_s": round(realign_s, 1),
        "train_metrics": {k: v for k, v in m.items() if k not in ("history", "config")},
        "history": m["history"],
        "structured_heldout_stale": stale,
        "structured_heldout_realigned": struct_after,
        "chat_heldout_realigned": chat_after,
        "implied_speedup_by_k": implied_by_k(struct_after, cost, args.k),
        "stale_hit_rate": stale["all"]["hit_rate"],
        "realigned_hit_rate": struct_after["all"]["hit_rate"],
        "old_traffic_drop_points": round(
            100 * (chat_fig["all"]["hit_rate"] - chat_after["all"]["hit_rate"]), 2
        ),
        "implied_speedup_vs_nospec": round(
            implied_speedup(struct_after["all"]["tokens_per_step"], cost["verify_ratio"], cost["c"], args.k),
            3,
        ),
        "realign_tokens_per_s": m.get("train_tokens_per_s"),
        "teacher_tokens_per_s": m.get("teacher_tokens_per_s"),
    }
    if args.decode:
        result["realign"]["decoded"] = decode_pairs(
            target, new, tokenizer, struct_held[: args.decode], args.k, args.structured_tokens
        )
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(
        json.dumps({k: v for k, v in result["realign"].items() if not isinstance(v, (dict, list))}, indent=2)
    )


if __name__ == "__main__":
    main()
