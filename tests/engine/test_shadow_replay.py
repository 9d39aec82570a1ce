"""Shadow replay: paired per-prompt figures for every arm, rotated arm order, step costs, and the
lossless check that catches a broken verifier or a tampered arm (and names the prompt)."""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

import workers.engine.decoder as decoder_module
from controlplane.canary.evaluate import shadow_ceiling_fields
from workers.canary.replay import (
    NEVER_MISSING,
    ReplayCancelledError,
    analytic_ceiling,
    greedy_tokens,
    shadow_replay,
)
from workers.engine.decoder import GenerationResult, SpeculativeDecoder
from workers.engine.model import Transformer
from workers.engine.proposers import DraftModelProposer, NgramProposer, Proposer
from workers.engine.tokenizer import Tokenizer

PromptFactory = Callable[..., list[list[int]]]
CopyFactory = Callable[[Transformer, float, int], Transformer]
K = 4
N_NEW = 16
QUICK: dict[str, Any] = {"cost_max_k": 4, "cost_repeats": 3}
SLOW_S = 0.1  # a slowed candidate's sleep per proposal


@pytest.fixture(scope="module")
def prompts(make_prompts: PromptFactory) -> list[list[int]]:
    return make_prompts(6, seed=3)


@pytest.fixture(scope="module")
def arms(target: Transformer, drafter: Transformer, noisy_copy: CopyFactory) -> dict[str, Any]:
    return {"baseline": None, "incumbent": noisy_copy(target, 0.3, 5), "candidate": drafter}


def test_three_arms_are_lossless_paired_and_measured(
    target: Transformer, tokenizer: Tokenizer, arms: dict[str, Any], prompts: list[list[int]]
) -> None:
    r = shadow_replay(target, tokenizer, arms, prompts, K, N_NEW, **QUICK)
    assert r.broken_arms == []
    assert list(r.arms) == ["baseline", "incumbent", "candidate"]
    for name in r.arms:
        assert r.outputs[name] == r.outputs["baseline"]  # greedy speculation changes no token
    base, inc, cand = r.arms["baseline"], r.arms["incumbent"], r.arms["candidate"]
    assert base.hit_rate is None and base.mean_accepted_length == 1.0 and base.drafted_tokens == 0
    assert cand.hit_rate is not None and inc.hit_rate is not None
    assert cand.hit_rate > inc.hit_rate  # the closer copy of the target drafts better
    assert cand.mean_accepted_length == pytest.approx(1 + cand.accepted_tokens / cand.verify_steps)
    assert sum(cand.accepted_per_position) == cand.accepted_tokens
    assert all(
        a >= b for a, b in zip(cand.accepted_per_position, cand.accepted_per_position[1:], strict=False)
    )
    assert cand.conditional_acceptance[0] == pytest.approx(cand.accepted_per_position[0] / cand.verify_steps)
    for arm in r.arms.values():
        assert arm.tokens_per_s > 0 and arm.ttft_ms_p50 is not None and arm.inter_token_ms_p50 is not None
        assert arm.inter_token_ms_p95 is not None and arm.inter_token_ms_p95 >= arm.inter_token_ms_p50
    # Paired per-prompt figures, in prompt order, for the canary statistics.
    for figs in r.per_prompt.values():
        assert len(figs["tokens_per_step"]) == len(prompts) and len(figs["ms_per_token"]) == len(prompts)
        assert all(v is not None and v > 0 for v in figs["ms_per_token"])
    assert r.per_prompt["baseline"]["tokens_per_step"] == [1.0] * len(prompts)
    # Every arm runs first equally often (6 prompts, 3 arms).
    assert sorted(o[0] for o in r.order) == sorted(["baseline", "incumbent", "candidate"] * 2)
    costs = r.costs
    assert costs is not None and costs.cost_ratio is not None and costs.cost_ratio > 0
    assert sorted(costs.verify_cost) == [1, 2, 3, 4] and all(v > 0 for v in costs.verify_cost.values())
    assert set(costs.in_situ) == {"incumbent", "candidate"}
    d = json.loads(json.dumps(r.to_dict()))
    assert d["arms"]["candidate"]["broken"] is None and d["costs"]["verify_cost"]["4"] > 0
    assert r.speedup("candidate", "baseline") > 0 and r.paired_speedup("candidate", "baseline") > 0


def test_independent_reference_matches_plain_greedy(
    target: Transformer, tokenizer: Tokenizer, prompts: list[list[int]]
) -> None:
    for p in prompts[:3]:
        want = SpeculativeDecoder(target, tokenizer, None).generate(p, N_NEW).token_ids
        assert greedy_tokens(target, p, N_NEW, tokenizer.eos_id) == want


def test_a_broken_verifier_marks_the_speculative_arms_broken(
    target: Transformer,
    tokenizer: Tokenizer,
    arms: dict[str, Any],
    prompts: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def accept_everything(target_logits: torch.Tensor, drafts: torch.Tensor) -> tuple[int, list[int]]:
        best = target_logits.argmax(dim=-1)  # [k'+1]
        k = drafts.numel()
        return k, drafts.tolist() + [int(best[k])]

    monkeypatch.setattr(decoder_module, "verify_greedy", accept_everything)
    r = shadow_replay(target, tokenizer, arms, prompts, K, N_NEW, measure_cost=False)
    assert r.arms["baseline"].broken is None  # nothing drafted, nothing wrongly accepted
    assert set(r.broken_arms) == {"incumbent", "candidate"}
    assert r.arms["incumbent"].mismatched_prompts  # which prompts went wrong is recorded
    assert "prompt" in (r.arms["candidate"].broken or "")
    assert r.to_dict()["broken_arms"] == ["incumbent", "candidate"]


class _Tampered(SpeculativeDecoder):
    """Swaps one output token of one prompt: the kind of corruption no hit rate would show."""

    calls = 0

    def generate(self, prompt: Any, max_new_tokens: int, **kw: Any) -> GenerationResult:
        out = super().generate(prompt, max_new_tokens, **kw)
        _Tampered.calls += 1
        if _Tampered.calls == 1 + 3:  # warm-up request, then prompts 0, 1, 2
            out.token_ids[len(out.token_ids) // 2] = (out.token_ids[len(out.token_ids) // 2] + 1) % 300
        return out


def test_a_tampered_arm_is_caught_and_the_prompt_named(
    target: Transformer, tokenizer: Tokenizer, arms: dict[str, Any], prompts: list[list[int]]
) -> None:
    def factory(name: str, proposer: Proposer | None, k: int) -> SpeculativeDecoder:
        cls = _Tampered if name == "candidate" else SpeculativeDecoder
        return cls(target, tokenizer, proposer, k=k)

    _Tampered.calls = 0
    r = shadow_replay(target, tokenizer, arms, prompts, K, N_NEW, measure_cost=False, decoder_factory=factory)
    assert r.broken_arms == ["candidate"]
    assert r.arms["candidate"].mismatched_prompts == [2]
    assert (r.arms["candidate"].broken or "").count("prompt 2") == 1


def test_baseline_reference_proposer_arm_and_cancel(
    target: Transformer, tokenizer: Tokenizer, drafter: Transformer, prompts: list[list[int]]
) -> None:
    arms: dict[str, Any] = {"baseline": None, "ngram": NgramProposer(2), "candidate": drafter}
    r = shadow_replay(
        target, tokenizer, arms, prompts[:3], K, N_NEW, reference="baseline", repeats=2, measure_cost=False
    )
    assert r.broken_arms == [] and r.reference == "baseline" and r.repeats == 2
    assert list(r.arms) == ["baseline", "candidate", "ngram"]

    seen: list[float] = []

    def stop_after_two(fraction: float, message: str) -> bool:
        seen.append(fraction)
        return len(seen) < 2

    with pytest.raises(ReplayCancelledError):
        shadow_replay(target, tokenizer, arms, prompts, K, N_NEW, measure_cost=False, progress=stop_after_two)
    with pytest.raises(ValueError):
        shadow_replay(target, tokenizer, {"candidate": drafter}, prompts, K, N_NEW, reference="baseline")


def test_each_prompt_replays_at_its_own_served_length(
    target: Transformer, tokenizer: Tokenizer, arms: dict[str, Any], prompts: list[list[int]]
) -> None:
    lengths = [3 + 2 * i for i in range(len(prompts))]
    r = shadow_replay(target, tokenizer, arms, prompts, K, lengths, measure_cost=False, stop_at_eos=False)
    assert r.broken_arms == []  # the lossless check compares against references of the same lengths
    assert [len(out) for out in r.outputs["candidate"]] == lengths
    assert r.outputs["candidate"] == r.outputs["baseline"] and r.max_new_tokens == max(lengths)
    with pytest.raises(ValueError, match="one length"):
        shadow_replay(target, tokenizer, arms, prompts, K, lengths[:-1], measure_cost=False)
    with pytest.raises(ValueError, match="one length"):
        shadow_replay(target, tokenizer, arms, prompts, K, [0] * len(prompts), measure_cost=False)


def test_the_never_missing_arm_measures_the_candidates_ceiling(
    target: Transformer, tokenizer: Tokenizer, arms: dict[str, Any], prompts: list[list[int]]
) -> None:
    r = shadow_replay(target, tokenizer, arms, prompts, K, N_NEW, ceiling_of="candidate", **QUICK)
    assert r.broken_arms == []
    assert list(r.arms) == ["baseline", "incumbent", "candidate", NEVER_MISSING]
    assert r.outputs[NEVER_MISSING] == r.outputs["baseline"]  # lossless like every arm
    # Interleaved with the others: every arm, the never-missing one too, runs first equally often.
    assert sorted(o[0] for o in r.order[:4]) == sorted(r.arms)
    nm, cand, base = r.arms[NEVER_MISSING], r.arms["candidate"], r.arms["baseline"]
    ceiling = r.ceiling
    assert ceiling is not None and ceiling.of == "candidate"
    # It drafts the continuation: every draft the continuation knew was accepted.
    assert nm.drafted_tokens > 0
    assert nm.accepted_tokens == nm.drafted_tokens - ceiling.never_missing_off_continuation
    assert ceiling.never_missing_hit_rate == nm.hit_rate and cand.hit_rate is not None
    assert nm.hit_rate is not None and nm.hit_rate > cand.hit_rate
    assert nm.verify_steps < cand.verify_steps
    # Every figure is computed from the arms' own measurements, nothing configured.
    decode = {n: r.arms[n].decode_tokens_per_s / base.decode_tokens_per_s for n in r.arms if n != "baseline"}
    assert ceiling.speedup_over_baseline == pytest.approx(decode)
    assert ceiling.never_missing_speedup == pytest.approx(decode[NEVER_MISSING])
    assert ceiling.share_of_ceiling == pytest.approx(decode["candidate"] / decode[NEVER_MISSING])
    assert ceiling.share_of_ceiling_with_prefill == pytest.approx(
        r.speedup("candidate", "baseline") / r.speedup(NEVER_MISSING, "baseline")
    )
    assert ceiling.share_of_ceiling_paired_median is not None and ceiling.share_of_ceiling_paired_median > 0
    # Taken apart: tokens per round times time per round (decode time is rounds x time per round;
    # arithmetic on one set of timings, not a statistic, so the two agree up to rounding).
    per_round = cand.mean_accepted_length / nm.mean_accepted_length
    assert ceiling.tokens_per_round_ratio == pytest.approx(per_round)
    assert ceiling.share_of_ceiling == pytest.approx(
        ceiling.tokens_per_round_ratio * ceiling.round_time_ratio, rel=0.02
    )
    # The analytic cross-check: Leviathan at acceptance 1 from the isolated costs of this run.
    costs = r.costs
    assert costs is not None and ceiling.analytic_ceiling_speedup == pytest.approx(
        analytic_ceiling(K, costs.cost_ratio_by_arm["candidate"], costs.verify_cost[K])
    )
    assert ceiling.analytic_share_of_ceiling == pytest.approx(
        decode["candidate"] / ceiling.analytic_ceiling_speedup
    )
    assert ceiling.analytic_ceiling_speedup_in_situ is not None
    d = json.loads(json.dumps(r.to_dict()))
    assert d["ceiling"]["share_of_ceiling"] == pytest.approx(ceiling.share_of_ceiling, abs=1e-5)
    assert d["arms"][NEVER_MISSING]["broken"] is None
    # What the canary records beside the stored replay, for the API and the dashboard.
    shown = shadow_ceiling_fields(d)["shadow_ceiling"]
    assert shown["of"] == "candidate" and shown["share_of_ceiling"] == d["ceiling"]["share_of_ceiling"]
    assert shown["speedup_over_baseline"] == d["ceiling"]["speedup_over_baseline"]["candidate"]
    assert shown["analytic_share_of_ceiling"] == d["ceiling"]["analytic_share_of_ceiling"]
    # Without it asked for, no fourth arm and no ceiling.
    plain = shadow_replay(target, tokenizer, arms, prompts[:2], K, 4, measure_cost=False)
    assert plain.ceiling is None and NEVER_MISSING not in plain.arms and plain.to_dict()["ceiling"] is None
    assert shadow_ceiling_fields(plain.to_dict()) == {}


def test_a_slower_candidate_gets_a_smaller_share_of_the_same_ceiling(
    target: Transformer, tokenizer: Tokenizer, drafter: Transformer, prompts: list[list[int]]
) -> None:
    """The share moves with what the candidate costs, not with a formula: the same drafter made
    slower per round (a sleep in each of its proposals) keeps its tokens and loses share."""

    class Slow(DraftModelProposer):
        def propose(self, *args: Any, **kw: Any) -> Any:
            time.sleep(SLOW_S)
            return super().propose(*args, **kw)

    arms: dict[str, Any] = {"baseline": None, "candidate": Slow(drafter, name="candidate")}
    r = shadow_replay(
        target, tokenizer, arms, prompts[:3], K, N_NEW, ceiling_of="candidate", measure_cost=False
    )
    ceiling = r.ceiling
    assert ceiling is not None and r.broken_arms == []
    cand, nm = r.arms["candidate"], r.arms[NEVER_MISSING]
    # No sampling here: the sleep is a floor under the candidate's time (SLOW_S per verify step,
    # >= SLOW_S / (k + 1) = 20 ms per token), so the share reaches 1/2 only if the never-missing
    # arm took >= 10 ms per token over every prompt: nine times the 1.1 ms it measured on this
    # 2-core machine shared by eight busy processes.
    assert cand.propose_ms_per_step >= SLOW_S * 1000
    assert ceiling.share_of_ceiling < 0.5, (ceiling, nm.score_ms_per_step, nm.propose_ms_per_step)


def test_the_ceiling_needs_greedy_a_baseline_and_a_drafter(
    target: Transformer, tokenizer: Tokenizer, drafter: Transformer, prompts: list[list[int]]
) -> None:
    arms: dict[str, Any] = {"baseline": None, "candidate": drafter, "ngram": NgramProposer(2)}
    run = functools.partial(shadow_replay, target, tokenizer, prompts=prompts[:1], k=K, max_new_tokens=4)
    with pytest.raises(ValueError, match="temperature 0"):
        run(arms, ceiling_of="candidate", temperature=0.7, measure_cost=False)
    with pytest.raises(ValueError, match="no speculation"):
        run({"candidate": drafter}, ceiling_of="candidate", reference="none", measure_cost=False)
    with pytest.raises(ValueError, match="names no speculating arm"):
        run(arms, ceiling_of="incumbent", measure_cost=False)
    with pytest.raises(TypeError, match="no never-missing twin"):
        run(arms, ceiling_of="ngram", measure_cost=False)
