"""Shadow replay: the same held-out prompts through every arm of a canary, paired per prompt.

Owns :func:`shadow_replay` (and its :class:`ReplayResult`), the measurement the canary's first
phase decides on, and :func:`measure_costs`, the step costs the draft-length tuner needs. Pure
torch on top of ``workers.engine``: no database, no Celery (``workers.canary_tasks`` is the thin
task around it).

- Arms are named ("baseline", "incumbent", "candidate"); ``None`` is no speculation, a
  ``Transformer`` is a draft model, any engine ``Proposer`` (n-gram, ...) is accepted too. An
  incumbent without speculation (a deployment with no drafter yet) decodes exactly as the baseline
  does: it is run once, as the baseline, and reported under both names.
- Arms are interleaved per prompt, in an order rotated from prompt to prompt (every arm runs
  first, second, ... equally often), so the drift of a shared, noisy machine lands on every arm
  alike; one untimed warm-up request per arm comes first.
- Lossless check: with greedy decoding every arm must emit exactly the tokens of plain greedy
  decoding with the target. The reference is computed by a separate minimal KV-cache loop that
  shares no code with the decoder's scorer/verifier (``reference="independent"``), so a broken
  verifier is caught even in the no-speculation arm. A difference whose two tokens are tied in the
  target's logits to float rounding (a 1-token and a (k+1)-token forward round differently) is a
  recorded ``tie``, not a failure; any other difference marks the arm ``broken`` with the prompt.
- Figures per arm: hit rate (accepted / drafted), per-position acceptance (Fireworks-style
  accepted_i / drafted_i, and the conditional rate the tuner uses), mean accepted length per
  verify step (1 + accepted / steps), tokens/s, TTFT, and inter-token latency p50/p95, where a
  request's inter-token latency is (last token time - first token time) / (tokens - 1), the
  AIPerf / genai-perf definition, and the percentiles are taken over requests. Per prompt, the
  paired figures the sequential canary statistics consume: ``tokens_per_step`` and
  ``ms_per_token`` (request latency / output tokens).
- Measured ceiling (``ceiling_of``, greedy only): a fourth arm, ``never_missing``, drafts the
  target's own greedy continuation of each prompt (from a plain greedy pass made before the timed
  ones, the same pass the lossless check compares against) while running the named arm's drafter
  forwards exactly as that arm does (``workers.engine.never_missing``), interleaved with the
  others. Its speed-up over no speculation is the most that drafter can give at this k on this
  machine, per-round engine work included; ``share_of_ceiling`` is the named arm's realised speed-up
  over that one. Speed-ups are over the decode phase (tokens after the first / time after the
  first: the prefill is the same in every arm, and counting it would pull every ratio towards 1);
  the same with the prefill counted, a per-prompt paired median, and the Leviathan figure at
  acceptance 1 from the isolated step costs (``analytic_ceiling_speedup``) stand beside it, as
  cross-checks.
- Costs: ``c`` = drafter step / target step (1 token each, at the prompts' context length) and
  ``verify_cost[k]`` = target forward over k + 1 tokens / over 1 token, medians of interleaved
  timings (on a GPU each timed forward waits for its kernels); the same ratios measured in situ
  during the replay are reported beside them.
- Device: everything runs where the target is. On a GPU the forward passes run under bf16 autocast
  and the GPU is torch's default device for the replay, so the token tensors the engine builds
  land beside the weights; on a CPU nothing changes. The target is only read (forward passes in
  inference mode; no mode, flag or device change), so a target a worker keeps loaded between jobs
  may be replayed. Every KV cache is sized to the longest request, not to the model's context.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Concatenate, ParamSpec, TypeVar

import torch

from controlplane.speculation_math import (
    hit_rate,
    leviathan_speedup,
    mean_accepted_length,
    ms_per_token,
    speedup,
)
from workers.devices import autocast_for
from workers.engine.decoder import GenerationResult, SpeculativeDecoder
from workers.engine.metrics import RequestMetrics
from workers.engine.model import Transformer
from workers.engine.never_missing import (
    Continuations,
    NeverMissingDraftProposer,
    NeverMissingHeadProposer,
    never_missing_twin,
)
from workers.engine.proposers import DraftModelProposer, Proposer
from workers.engine.tokenizer import Tokenizer

ArmSpec = Transformer | Proposer | None
# (arm name, proposer or None, k) -> the decoder that arm runs; tests swap it to tamper with an arm.
DecoderFactory = Callable[[str, Proposer | None, int], SpeculativeDecoder]
ProgressFn = Callable[[float, str], bool]
ARM_ORDER = ("baseline", "incumbent", "candidate")
BASELINE = "baseline"
NEVER_MISSING = "never_missing"
P = ParamSpec("P")
R = TypeVar("R")


class ReplayCancelledError(RuntimeError):
    """The progress callback asked the replay to stop."""


@dataclass
class ArmReport:
    name: str
    speculative: bool
    prompts: int
    generated_tokens: int
    drafted_tokens: int
    accepted_tokens: int
    verify_steps: int
    accepted_per_position: list[int]
    drafted_per_position: list[int]
    hit_rate: float | None  # accepted / drafted; None without speculation
    per_position_acceptance: list[float]  # accepted_i / drafted_i (Fireworks speculation-acceptance)
    conditional_acceptance: list[float]  # P(position i accepted | positions < i accepted)
    mean_accepted_length: float  # tokens per verify step: 1 + accepted / steps
    tokens_per_s: float  # output tokens / request time, summed over prompts (TTFT included)
    decode_tokens_per_s: float  # tokens after the first / time after the first token
    ttft_ms_p50: float | None
    inter_token_ms_p50: float | None
    inter_token_ms_p95: float | None
    ms_per_token_p50: float | None
    propose_ms_per_step: float
    score_ms_per_step: float
    overhead_ms_per_step: float  # the engine's own bookkeeping per verify step
    broken: str | None = None  # why the arm's output is not lossless; None when it is
    mismatched_prompts: list[int] = field(default_factory=list)
    ties: list[int] = field(default_factory=list)  # prompts that diverged on a float-rounding tie

    def to_dict(self) -> dict[str, Any]:
        return {k: _round(v) for k, v in asdict(self).items()}


@dataclass
class CostProfile:
    """What the draft-length tuner needs: ``cost_ratio`` (c) and ``verify_cost`` by k."""

    cost_ratio: float | None
    verify_cost: dict[int, float]  # k -> time of a (k+1)-token target forward / a 1-token one
    target_step_ms: float
    drafter_step_ms: dict[str, float]
    cost_ratio_by_arm: dict[str, float]
    context_tokens: int
    repeats: int
    # Measured during the replay itself (target and drafter evicting each other's weights from the
    # CPU caches, Python bookkeeping included): per arm, drafter ms per drafted token over the
    # baseline's ms per target step, and the arm's verify step over the baseline's.
    in_situ: dict[str, dict[str, float]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out = {k: _round(v) for k, v in asdict(self).items()}
        out["verify_cost"] = {str(k): _round(v) for k, v in self.verify_cost.items()}
        return out


@dataclass
class CeilingReport:
    """The never-missing arm beside the arm it mirrors (``of``), all over no speculation."""

    of: str
    never_missing_speedup: float  # decode tokens/s of the never-missing arm / the baseline's
    share_of_ceiling: float  # the mirrored arm's decode speed-up / the never-missing arm's
    # Every speculating arm's decode speed-up over no speculation (the never-missing arm's included).
    speedup_over_baseline: dict[str, float]
    speedup_with_prefill: dict[str, float]  # the same with the prefill counted (tokens_per_s ratios)
    share_of_ceiling_with_prefill: float
    # Median over prompts of the never-missing arm's decode ms per token / the mirrored arm's.
    share_of_ceiling_paired_median: float | None
    # The share, taken apart: decode time is rounds x time per round, so the share is (about) the
    # mirrored arm's tokens per round over the never-missing arm's, times the never-missing arm's
    # time per round over the mirrored arm's (propose + score + the engine's own work, per round).
    tokens_per_round_ratio: float
    round_time_ratio: float
    never_missing_hit_rate: float | None  # 1.0 unless the output left the known continuation
    never_missing_off_continuation: int  # drafts it had to make itself (continuation ended or unknown)
    # Cross-checks: Leviathan et al. at acceptance 1, (k + 1) / (verify_cost[k] + k c), from the
    # isolated step costs, and from the costs measured during the replay (None where not measured).
    analytic_ceiling_speedup: float | None = None
    analytic_share_of_ceiling: float | None = None
    analytic_ceiling_speedup_in_situ: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: _round(v) for k, v in asdict(self).items()}


@dataclass
class ReplayResult:
    k: int
    max_new_tokens: int
    prompts: int
    repeats: int
    reference: str
    arms: dict[str, ArmReport]
    # arm -> figure -> one value per prompt, in prompt order (paired across arms by index).
    per_prompt: dict[str, dict[str, list[float | None]]]
    order: list[list[str]]  # the arm order used for each prompt
    costs: CostProfile | None
    outputs: dict[str, list[list[int]]] = field(default_factory=dict, repr=False)
    ceiling: CeilingReport | None = None

    @property
    def broken_arms(self) -> list[str]:
        return [name for name, arm in self.arms.items() if arm.broken]

    def speedup(self, arm: str, over: str) -> float:
        """Aggregate tokens/s of ``arm`` over ``over`` (same prompts, same output tokens)."""
        return _times_faster(self.arms[over].tokens_per_s, self.arms[arm].tokens_per_s)

    def paired_speedup(self, arm: str, over: str) -> float:
        """Median over prompts of over's latency per token / arm's: robust to drift between prompts."""
        pairs = zip(self.per_prompt[over]["ms_per_token"], self.per_prompt[arm]["ms_per_token"], strict=True)
        ratios = [r for a, b in pairs if (r := speedup(a, b)) is not None]
        return statistics.median(ratios) if ratios else float("nan")

    def to_dict(self) -> dict[str, Any]:
        return {
            "k": self.k,
            "max_new_tokens": self.max_new_tokens,
            "prompts": self.prompts,
            "repeats": self.repeats,
            "reference": self.reference,
            "broken_arms": self.broken_arms,
            "arms": {name: arm.to_dict() for name, arm in self.arms.items()},
            "per_prompt": {
                name: {fig: [_round(v) for v in values] for fig, values in figures.items()}
                for name, figures in self.per_prompt.items()
            },
            "order": self.order,
            "costs": self.costs.to_dict() if self.costs is not None else None,
            "ceiling": self.ceiling.to_dict() if self.ceiling is not None else None,
        }


def _round(v: Any) -> Any:
    if isinstance(v, float):
        return round(v, 5)
    if isinstance(v, list):
        return [_round(x) for x in v]
    if isinstance(v, dict):
        return {k: _round(x) for k, x in v.items()}
    return v


def _quantile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated quantile (numpy's default), None for no values."""
    xs = sorted(values)
    if not xs:
        return None
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


# ------------------------------------------------------------------------------------------ device


@contextlib.contextmanager
def _forward_passes_on(device: torch.device) -> Iterator[None]:
    """On a GPU: bf16 autocast, and the GPU as torch's default device, because the engine's decoder
    and proposers build their token tensors without naming a device. On a CPU: nothing."""
    if device.type == "cpu":
        yield
        return
    with autocast_for(device), device:
        yield


def _on_the_targets_device(
    fn: Callable[Concatenate[Transformer, P], R],
) -> Callable[Concatenate[Transformer, P], R]:
    @functools.wraps(fn)
    def run(target: Transformer, /, *args: P.args, **kwargs: P.kwargs) -> R:
        with _forward_passes_on(target.device):
            return fn(target, *args, **kwargs)

    return run


def _wait_for(device: torch.device) -> None:
    """Let queued GPU work finish, so that a clock read after it times the work, not its launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------------- reference


@_on_the_targets_device
@torch.inference_mode()
def greedy_tokens(
    target: Transformer, prompt: Sequence[int], max_new_tokens: int, eos_id: int | None
) -> list[int]:
    """Plain greedy decoding in a minimal KV-cache loop (no scorer, verifier or proposer code)."""
    device = target.device
    cache = target.new_cache(1, len(prompt) + max_new_tokens)
    tokens = torch.tensor([list(prompt)], device=device)
    logits = target.forward_cached(tokens, cache, last_only=True)[0, -1]  # [V]
    out: list[int] = []
    for i in range(max_new_tokens):
        tok = int(logits.argmax())
        if tok == eos_id:
            break
        out.append(tok)
        if i + 1 < max_new_tokens:
            logits = target.forward_cached(torch.tensor([[tok]], device=device), cache)[0, -1]  # [V]
    return out


@torch.inference_mode()
def _is_tie(
    target: Transformer,
    prompt: Sequence[int],
    reference: Sequence[int],
    j: int,
    got: int | None,
    eos_id: int | None,
    tol: float,
) -> bool:
    """Whether the reference token and the arm's at output index j are both argmax to rounding."""
    want = reference[j] if j < len(reference) else eos_id
    if want is None or got is None:
        return False
    tokens = torch.tensor([list(prompt) + list(reference[:j])], device=target.device)
    logits = target(tokens)[0, -1].float()  # [V]
    top = float(logits.max())
    return top - min(float(logits[want]), float(logits[got])) <= tol * (1.0 + abs(top))


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    for j, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return j
    return None if len(a) == len(b) else min(len(a), len(b))


# -------------------------------------------------------------------------------------------- costs


@_on_the_targets_device
@torch.inference_mode()
def measure_costs(
    target: Transformer,
    drafters: Mapping[str, Transformer],
    context: Sequence[int],
    max_k: int = 8,
    repeats: int = 15,
) -> CostProfile:
    """Median step times at the context's length: the target over 1..max_k+1 tokens, each drafter
    over 1 token; timings interleaved round by round so load changes hit every figure alike."""
    ctx = list(context) or [0]
    length = len(ctx)
    probe = (ctx * (max_k + 2))[: max_k + 1]  # real token ids to feed after the context

    def prefilled(model: Transformer) -> Any:
        cache = model.new_cache(1, length + max_k + 1)
        model.forward_cached(torch.tensor([ctx], device=model.device), cache)
        return cache

    caches = {"target": prefilled(target), **{name: prefilled(m) for name, m in drafters.items()}}
    models: dict[str, Transformer] = {"target": target, **drafters}
    times: dict[tuple[str, int], list[float]] = {}
    jobs = [("target", t) for t in range(1, max_k + 2)] + [(name, 1) for name in drafters]
    clock = time.perf_counter
    for rep in range(repeats + 1):  # the first round warms up and is not kept
        for name, t in jobs:
            cache, model = caches[name], models[name]
            cache.rollback(length)
            tokens = torch.tensor([probe[:t]], device=model.device)
            _wait_for(model.device)
            t0 = clock()
            model.forward_cached(tokens, cache)
            _wait_for(model.device)
            dt = clock() - t0
            if rep:
                times.setdefault((name, t), []).append(dt * 1000.0)
    med = {key: statistics.median(v) for key, v in times.items()}
    one = med[("target", 1)]
    drafter_ms = {name: med[(name, 1)] for name in drafters}
    by_arm = {name: ms / one for name, ms in drafter_ms.items()}
    headline = by_arm.get("candidate", next(iter(by_arm.values()), None))
    return CostProfile(
        cost_ratio=headline,
        verify_cost={t - 1: med[("target", t)] / one for t in range(2, max_k + 2)},
        target_step_ms=one,
        drafter_step_ms=drafter_ms,
        cost_ratio_by_arm=by_arm,
        context_tokens=length,
        repeats=repeats,
    )


# ------------------------------------------------------------------------------------------- replay


def _default_decoder(target: Transformer, tokenizer: Tokenizer, max_len: int) -> DecoderFactory:
    # The KV cache is sized to the longest request, not the model's context: at Llama-3.1-8B's
    # 131,072 positions one decoder's cache would be 17 GB, and every arm has its own.
    length = min(max_len, target.config.max_seq_len)

    def make(name: str, proposer: Proposer | None, k: int) -> SpeculativeDecoder:
        return SpeculativeDecoder(target, tokenizer, proposer, k=k, max_len=length)

    return make


def _proposer(name: str, spec: ArmSpec, max_len: int) -> Proposer | None:
    if spec is None:
        return None
    if isinstance(spec, Transformer):
        return DraftModelProposer(spec.eval(), min(max_len, spec.config.max_seq_len), name=name)
    if isinstance(spec, Proposer):
        return spec
    raise TypeError(f"arm {name!r}: expected a Transformer, a Proposer or None, got {type(spec).__name__}")


def _arm_order(names: Sequence[str], i: int) -> list[str]:
    s = i % len(names)
    return list(names[s:]) + list(names[:s])


def _arm_rank(name: str) -> tuple[int, str]:
    return (ARM_ORDER.index(name) if name in ARM_ORDER else len(ARM_ORDER), name)


@_on_the_targets_device
def shadow_replay(
    target: Transformer,
    tokenizer: Tokenizer,
    arms: Mapping[str, ArmSpec],
    prompts: Sequence[Sequence[int]],
    k: int,
    max_new_tokens: int | Sequence[int],
    *,
    repeats: int = 1,
    warmup: bool = True,
    stop_at_eos: bool = True,
    temperature: float = 0.0,
    seed: int = 0,
    reference: str = "independent",
    tie_tol: float | None = None,
    measure_cost: bool = True,
    cost_max_k: int = 8,
    cost_repeats: int = 15,
    decoder_factory: DecoderFactory | None = None,
    progress: ProgressFn | None = None,
    ceiling_of: str | None = None,
) -> ReplayResult:
    """Replay ``prompts`` (token ids) through every arm, interleaved per prompt; see the module doc.

    ``max_new_tokens``: one length for every prompt, or one per prompt (the length each request
    was served at, so that one ended by a client's stop string is not replayed past its end).
    ``repeats`` runs each (prompt, arm) that many times and keeps the median timings (the tokens are
    the same every time). ``reference``: "independent" (a separate plain greedy loop, the default),
    "baseline" (the no-speculation arm's own output) or "none" (no lossless check). The lossless
    check applies to greedy decoding only (``temperature == 0``). ``tie_tol``: the relative logit
    gap under which a divergence is a rounding tie (default 1e-4 for a float32 target on a CPU,
    2e-2 otherwise: on a GPU the products run in bf16 under autocast).
    ``ceiling_of``: the arm (a drafter or a head) whose never-missing twin runs beside the others
    as arm ``never_missing``, for the measured ceiling (``ReplayResult.ceiling``; greedy only, and
    it needs the no-speculation arm ``baseline``).
    Raises ReplayCancelledError when ``progress`` returns False.
    """
    if not arms:
        raise ValueError("no arms to replay")
    if not prompts or any(not p for p in prompts):
        raise ValueError("every prompt needs at least one token")
    lengths = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if len(lengths) != len(prompts) or any(n < 1 for n in lengths):
        raise ValueError("max_new_tokens needs one length >= 1 for every prompt")
    if reference not in ("independent", "baseline", "none"):
        raise ValueError(f"reference must be 'independent', 'baseline' or 'none', got {reference!r}")
    # An arm without speculation beside the baseline (the incumbent of a deployment that has no
    # drafter yet) would run the very same decoding again: it is measured once, as the baseline,
    # and reported under both names.
    same_as_baseline = (
        [n for n, spec in arms.items() if n != BASELINE and spec is None]
        if BASELINE in arms and arms[BASELINE] is None
        else []
    )
    greedy = temperature == 0.0
    eos = tokenizer.eos_id if stop_at_eos else None
    # The longest request plus a round of drafts: all any KV cache of this replay needs.
    max_len = max(len(p) + n for p, n in zip(prompts, lengths, strict=True)) + k + 1
    continuations: Continuations | None = None
    twin: NeverMissingDraftProposer | NeverMissingHeadProposer | None = None
    if ceiling_of is not None:
        mirrored = _check_ceiling_arm(arms, ceiling_of, greedy)
        continuations = Continuations()
        twin = never_missing_twin(mirrored, continuations, max_len)
        arms = {**arms, NEVER_MISSING: twin}
    requested = arms
    arms = {n: spec for n, spec in arms.items() if n not in same_as_baseline}
    names = sorted(arms, key=_arm_rank)
    if reference == "baseline" and not any(arms[n] is None for n in names):
        raise ValueError("reference='baseline' needs an arm without speculation (None)")
    check = greedy and reference != "none"
    exact = target.dtype == torch.float32 and target.device.type == "cpu"
    tol = tie_tol if tie_tol is not None else (1e-4 if exact else 2e-2)
    make = decoder_factory or _default_decoder(target, tokenizer, max_len)
    decoders = {name: make(name, _proposer(name, arms[name], max_len), k) for name in names}
    report = progress or (lambda _f, _m: True)

    drafters = {n: s for n, s in arms.items() if isinstance(s, Transformer)}
    costs = None
    if measure_cost:
        ctx_len = int(statistics.median(len(p) for p in prompts))
        context = next((p for p in prompts if len(p) >= ctx_len), prompts[0])[-ctx_len:]
        costs = measure_costs(target, drafters, context, max_k=cost_max_k, repeats=cost_repeats)

    def run(name: str, prompt: Sequence[int], i: int, n_new: int) -> GenerationResult:
        gen = torch.Generator(target.device).manual_seed(seed * 1_000_003 + i) if not greedy else None
        return decoders[name].generate(
            list(prompt), n_new, temperature=temperature, generator=gen, stop_at_eos=stop_at_eos
        )

    known: list[list[int]] | None = None
    if continuations is not None:
        # Each prompt's continuation, known before any timed request (the arms' order rotates, so
        # the baseline does not always run first); it is the independent reference too.
        known = [greedy_tokens(target, p, n, eos) for p, n in zip(prompts, lengths, strict=True)]
        for prompt, ref, n in zip(prompts, known, lengths, strict=True):
            # A continuation that stopped early stopped at end-of-text: the target writes that next.
            continuations.add(prompt, ref + [eos] if eos is not None and len(ref) < n else ref)

    if warmup:
        for name in names:
            run(name, prompts[0], -1, min(8, lengths[0]))

    results: dict[str, list[list[GenerationResult]]] = {n: [] for n in names}
    order: list[list[str]] = []
    for i, prompt in enumerate(prompts):
        arm_order = _arm_order(names, i)
        order.append(arm_order)
        per_arm: dict[str, list[GenerationResult]] = {n: [] for n in names}
        for r in range(repeats):
            for name in _arm_order(arm_order, r):
                per_arm[name].append(run(name, prompt, i, lengths[i]))
        for name in names:
            results[name].append(per_arm[name])
        if not report((i + 1) / len(prompts), f"replayed prompt {i + 1}/{len(prompts)}"):
            raise ReplayCancelledError(f"stopped after {i + 1} of {len(prompts)} prompts")

    outputs = {name: [runs[0].token_ids for runs in results[name]] for name in names}
    refs: list[list[int]] | None = None
    if check and reference == "independent":
        refs = known or [greedy_tokens(target, p, n, eos) for p, n in zip(prompts, lengths, strict=True)]
    elif check:
        refs = outputs[next(n for n in names if arms[n] is None)]

    reports: dict[str, ArmReport] = {}
    per_prompt: dict[str, dict[str, list[float | None]]] = {}
    for name in names:
        mismatched: list[int] = []
        ties: list[int] = []
        first_problem: str | None = None
        for i, runs in enumerate(results[name]):
            if refs is None:
                break
            variants = {tuple(r.token_ids) for r in runs}
            for out in variants:
                j = _first_difference(refs[i], out)
                if j is None:
                    continue
                got = out[j] if j < len(out) else eos
                if _is_tie(target, prompts[i], refs[i], j, got, eos, tol):
                    ties.append(i)
                    continue
                mismatched.append(i)
                if first_problem is None:
                    want = refs[i][j] if j < len(refs[i]) else "end"
                    first_problem = (
                        f"prompt {i}: output differs from plain greedy decoding at token {j} "
                        f"(expected {want}, got {got if got is not None else 'end'})"
                    )
        if greedy and any(len({tuple(r.token_ids) for r in runs}) > 1 for runs in results[name]):
            first_problem = first_problem or "repeats of one prompt gave different greedy outputs"
        if mismatched:
            first_problem = f"{len(set(mismatched))} of {len(prompts)} prompts differ; first: {first_problem}"
        reports[name], per_prompt[name] = _summarise(name, arms[name] is not None, results[name], k)
        reports[name].broken = first_problem
        reports[name].mismatched_prompts = sorted(set(mismatched))
        reports[name].ties = sorted(set(ties))

    if costs is not None:
        _in_situ(costs, reports, arms)
    for name in same_as_baseline:
        reports[name] = dataclasses.replace(reports[BASELINE], name=name)
        per_prompt[name] = {figure: list(values) for figure, values in per_prompt[BASELINE].items()}
        outputs[name] = outputs[BASELINE]
    reports = {n: reports[n] for n in sorted(requested, key=_arm_rank)}
    ceiling = None
    if ceiling_of is not None and twin is not None:
        ceiling = _ceiling_report(ceiling_of, reports, per_prompt, costs, k, twin.off_continuation)
    return ReplayResult(
        k=k,
        max_new_tokens=max(lengths),
        prompts=len(prompts),
        repeats=repeats,
        reference=reference if check else "none",
        arms=reports,
        per_prompt=per_prompt,
        order=order,
        costs=costs,
        outputs=outputs,
        ceiling=ceiling,
    )


def _check_ceiling_arm(arms: Mapping[str, ArmSpec], of: str, greedy: bool) -> Transformer | Proposer:
    """The arm the never-missing arm mirrors, once the replay can measure a ceiling for it."""
    if not greedy:
        raise ValueError("the never-missing arm drafts the greedy continuation: it needs temperature 0")
    if arms.get(of) is None:
        raise ValueError(f"ceiling_of={of!r} names no speculating arm")
    if BASELINE not in arms or arms[BASELINE] is not None:
        raise ValueError(
            f"the measured ceiling is a speed-up over no speculation: it needs arm {BASELINE!r} = None"
        )
    if NEVER_MISSING in arms:
        raise ValueError(f"arm name {NEVER_MISSING!r} is the never-missing arm's")
    mirrored = arms[of]
    assert mirrored is not None
    return mirrored


def analytic_ceiling(k: int, cost_ratio: float, verify_cost: float) -> float:
    """Leviathan et al.'s speed-up at acceptance 1: k + 1 tokens per round for one verify pass of
    k + 1 tokens (``verify_cost`` one-token steps) and k drafter steps (``cost_ratio`` each)."""
    return leviathan_speedup(1.0, k, cost_ratio, verify_cost)


def _times_faster(baseline_tokens_per_s: float, tokens_per_s: float) -> float:
    """How many times faster a rate is than the baseline's; NaN where either arm timed nothing."""
    value = speedup(baseline_tokens_per_s, tokens_per_s, higher_is_faster=True)
    return value if value is not None else float("nan")


def _decode_ms_per_token(figures: Mapping[str, list[float | None]], i: int) -> float | None:
    """One prompt's time after the first token per token after it (None with fewer than 2 tokens)."""
    per_token, ttft, tokens = (figures[f][i] for f in ("ms_per_token", "ttft_ms", "generated_tokens"))
    if per_token is None or ttft is None or tokens is None:
        return None
    return ms_per_token(None, per_token * tokens, ttft, int(tokens))


def _ceiling_report(
    of: str,
    reports: Mapping[str, ArmReport],
    per_prompt: Mapping[str, Mapping[str, list[float | None]]],
    costs: CostProfile | None,
    k: int,
    off_continuation: int,
) -> CeilingReport:
    base = reports[BASELINE]
    speculating = [n for n, r in reports.items() if r.speculative]
    decode = {n: _times_faster(base.decode_tokens_per_s, reports[n].decode_tokens_per_s) for n in speculating}
    with_prefill = {n: _times_faster(base.tokens_per_s, reports[n].tokens_per_s) for n in speculating}
    ceiling = decode[NEVER_MISSING]
    paired = [
        nm / arm
        for i in range(len(per_prompt[of]["ms_per_token"]))
        if (nm := _decode_ms_per_token(per_prompt[NEVER_MISSING], i)) is not None
        and (arm := _decode_ms_per_token(per_prompt[of], i))
    ]

    def round_ms(arm: ArmReport) -> float:
        return arm.propose_ms_per_step + arm.score_ms_per_step + arm.overhead_ms_per_step

    mirrored, never_missing = reports[of], reports[NEVER_MISSING]
    analytic = in_situ = None
    if costs is not None and of in costs.cost_ratio_by_arm and k in costs.verify_cost:
        analytic = analytic_ceiling(k, costs.cost_ratio_by_arm[of], costs.verify_cost[k])
    if costs is not None and of in costs.in_situ:
        measured = costs.in_situ[of]
        in_situ = analytic_ceiling(k, measured["cost_ratio"], measured["verify_cost_at_k"])
    return CeilingReport(
        of=of,
        never_missing_speedup=ceiling,
        share_of_ceiling=decode[of] / ceiling,
        speedup_over_baseline=decode,
        speedup_with_prefill=with_prefill,
        share_of_ceiling_with_prefill=with_prefill[of] / with_prefill[NEVER_MISSING],
        share_of_ceiling_paired_median=statistics.median(paired) if paired else None,
        tokens_per_round_ratio=mirrored.mean_accepted_length / never_missing.mean_accepted_length,
        round_time_ratio=round_ms(never_missing) / round_ms(mirrored) if round_ms(mirrored) else float("nan"),
        never_missing_hit_rate=never_missing.hit_rate,
        never_missing_off_continuation=off_continuation,
        analytic_ceiling_speedup=analytic,
        analytic_share_of_ceiling=decode[of] / analytic if analytic else None,
        analytic_ceiling_speedup_in_situ=in_situ,
    )


def _median_of(runs: Sequence[GenerationResult], attr: str) -> float | None:
    values = [getattr(r.metrics, attr) for r in runs]
    kept = [float(v) for v in values if v is not None]
    return statistics.median(kept) if kept else None


def _summarise(
    name: str, speculative: bool, results: Sequence[Sequence[GenerationResult]], k: int
) -> tuple[ArmReport, dict[str, list[float | None]]]:
    width = k if speculative else 0
    acc_pos = [0] * width
    drf_pos = [0] * width
    drafted = accepted = steps = generated = 0
    propose_ms = score_ms = overhead_ms = 0.0
    total_ms = decode_ms = 0.0
    decode_tokens = 0
    figures: dict[str, list[float | None]] = {
        "tokens_per_step": [],
        "ms_per_token": [],
        "ttft_ms": [],
        "inter_token_ms": [],
        "tokens_per_s": [],
        "generated_tokens": [],
        "hit_rate": [],
    }
    for runs in results:
        m: RequestMetrics = runs[0].metrics  # counts are the same in every repeat
        drafted += m.drafted_tokens
        accepted += m.accepted_tokens
        steps += m.verify_steps
        generated += m.generated_tokens
        for i in range(min(width, len(m.accepted_per_position))):
            acc_pos[i] += m.accepted_per_position[i]
            drf_pos[i] += m.drafted_per_position[i]
        total = _median_of(runs, "total_ms") or 0.0
        ttft = _median_of(runs, "ttft_ms")
        itl = _median_of(runs, "inter_token_ms")
        propose_ms += _median_of(runs, "propose_ms") or 0.0
        score_ms += _median_of(runs, "score_ms") or 0.0
        overhead_ms += statistics.median(r.metrics.overhead_ms or 0.0 for r in runs)
        total_ms += total
        if ttft is not None and m.generated_tokens > 1:
            decode_ms += total - ttft
            decode_tokens += m.generated_tokens - 1
        tps = m.mean_accepted_length if m.verify_steps else 1.0
        figures["tokens_per_step"].append(tps)
        # Wall time per token, TTFT included: a drafter that slowed the prefill must not look faster.
        figures["ms_per_token"].append(ms_per_token(None, total, ttft, m.generated_tokens, include_ttft=True))
        figures["ttft_ms"].append(ttft)
        figures["inter_token_ms"].append(itl)
        figures["tokens_per_s"].append(1000.0 * m.generated_tokens / total if total else None)
        figures["generated_tokens"].append(float(m.generated_tokens))
        figures["hit_rate"].append(m.hit_rate)
    conditional = []
    trials = steps
    for a in acc_pos:
        conditional.append(a / trials if trials else 0.0)
        trials = a
    itls = [v for v in figures["inter_token_ms"] if v is not None]
    ttfts = [v for v in figures["ttft_ms"] if v is not None]
    per_tok = [v for v in figures["ms_per_token"] if v is not None]
    report = ArmReport(
        name=name,
        speculative=speculative,
        prompts=len(results),
        generated_tokens=generated,
        drafted_tokens=drafted,
        accepted_tokens=accepted,
        verify_steps=steps,
        accepted_per_position=acc_pos,
        drafted_per_position=drf_pos,
        hit_rate=hit_rate(accepted, drafted),
        per_position_acceptance=[a / d if d else 0.0 for a, d in zip(acc_pos, drf_pos, strict=True)],
        conditional_acceptance=conditional,
        mean_accepted_length=mean_accepted_length(accepted, steps) or 1.0,
        tokens_per_s=1000.0 * generated / total_ms if total_ms else 0.0,
        decode_tokens_per_s=1000.0 * decode_tokens / decode_ms if decode_ms else 0.0,
        ttft_ms_p50=_quantile(ttfts, 0.5),
        inter_token_ms_p50=_quantile(itls, 0.5),
        inter_token_ms_p95=_quantile(itls, 0.95),
        ms_per_token_p50=_quantile(per_tok, 0.5),
        propose_ms_per_step=propose_ms / steps if steps else 0.0,
        score_ms_per_step=score_ms / steps if steps else 0.0,
        overhead_ms_per_step=overhead_ms / steps if steps else 0.0,
    )
    return report, figures


def _in_situ(costs: CostProfile, reports: Mapping[str, ArmReport], arms: Mapping[str, ArmSpec]) -> None:
    base = next((reports[n] for n in reports if arms[n] is None), None)
    if base is None or base.score_ms_per_step <= 0:
        return
    step = base.score_ms_per_step
    for name, rep in reports.items():
        if arms[name] is None or not rep.drafted_tokens:
            continue
        propose_per_token = rep.propose_ms_per_step * rep.verify_steps / rep.drafted_tokens
        costs.in_situ[name] = {
            "cost_ratio": propose_per_token / step,
            "verify_cost_at_k": rep.score_ms_per_step / step,
            "target_step_ms": step,
        }
