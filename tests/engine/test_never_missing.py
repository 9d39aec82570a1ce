"""Never-missing drafters: lossless, every draft accepted where the continuation is known, and the
very drafter forwards their real twin runs (so the ceiling they measure is that drafter's)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from workers.canary.replay import greedy_tokens
from workers.engine.decoder import SpeculativeDecoder
from workers.engine.eagle import HeadConfig, HeadProposer, head_for_target
from workers.engine.model import Transformer
from workers.engine.never_missing import (
    Continuations,
    NeverMissingDraftProposer,
    NeverMissingHeadProposer,
    never_missing_twin,
)
from workers.engine.proposers import DraftModelProposer, NgramProposer
from workers.engine.tokenizer import Tokenizer

PromptFactory = Callable[..., list[list[int]]]
CopyFactory = Callable[[Transformer, float, int], Transformer]
K = 4
N_NEW = 24


def _known(target: Transformer, prompts: list[list[int]], eos: int | None) -> Continuations:
    known = Continuations()
    for p in prompts:
        ref = greedy_tokens(target, p, N_NEW, eos)
        known.add(p, ref + [eos] if eos is not None and len(ref) < N_NEW else ref)
    return known


def test_it_drafts_the_continuation_is_lossless_and_never_misses(
    target: Transformer, drafter: Transformer, tokenizer: Tokenizer, make_prompts: PromptFactory
) -> None:
    prompts = make_prompts(6, seed=11)
    known = _known(target, prompts, tokenizer.eos_id)
    proposer = NeverMissingDraftProposer(drafter, known)
    ceiling = SpeculativeDecoder(target, tokenizer, proposer, k=K)
    real = SpeculativeDecoder(target, tokenizer, DraftModelProposer(drafter), k=K)
    plain = SpeculativeDecoder(target, tokenizer, None)
    drafted = 0
    for p in prompts:
        want = plain.generate(p, N_NEW)
        got = ceiling.generate(p, N_NEW)
        assert got.token_ids == want.token_ids  # lossless: plain greedy's tokens
        m = got.metrics
        assert m.accepted_tokens == m.drafted_tokens  # every draft accepted (none past the end here)
        # Every round but the last emits k + 1 tokens: as few verify steps as any drafter can take.
        assert m.verify_steps == -(-(want.metrics.generated_tokens - 1) // (K + 1))
        drafted += m.drafted_tokens
    assert drafted > 4 * K and proposer.off_continuation == 0
    real_hit = [real.generate(p, N_NEW).metrics.hit_rate for p in prompts]
    assert min(r for r in real_hit if r is not None) < 1.0  # the real drafter does miss here


def test_an_unknown_prompt_gets_the_drafters_own_drafts_and_stays_lossless(
    target: Transformer, drafter: Transformer, tokenizer: Tokenizer, make_prompts: PromptFactory
) -> None:
    known, unknown = make_prompts(2, seed=12)
    proposer = NeverMissingDraftProposer(drafter, _known(target, [known], tokenizer.eos_id))
    ceiling = SpeculativeDecoder(target, tokenizer, proposer, k=K)
    real = SpeculativeDecoder(target, tokenizer, DraftModelProposer(drafter), k=K)
    got, twin = ceiling.generate(unknown, N_NEW), real.generate(unknown, N_NEW)
    assert got.token_ids == twin.token_ids
    # Nothing known: it is its twin, draft for draft.
    assert (got.metrics.drafted_tokens, got.metrics.accepted_tokens) == (
        twin.metrics.drafted_tokens,
        twin.metrics.accepted_tokens,
    )
    assert proposer.off_continuation == got.metrics.drafted_tokens > 0


class _Counted:
    """Wraps a model's forward_cached to log how many tokens each call fed."""

    def __init__(self, model: Transformer) -> None:
        self.fed: list[int] = []
        self._forward = model.forward_cached

    def __call__(self, tokens: torch.Tensor, *args: Any, **kw: Any) -> torch.Tensor:
        self.fed.append(int(tokens.shape[-1]))
        return self._forward(tokens, *args, **kw)


def test_it_runs_the_forwards_its_twin_runs_when_the_twin_never_misses(
    target: Transformer,
    tokenizer: Tokenizer,
    noisy_copy: CopyFactory,
    make_prompts: PromptFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A drafter that is the target never misses either: the two must then feed the same tokens
    # through the same number of forwards, round for round.
    prompts = make_prompts(3, seed=13)
    twin_model, ceiling_model = noisy_copy(target, 0.0, 2), noisy_copy(target, 0.0, 3)
    twin_calls, ceiling_calls = _Counted(twin_model), _Counted(ceiling_model)
    monkeypatch.setattr(twin_model, "forward_cached", twin_calls)
    monkeypatch.setattr(ceiling_model, "forward_cached", ceiling_calls)
    known = _known(target, prompts, tokenizer.eos_id)
    twin = SpeculativeDecoder(target, tokenizer, DraftModelProposer(twin_model), k=K)
    ceiling = SpeculativeDecoder(target, tokenizer, NeverMissingDraftProposer(ceiling_model, known), k=K)
    for p in prompts:
        a, b = twin.generate(p, N_NEW), ceiling.generate(p, N_NEW)
        assert a.metrics.hit_rate == 1.0 and b.metrics.hit_rate == 1.0
        assert a.token_ids == b.token_ids
    assert ceiling_calls.fed == twin_calls.fed and len(twin_calls.fed) > 3 * K


def test_a_head_twin_drafts_the_continuation_through_the_heads_forwards(
    target: Transformer, tokenizer: Tokenizer, make_prompts: PromptFactory
) -> None:
    torch.manual_seed(0)
    head = head_for_target(target, HeadConfig.for_target(target.config, target.config.vocab_size)).eval()
    prompts = make_prompts(3, seed=14)
    known = _known(target, prompts, tokenizer.eos_id)
    proposer = never_missing_twin(HeadProposer(head), known)
    assert isinstance(proposer, NeverMissingHeadProposer) and proposer.head is head
    ceiling = SpeculativeDecoder(target, tokenizer, proposer, k=K)
    plain = SpeculativeDecoder(target, tokenizer, None)
    for p in prompts:
        off = proposer.off_continuation
        got = ceiling.generate(p, N_NEW)
        assert got.token_ids == plain.generate(p, N_NEW).token_ids
        m = got.metrics
        # Every draft the continuation knew was accepted; past its end (the end-of-text token
        # drafted, then the head's own drafts, as its twin would pay) the last round's rest is not.
        past_end = proposer.off_continuation - off
        assert m.drafted_tokens > 0 and m.accepted_tokens == m.drafted_tokens - past_end
        assert past_end < K and (past_end == 0 or got.finish_reason == "stop")


def test_twins_are_built_from_drafters_only_and_refuse_sampling(
    target: Transformer, drafter: Transformer, tokenizer: Tokenizer, make_prompts: PromptFactory
) -> None:
    known = Continuations()
    assert isinstance(never_missing_twin(drafter, known), NeverMissingDraftProposer)
    from_proposer = never_missing_twin(DraftModelProposer(drafter, 128), known)
    assert isinstance(from_proposer, NeverMissingDraftProposer) and from_proposer.drafter is drafter
    with pytest.raises(TypeError, match="no never-missing twin"):
        never_missing_twin(NgramProposer(2), known)  # type: ignore[arg-type]
    ceiling = SpeculativeDecoder(target, tokenizer, NeverMissingDraftProposer(drafter, known), k=K)
    with pytest.raises(ValueError, match="temperature must be 0"):
        ceiling.generate(make_prompts(1)[0], 8, temperature=0.8, generator=torch.Generator().manual_seed(0))


def test_a_prompt_served_at_two_lengths_keeps_the_longer_continuation() -> None:
    known = Continuations()
    known.add([1, 2], [5, 6, 7])
    known.add([1, 2], [5])
    known.start_request([1, 2])
    assert known.next_tokens([1, 2, 5], 4) == [6, 7]
    assert known.next_tokens([1, 2, 9], 4) == []  # the output left the continuation
    assert known.next_tokens([1, 2, 5, 6, 7], 4) == []  # past its end
