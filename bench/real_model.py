"""A real open model's figures: SmolLM2-135M-Instruct's costs, fidelity and speed against Hugging Face.

Owns the bench of the real chat target (an HF folder, ``make smollm2`` puts it in
var/models/smollm2-135m-instruct) and its drafter (``--drafter DIR``, an HF folder; by default the
narrow first drafter built from the target, ``narrow_drafter_from_target``, untrained). Every
figure comes from one process, batch size 1, greedy, float32, on ``--threads`` torch threads (1 by
default), k = 4. The work is split into parts, each a function of the shared :class:`Bench` that
returns a dict of figures (and ``detail``); a run executes the parts chosen with ``--only`` and
merges what they return into bench/results/real_model.json, keeping the entries of parts it did not
run. A further part (the loop's day-0 and realignment figures, say) is a module of its own,
``bench/real_model_part_<name>.py`` with ``measure(bench: Bench) -> dict``, found and run after
these. A part that raises is recorded as failed (its error, and none of its figures, not even an
earlier run's) and the others still run:

- ``costs``: ``target_step_ms``, ``verify_cost_k_plus_1`` (a (k+1)-row verify pass over a one-row
  step) and ``drafter_c`` (drafter step over target step), from
  ``workers.canary.replay.measure_costs`` (forwards interleaved round by round, medians) after a
  real chat context of ``--cost-position`` tokens, and the analytic never-missing ceiling they imply.
- ``fidelity``: ``logit_max_abs_diff_vs_transformers`` (the engine's logits against
  ``transformers``' on chat prompts and their greedy answers, both the prefill path and the
  one-row decode steps), beside ``transformers_own_logit_max_abs_diff`` (transformers' own
  cached steps against its own one pass: the float32 noise of the reference itself), and
  ``greedy_identical`` (1 when the engine's speculative greedy output with the drafter equals
  ``generate(do_sample=False)`` token for token on every prompt, else 0).
- ``comparison``: the shifted traffic (structured work as chat requests: JSON extraction, JSON tool
  calls and SQL, each after two or three worked turns; ``workers.corpora``' ``chat_structured``
  traffic, held-out side, balanced by kind), the same prompts and k for six arms, interleaved per
  prompt in rotated order after one warm-up request per arm: the engine without speculation, the
  engine with the drafter, the engine with a never-missing drafter that pays the drafter's real
  forwards (``workers.engine.never_missing``), transformers' assisted generation with the same drafter
  (exported as an HF folder, ``num_assistant_tokens`` = k, constant schedule, no confidence stop),
  transformers' prompt lookup (``prompt_lookup_num_tokens`` = k) and transformers' plain greedy.
  Every request runs until end-of-text or ``--new-tokens``; tokens/s is output tokens (end-of-text
  included) over the wall time of the whole call, prefill included, pooled over prompts. Figures:
  ``tokens_per_s_<arm>``; ``speedup_vs_hf_assisted`` and ``speedup_vs_prompt_lookup`` (the engine
  with the drafter over those arms), ``speedup_vs_nospec``, ``share_of_measured_ceiling`` (the
  engine with the drafter over the never-missing arm), ``never_missing_speedup_vs_nospec``, HF's
  own arms over HF greedy, ``drafter_hit_rate``; each ratio with ``<key>_ci95``, a
  percentile-bootstrap 95 % interval from resampling prompts (a prompt's arms stay together). The
  engine's three arms are also compared over the decode phase alone (``detail``), since
  transformers' generate does not say when its first token came.

Absolute milliseconds move with the machine's load (a shared machine); the ratios are measured
interleaved so that load moves both sides of each together, and the 1-minute load average is
recorded beside them.

Usage: .venv/bin/python bench/real_model.py [--quick] [--model DIR] [--drafter DIR]
       [--only costs,fidelity,comparison] [--prompts 24] [--new-tokens 96]
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import itertools
import json
import os
import random
import statistics
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from workers import corpora  # noqa: E402
from workers.canary.replay import measure_costs  # noqa: E402
from workers.engine.decoder import SpeculativeDecoder  # noqa: E402
from workers.engine.hf_io import load_hf_folder, save_hf_folder  # noqa: E402
from workers.engine.model import Transformer  # noqa: E402
from workers.engine.never_missing import Continuations, NeverMissingDraftProposer  # noqa: E402
from workers.engine.proposers import DraftModelProposer  # noqa: E402
from workers.engine.tokenizer import Tokenizer, ensure_same_tokenizer  # noqa: E402
from workers.training.first_drafter import narrow_drafter_from_target  # noqa: E402

DEFAULT_MODEL = ROOT / "var" / "models" / "smollm2-135m-instruct"
BENCH = ROOT / "bench"
RESULTS = BENCH / "results" / "real_model.json"
MAX_SEQ_LEN = 2048
BOOTSTRAP_RESAMPLES = 4000
# Traffic streams apart from the comparison's (--seed, and --seed + 1 for its warm-up request).
FIDELITY_STREAM = 1_000
COST_CONTEXT_STREAM = 1_001

# ----------------------------------------------------------------------------------------- prompts


@dataclass(frozen=True)
class ChatPrompt:
    """One chat request: its traffic category and its messages (ChatML roles)."""

    category: str
    messages: tuple[dict[str, str], ...]


def _balanced(stream: Iterator[corpora.Prompt], n: int) -> list[ChatPrompt]:
    """``n`` chat requests from the first ``3 n`` of ``stream``, taken in turn by task kind (kinds in
    name order; the stream draws them at random), so no kind's share is left to chance."""
    by_kind: dict[str, list[ChatPrompt]] = {}
    for prompt in itertools.islice(stream, 3 * n):
        by_kind.setdefault(prompt.kind, []).append(ChatPrompt(prompt.kind, tuple(prompt.messages)))
    queues = [by_kind[kind] for kind in sorted(by_kind)]
    picked: list[ChatPrompt] = []
    while len(picked) < n and any(queues):
        for queue in queues:
            if queue and len(picked) < n:
                picked.append(queue.pop(0))
    if len(picked) < n:
        raise ValueError(f"the stream ended after {len(picked)} of {n} requests")
    return picked


def shifted_traffic(n: int, seed: int) -> list[ChatPrompt]:
    """``n`` structured-work chat requests (JSON extraction, JSON tool calls, SQL, each with two or
    three worked turns first): stream ``seed`` of the ``chat_structured`` traffic's held-out side
    (``workers.corpora``), the documents a drafter realigned on the other side never saw."""
    return _balanced(corpora.traffic_prompts("chat_structured", "test", seed, heldout=True), n)


def fidelity_prompts(n_general: int, n_structured: int, seed: int) -> list[ChatPrompt]:
    """General chat (the ``chat`` traffic: explain, advise, rewrite, summarise, compose) and
    structured work, held out, from streams the comparison does not draw (``seed`` apart)."""
    general = _balanced(corpora.traffic_prompts("chat", "test", seed, heldout=True), n_general)
    return general + shifted_traffic(n_structured, seed)


# ------------------------------------------------------------------------------------- pure logic


def arm_orders(names: Sequence[str], n_prompts: int) -> list[list[str]]:
    """Prompt i runs the arms rotated by i: over any len(names) consecutive prompts every arm takes
    every position once, so no arm always runs first (cold) or right after a given other arm."""
    m = len(names)
    return [[names[(i + j) % m] for j in range(m)] for i in range(n_prompts)]


@dataclass(frozen=True)
class Timing:
    """One request of one arm: output tokens and wall seconds."""

    tokens: int
    seconds: float


def pooled_tokens_per_s(timings: Sequence[Timing]) -> float:
    return sum(t.tokens for t in timings) / sum(t.seconds for t in timings)


def paired_speedup(
    faster: Sequence[Timing], slower: Sequence[Timing], *, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0
) -> dict[str, Any]:
    """Pooled tokens/s of ``faster`` over ``slower`` on the same prompts (index i is one prompt in
    both), with a percentile-bootstrap 95 % interval from resampling prompts with their pair, the
    per-prompt ratios' median and the share of prompts on which ``faster`` was faster."""
    if len(faster) != len(slower) or not faster:
        raise ValueError(f"need paired timings on the same prompts, got {len(faster)} and {len(slower)}")
    n = len(faster)
    rng = random.Random(seed)

    def ratio(idx: Sequence[int]) -> float:
        return pooled_tokens_per_s([faster[i] for i in idx]) / pooled_tokens_per_s([slower[i] for i in idx])

    boot = sorted(ratio([rng.randrange(n) for _ in range(n)]) for _ in range(resamples))
    per_prompt = [
        (a.tokens / a.seconds) / (b.tokens / b.seconds) for a, b in zip(faster, slower, strict=True)
    ]
    return {
        "ratio": ratio(range(n)),
        "ci95": [boot[int(0.025 * resamples)], boot[int(0.975 * resamples) - 1]],
        "prompts": n,
        "per_prompt_median": statistics.median(per_prompt),
        "share_of_prompts_faster": sum(r > 1.0 for r in per_prompt) / n,
    }


def merge_results(
    existing: Mapping[str, Any], part: str, returned: Mapping[str, Any], wall_s: float
) -> dict[str, Any]:
    """The results file after ``part`` ran: its figures (every key but ``detail``) at the top level,
    replacing what an earlier run of any part wrote under the same keys, and its entry under
    ``parts`` (the figure keys it gave, its detail, wall time, load); other parts' entries stay."""
    merged = dict(existing)
    parts = dict(merged.get("parts", {}))
    for stale in parts.get(part, {}).get("figures", ()):  # what this part wrote last time
        merged.pop(stale, None)
    figures = {k: v for k, v in returned.items() if k != "detail"}
    merged.update(figures)
    parts[part] = {
        "status": "ok",
        "figures": sorted(figures),
        "detail": returned.get("detail", {}),
        "wall_s": round(wall_s, 1),
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "load_average_1m_after": round(os.getloadavg()[0], 2),
    }
    merged["parts"] = parts
    return merged


def record_failure(
    existing: Mapping[str, Any], part: str, error: BaseException, wall_s: float
) -> dict[str, Any]:
    """The results file after ``part`` raised: none of its figures (an earlier run's would pass for
    this run's), its error under ``parts``."""
    merged = merge_results(existing, part, {}, wall_s)
    merged["parts"][part].update(status="failed", error=f"{type(error).__name__}: {error}")
    return merged


# ------------------------------------------------------------------------------------------- bench


@dataclass
class Bench:
    """What every part shares: the target and drafter, loaded once, in the engine and in transformers."""

    model_dir: Path
    drafter_dir: Path | None
    k: int
    quick: bool
    prompts: int
    new_tokens: int
    seed: int
    cost_position: int
    _tmp: tempfile.TemporaryDirectory[str] | None = field(default=None, repr=False)

    @cached_property
    def target_and_tokenizer(self) -> tuple[Transformer, Tokenizer]:
        return load_hf_folder(self.model_dir, max_seq_len=MAX_SEQ_LEN)

    @property
    def target(self) -> Transformer:
        return self.target_and_tokenizer[0]

    @property
    def tokenizer(self) -> Tokenizer:
        return self.target_and_tokenizer[1]

    @cached_property
    def drafter(self) -> Transformer:
        if self.drafter_dir is None:
            return narrow_drafter_from_target(self.target)
        drafter, tok = load_hf_folder(self.drafter_dir, max_seq_len=MAX_SEQ_LEN)
        ensure_same_tokenizer(self.tokenizer, tok, "target", "drafter")
        return drafter

    @property
    def drafter_name(self) -> str:
        return str(self.drafter_dir) if self.drafter_dir else "narrow_drafter_from_target (untrained)"

    @cached_property
    def drafter_hf_dir(self) -> Path:
        """The drafter as an HF folder transformers loads: ``--drafter`` itself, or the built one saved."""
        if self.drafter_dir is not None:
            return self.drafter_dir
        self._tmp = tempfile.TemporaryDirectory(prefix="real-model-drafter-")
        save_hf_folder(self.drafter, self.tokenizer, self._tmp.name)
        return Path(self._tmp.name)

    @cached_property
    def hf_tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.model_dir)

    @cached_property
    def hf_target(self) -> Any:
        return _hf_model(self.model_dir)

    @cached_property
    def hf_drafter(self) -> Any:
        model = _hf_model(self.drafter_hf_dir)
        model.generation_config.num_assistant_tokens = self.k
        model.generation_config.num_assistant_tokens_schedule = "constant"
        model.generation_config.assistant_confidence_threshold = 0.0  # draft exactly k, as the engine
        return model

    def encode(self, prompt: ChatPrompt) -> list[int]:
        """The ChatML rendering of the prompt with the assistant turn opened, as token ids."""
        text = self.hf_tokenizer.apply_chat_template(
            list(prompt.messages), tokenize=False, add_generation_prompt=True
        )
        ids: list[int] = self.hf_tokenizer(text, add_special_tokens=False).input_ids
        return ids

    def hf_generate(self, ids: Sequence[int], max_new_tokens: int, **kwargs: Any) -> list[int]:
        """transformers' greedy ``generate`` after ``ids``: the new tokens, end-of-text included."""
        x = torch.tensor([list(ids)])
        with torch.inference_mode():
            y = self.hf_target.generate(
                x,
                attention_mask=torch.ones_like(x),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                pad_token_id=self.tokenizer.eos_id,
                **kwargs,
            )
        out: list[int] = y[0, x.shape[1] :].tolist()
        return out


def _hf_model(folder: Path) -> Any:
    transformers: Any = importlib.import_module("transformers")  # untyped: kept behind Any
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _without_eos(tokens: Sequence[int], eos: int | None) -> list[int]:
    out = list(tokens)
    if out and out[-1] == eos:
        out.pop()
    return out


# ------------------------------------------------------------------------------------------- parts


def part_costs(bench: Bench) -> dict[str, Any]:
    """Isolated step costs at a real chat context of ``cost_position`` tokens."""
    context: list[int] = []
    for prompt in shifted_traffic(12, seed=COST_CONTEXT_STREAM):
        context += bench.encode(prompt)
        if len(context) >= bench.cost_position:
            break
    context = context[: bench.cost_position]
    repeats = 10 if bench.quick else 40
    costs = measure_costs(bench.target, {"drafter": bench.drafter}, context, max_k=bench.k, repeats=repeats)
    verify, c = costs.verify_cost[bench.k], costs.cost_ratio_by_arm["drafter"]
    return {
        "target_step_ms": costs.target_step_ms,
        "verify_cost_k_plus_1": verify,
        "drafter_c": c,
        # Leviathan et al. at acceptance 1: k + 1 tokens per round that costs a verify and k drafts.
        "analytic_never_missing_speedup": (bench.k + 1) / (verify + bench.k * c),
        "detail": {
            "k": bench.k,
            "context_tokens": costs.context_tokens,
            "repeats": repeats,
            "drafter_step_ms": costs.drafter_step_ms["drafter"],
            "verify_cost_by_k": {str(k): v for k, v in costs.verify_cost.items()},
            "drafter": bench.drafter_name,
            "drafter_params": bench.drafter.num_params(),
            "target_params": bench.target.num_params(),
        },
    }


@torch.inference_mode()
def _logit_gaps(bench: Bench, ids: list[int], answer: list[int]) -> dict[str, float]:
    """The largest |engine - transformers| logit over the prompt and answer: the prefill path (one
    pass over prompt + answer) and the one-row decode steps (prefill the prompt, then the answer
    token by token)."""
    seq = torch.tensor([ids + answer])  # [1, T]
    reference = bench.hf_target(seq).logits[0]  # [T, V]
    target = bench.target
    cache = target.new_cache(1, seq.shape[1] + 1)
    prefill = target.forward_cached(seq, cache)[0]  # [T, V]
    cache.reset()
    steps = [target.forward_cached(torch.tensor([ids]), cache, last_only=True)[0, -1]]
    for tok in answer:
        steps.append(target.forward_cached(torch.tensor([[tok]]), cache)[0, -1])
    stepped = torch.stack(steps[: len(answer) + 1])  # [A+1, V]: positions len(ids)-1 .. T-1
    ref_tail = reference[len(ids) - 1 :]
    top2 = torch.topk(ref_tail, 2, dim=-1).values  # [A+1, 2]
    # transformers against itself: its own cached decode steps against its own one pass. The same
    # float32 sums in another order; what the engine's gap is judged against.
    out = bench.hf_target(torch.tensor([ids]), use_cache=True)
    own_steps = [out.logits[0, -1]]
    for tok in answer:
        out = bench.hf_target(torch.tensor([[tok]]), past_key_values=out.past_key_values, use_cache=True)
        own_steps.append(out.logits[0, -1])
    own = torch.stack(own_steps[: len(answer) + 1])
    return {
        "prefill": float((prefill - reference).abs().max()),
        "steps": float((stepped - ref_tail[: stepped.shape[0]]).abs().max()),
        "transformers_own_steps": float((own - ref_tail[: own.shape[0]]).abs().max()),
        "smallest_top2_margin": float((top2[:, 0] - top2[:, 1]).min()),
    }


def part_fidelity(bench: Bench) -> dict[str, Any]:
    """Engine logits and speculative greedy output against transformers on chat prompts."""
    prompts = (
        fidelity_prompts(2, 1, FIDELITY_STREAM) if bench.quick else fidelity_prompts(4, 4, FIDELITY_STREAM)
    )
    new_tokens = min(bench.new_tokens, 48 if bench.quick else 96)
    eos = bench.tokenizer.eos_id
    decoder = SpeculativeDecoder(
        bench.target, bench.tokenizer, DraftModelProposer(bench.drafter), k=bench.k, max_len=MAX_SEQ_LEN
    )
    rows: list[dict[str, Any]] = []
    for prompt in prompts:
        ids = bench.encode(prompt)
        hf_out = bench.hf_generate(ids, new_tokens)
        ours = decoder.generate(ids, new_tokens, stop_at_eos=True)
        theirs = _without_eos(hf_out, eos)
        first_diff = next(
            (i for i, (a, b) in enumerate(zip(ours.token_ids, theirs, strict=False)) if a != b),
            None if len(ours.token_ids) == len(theirs) else min(len(ours.token_ids), len(theirs)),
        )
        gaps = _logit_gaps(bench, ids, theirs)
        m = ours.metrics
        rows.append(
            {
                "category": prompt.category,
                "prompt_tokens": len(ids),
                "output_tokens": len(theirs),
                "identical": ours.token_ids == theirs,
                "first_difference_at": first_diff,
                "logit_max_abs_diff": max(gaps["prefill"], gaps["steps"]),
                **{f"logit_{k}": v for k, v in gaps.items()},
                "drafter_hit_rate": m.accepted_tokens / m.drafted_tokens if m.drafted_tokens else None,
                "answer": bench.tokenizer.decode(theirs)[:160],
            }
        )
        print(
            f"  {prompt.category:<16} {len(ids):>4} prompt tokens, {len(theirs):>3} out, identical "
            f"{rows[-1]['identical']}, logit gap {rows[-1]['logit_max_abs_diff']:.2e} (transformers "
            f"against itself {rows[-1]['logit_transformers_own_steps']:.2e})",
            flush=True,
        )
    # The drafter transformers' assisted generation uses must be the engine's drafter.
    probe = torch.tensor([bench.encode(prompts[0])])
    with torch.inference_mode():
        drafter_gap = float(
            (
                bench.drafter.forward_cached(probe, bench.drafter.new_cache(1, probe.shape[1]))[0]
                - bench.hf_drafter(probe).logits[0]
            )
            .abs()
            .max()
        )
    return {
        "logit_max_abs_diff_vs_transformers": max(r["logit_max_abs_diff"] for r in rows),
        # The reference's own float32 noise: transformers' cached steps against its one pass.
        "transformers_own_logit_max_abs_diff": max(r["logit_transformers_own_steps"] for r in rows),
        "greedy_identical": int(all(r["identical"] for r in rows)),
        "detail": {
            "prompts": len(rows),
            "new_tokens": new_tokens,
            "k": bench.k,
            "drafter": bench.drafter_name,
            "drafter_logit_max_abs_diff_vs_transformers": drafter_gap,
            "per_prompt": rows,
        },
    }


@dataclass(frozen=True)
class Served:
    """What an arm did with one request: its output (end-of-text left out), how many tokens it
    emitted (end-of-text counted), the engine's drafted and accepted counts and its time to the
    first token (None for transformers' arms, whose generate does not say)."""

    output: list[int]
    tokens: int
    drafted: int = 0
    accepted: int = 0
    first_token_s: float | None = None


Arm = Callable[[list[int], int], Served]  # (prompt ids, most new tokens) -> what it served

ENGINE_ARMS = ("nospec", "drafter", "never_missing")
ARMS = (*ENGINE_ARMS, "hf_assisted", "hf_prompt_lookup", "hf_greedy")


def _engine_arm(decoder: SpeculativeDecoder) -> Arm:
    def run(ids: list[int], max_new: int) -> Served:
        res = decoder.generate(ids, max_new, stop_at_eos=True)
        m = res.metrics
        first = m.ttft_ms / 1e3 if m.ttft_ms is not None else None
        return Served(res.token_ids, m.generated_tokens, m.drafted_tokens, m.accepted_tokens, first)

    return run


def _hf_arm(bench: Bench, **kwargs: Any) -> Arm:
    eos = bench.tokenizer.eos_id

    def run(ids: list[int], max_new: int) -> Served:
        out = bench.hf_generate(ids, max_new, **kwargs)
        return Served(_without_eos(out, eos), len(out))

    return run


def _count(prompts: Sequence[ChatPrompt]) -> dict[str, int]:
    return dict(sorted(Counter(p.category for p in prompts).items()))


def part_comparison(bench: Bench) -> dict[str, Any]:
    """Six arms on the shifted traffic, interleaved per prompt, warm, one thread."""
    k, new_tokens = bench.k, bench.new_tokens
    traffic = shifted_traffic(bench.prompts, seed=bench.seed)
    prompts = [bench.encode(p) for p in traffic]
    warm_ids = bench.encode(shifted_traffic(1, seed=bench.seed + 1)[0])
    max_len = max(len(p) for p in [*prompts, warm_ids]) + new_tokens + k + 2
    target, tokenizer, eos = bench.target, bench.tokenizer, bench.tokenizer.eos_id
    nospec = SpeculativeDecoder(target, tokenizer, None, k=0, max_len=max_len)
    proposer = DraftModelProposer(bench.drafter, max_len)
    continuations = Continuations()
    twin = NeverMissingDraftProposer(bench.drafter, continuations, max_len)
    engines = {
        "nospec": nospec,
        "drafter": SpeculativeDecoder(target, tokenizer, proposer, k=k, max_len=max_len),
        "never_missing": SpeculativeDecoder(target, tokenizer, twin, k=k, max_len=max_len),
    }
    arms: dict[str, Arm] = {name: _engine_arm(dec) for name, dec in engines.items()}
    arms["hf_assisted"] = _hf_arm(
        bench,
        assistant_model=bench.hf_drafter,
        num_assistant_tokens=k,
        num_assistant_tokens_schedule="constant",
        assistant_confidence_threshold=0.0,
    )
    arms["hf_prompt_lookup"] = _hf_arm(bench, prompt_lookup_num_tokens=k)
    arms["hf_greedy"] = _hf_arm(bench)
    assert tuple(arms) == ARMS

    # Each prompt's greedy continuation, known before any timed request (the never-missing arm
    # drafts it); end-of-text included when the answer ended there, since the target writes it.
    t0 = time.perf_counter()
    for ids in prompts:
        res = nospec.generate(ids, new_tokens, stop_at_eos=True)
        continuations.add(
            ids, res.token_ids + ([eos] if res.finish_reason == "stop" and eos is not None else [])
        )
    reference_s = time.perf_counter() - t0
    for name in ARMS:  # one warm-up request per arm, on a prompt outside the measured set
        arms[name](warm_ids, 16)

    orders = arm_orders(ARMS, len(prompts))
    print(
        f"  {len(prompts)} prompts ({', '.join(f'{c} {n}' for c, n in _count(traffic).items())}), "
        f"k={k}, up to {new_tokens} new tokens, {torch.get_num_threads()} thread(s); arms "
        f"{', '.join(ARMS)}, rotated by one per prompt (prompt 1 runs them in that order, prompt 2 "
        f"from {ARMS[1]}, ...), each warmed up by one request first",
        flush=True,
    )
    timings: dict[str, list[Timing]] = {name: [] for name in ARMS}
    decode: dict[str, list[Timing]] = {name: [] for name in ENGINE_ARMS}  # after the first token
    outputs: dict[str, list[list[int]]] = {name: [] for name in ARMS}
    drafted = dict.fromkeys(ARMS, 0)
    accepted = dict.fromkeys(ARMS, 0)
    t_run = time.perf_counter()
    for i, (ids, order) in enumerate(zip(prompts, orders, strict=True)):
        for name in order:
            start = time.perf_counter()
            served = arms[name](ids, new_tokens)
            seconds = time.perf_counter() - start
            drafted[name] += served.drafted
            accepted[name] += served.accepted
            timings[name].append(Timing(served.tokens, seconds))
            if served.first_token_s is not None:
                decode[name].append(Timing(served.tokens - 1, seconds - served.first_token_s))
            outputs[name].append(served.output)
        print(
            f"  prompt {i + 1}/{len(prompts)} ({traffic[i].category}, {len(ids)} tokens, "
            f"{len(outputs['nospec'][-1])} out): "
            + " ".join(f"{n} {timings[n][-1].tokens / timings[n][-1].seconds:.1f}" for n in ARMS)
            + " tok/s",
            flush=True,
        )
    run_s = time.perf_counter() - t_run
    tps = {name: pooled_tokens_per_s(timings[name]) for name in ARMS}
    ratios = {
        "speedup_vs_hf_assisted": paired_speedup(timings["drafter"], timings["hf_assisted"]),
        "speedup_vs_prompt_lookup": paired_speedup(timings["drafter"], timings["hf_prompt_lookup"]),
        "speedup_vs_nospec": paired_speedup(timings["drafter"], timings["nospec"]),
        "share_of_measured_ceiling": paired_speedup(timings["drafter"], timings["never_missing"]),
        "never_missing_speedup_vs_nospec": paired_speedup(timings["never_missing"], timings["nospec"]),
        "hf_assisted_speedup_vs_hf_greedy": paired_speedup(timings["hf_assisted"], timings["hf_greedy"]),
        "prompt_lookup_speedup_vs_hf_greedy": paired_speedup(
            timings["hf_prompt_lookup"], timings["hf_greedy"]
        ),
        "nospec_vs_hf_greedy": paired_speedup(timings["nospec"], timings["hf_greedy"]),
    }
    # The engine's arms over the decode phase alone (the prefill is the same work in all three), as
    # bench/drafters_realign.py measures its share of the ceiling; requests of one token drop out.
    both = [i for i in range(len(prompts)) if all(decode[n][i].tokens > 0 for n in ENGINE_ARMS)]
    dec = {n: [decode[n][i] for i in both] for n in ENGINE_ARMS}
    decode_ratios = {
        "speedup_vs_nospec": paired_speedup(dec["drafter"], dec["nospec"]),
        "share_of_measured_ceiling": paired_speedup(dec["drafter"], dec["never_missing"]),
        "never_missing_speedup_vs_nospec": paired_speedup(dec["never_missing"], dec["nospec"]),
    }
    by_category = {}
    for category in _count(traffic):
        idx = [i for i, p in enumerate(traffic) if p.category == category]
        if not idx:
            continue
        pick = {n: [timings[n][i] for i in idx] for n in ARMS}
        by_category[category] = {
            "prompts": len(idx),
            "speedup_vs_nospec": paired_speedup(pick["drafter"], pick["nospec"])["ratio"],
            "speedup_vs_hf_assisted": paired_speedup(pick["drafter"], pick["hf_assisted"])["ratio"],
            "speedup_vs_prompt_lookup": paired_speedup(pick["drafter"], pick["hf_prompt_lookup"])["ratio"],
            "never_missing_speedup_vs_nospec": paired_speedup(pick["never_missing"], pick["nospec"])["ratio"],
        }
    reference = outputs["nospec"]
    identical = {
        name: sum(a == b for a, b in zip(outputs[name], reference, strict=True))
        for name in ARMS
        if name != "nospec"
    }
    ended = sum(1 for out in reference if len(out) < new_tokens)
    figures: dict[str, Any] = {f"tokens_per_s_{name}": tps[name] for name in ARMS}
    for key, r in ratios.items():
        figures[key] = r["ratio"]
        figures[f"{key}_ci95"] = r["ci95"]
    figures["drafter_hit_rate"] = accepted["drafter"] / drafted["drafter"] if drafted["drafter"] else None
    figures["detail"] = {
        "prompts": len(prompts),
        "categories": _count(traffic),
        "traffic": "workers.corpora chat_structured, test split, held-out side, stream "
        f"{bench.seed}, balanced by kind (bench/real_model.py shifted_traffic)",
        "k": k,
        "new_tokens": new_tokens,
        "threads": torch.get_num_threads(),
        "mean_prompt_tokens": statistics.mean(len(p) for p in prompts),
        "mean_output_tokens": statistics.mean(t.tokens for t in timings["nospec"]),
        "share_ended_at_end_of_text": ended / len(prompts),
        "arm_order": "rotated per prompt: prompt i runs ARMS rotated by i (each arm in each position "
        "once per 6 consecutive prompts); one warm-up request per arm before the first prompt",
        "arms": list(ARMS),
        "orders": orders,
        "outputs_identical_to_nospec": identical,
        "ratios": ratios,
        "decode_phase_ratios": decode_ratios,
        "by_category": by_category,
        "per_prompt": {
            name: [{"tokens": t.tokens, "seconds": round(t.seconds, 4)} for t in timings[name]]
            for name in ARMS
        },
        "drafter": bench.drafter_name,
        "drafted": drafted["drafter"],
        "accepted": accepted["drafter"],
        "never_missing_hit_rate": accepted["never_missing"] / max(1, drafted["never_missing"]),
        "never_missing_off_continuation_drafts": twin.off_continuation,
        "reference_pass_s": round(reference_s, 1),
        "timed_run_s": round(run_s, 1),
        "absolute_times": "under load: the machine is shared; ratios are interleaved per prompt",
    }
    return figures


Part = Callable[[Bench], dict[str, Any]]
PARTS: dict[str, Part] = {"costs": part_costs, "fidelity": part_fidelity, "comparison": part_comparison}


def part_files(bench_dir: Path = BENCH) -> dict[str, Path]:
    """Parts kept in modules of their own: ``bench/real_model_part_<name>.py``, each with a
    ``measure(bench: Bench) -> dict`` (figures, and ``detail``), run after the parts above."""
    return {
        path.stem.removeprefix("real_model_part_"): path
        for path in sorted(bench_dir.glob("real_model_part_*.py"))
    }


def part_names() -> tuple[str, ...]:
    return (*PARTS, *(name for name in part_files() if name not in PARTS))


def load_part(name: str, bench_dir: Path = BENCH) -> Part:
    """The function that runs part ``name``: one of PARTS, or its module's ``measure``."""
    if name in PARTS:
        return PARTS[name]
    path = part_files(bench_dir)[name]
    spec = importlib.util.spec_from_file_location(f"bench_real_model_part_{name}", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses in the part look their module up here
    spec.loader.exec_module(module)
    measure = getattr(module, "measure", None)
    if not callable(measure):
        raise TypeError(f"{path.name} has no measure(bench) -> dict")
    return measure  # type: ignore[no-any-return]


# -------------------------------------------------------------------------------------------- main


def _parse_only(value: str) -> tuple[str, ...]:
    chosen = tuple(p.strip() for p in value.split(",") if p.strip())
    names = part_names()
    unknown = [p for p in chosen if p not in names]
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(
            f"unknown part(s) {unknown or '(none)'}; choose from {', '.join(names)}"
        )
    return tuple(p for p in names if p in chosen)


def _print_summary(results: Mapping[str, Any], ran: Sequence[str]) -> None:
    def show(key: str) -> str:
        value = results.get(key)
        if isinstance(value, float):
            ci = results.get(f"{key}_ci95")
            return f"{value:.4g}" + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "")
        return str(value)

    keys = [k for p in ran for k in results["parts"][p]["figures"] if not k.endswith("_ci95")]
    width = max((len(k) for k in keys), default=0) + 2
    print("\n" + "\n".join(f"{k:<{width}}{show(k)}" for k in keys))
    for part in ran:
        if results["parts"][part]["status"] != "ok":
            print(f"{part}: {results['parts'][part]['status']}: {results['parts'][part].get('error')}")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="the target's HF folder")
    p.add_argument(
        "--drafter", type=Path, default=None, help="a drafter HF folder (default: the narrow first drafter)"
    )
    p.add_argument(
        "--quick", action="store_true", help="a few-minute variant: fewer prompts, shorter answers"
    )
    p.add_argument("--only", type=_parse_only, default=part_names(), metavar="PART,...")
    p.add_argument("--prompts", type=int, default=None, help="comparison prompts (default 24, quick 6)")
    p.add_argument("--new-tokens", type=int, default=None, help="most output tokens (default 96, quick 48)")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cost-position", type=int, default=200)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if not (args.model / "config.json").is_file():
        print(
            f"error: no model at {args.model}: run `make smollm2` to import SmolLM2-135M-Instruct there, "
            "or pass --model DIR (an HF folder)",
            file=sys.stderr,
        )
        return 2
    if args.drafter is not None and not (args.drafter / "config.json").is_file():
        print(f"error: no drafter HF folder at {args.drafter}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    bench = Bench(
        model_dir=args.model,
        drafter_dir=args.drafter,
        k=args.k,
        quick=args.quick,
        prompts=args.prompts or (6 if args.quick else 24),
        new_tokens=args.new_tokens or (48 if args.quick else 96),
        seed=args.seed,
        cost_position=args.cost_position,
    )
    print(
        f"real model {args.model}, drafter {bench.drafter_name}, k={args.k}, {args.threads} thread(s), "
        f"parts {','.join(args.only)}{' (quick)' if args.quick else ''}; absolute ms are under whatever "
        "load the machine has, ratios are interleaved",
        flush=True,
    )
    results: dict[str, Any] = json.loads(args.out.read_text()) if args.out.is_file() else {}
    failed: list[str] = []
    for part in args.only:
        print(f"\n=== {part} ===", flush=True)
        started = time.perf_counter()
        try:
            returned = load_part(part)(bench)
        except KeyboardInterrupt:
            raise
        except Exception as exc:
            traceback.print_exc()
            results = record_failure(results, part, exc, time.perf_counter() - started)
            failed.append(part)
        else:
            results = merge_results(results, part, returned, time.perf_counter() - started)
        results["parts"][part]["settings"] = {
            "model": str(args.model),
            "drafter": bench.drafter_name,
            "quick": args.quick,
            "threads": args.threads,
            "k": args.k,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1, default=str) + "\n")
    _print_summary(results, args.only)
    print(f"load average (1 min) {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; wrote {args.out}")
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
