"""Shadow replay: paired per-prompt figures for every arm, rotated arm order, step costs, and the
lossless check that catches a broken verifier or a tampered arm (and names the prompt)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
import torch

import workers.engine.decoder as decoder_module
from workers.canary.replay import ReplayCancelledError, greedy_tokens, shadow_replay
from workers.engine.decoder import GenerationResult, SpeculativeDecoder
from workers.engine.model import Transformer
from workers.engine.proposers import NgramProposer, Proposer
from workers.engine.tokenizer import Tokenizer

PromptFactory = Callable[..., list[list[int]]]
CopyFactory = Callable[[Transformer, float, int], Transformer]
K = 4
N_NEW = 16
QUICK: dict[str, Any] = {"cost_max_k": 4, "cost_repeats": 3}


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
