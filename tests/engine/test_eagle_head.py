"""Draft heads in the engine: the head's forward, what it reads from the target, and that speculation
with a head is lossless (greedy identity, the sampled joint law)."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.engine.test_engine_verifier import chi_square_z
from workers.engine.decoder import SpeculativeDecoder, greedy_reference
from workers.engine.eagle import EagleHead, HeadConfig, HeadProposer, default_aux_layers, head_for_target
from workers.engine.model import Transformer, build_model
from workers.engine.tokenizer import Tokenizer
from workers.engine.verifier import logits_to_probs

ConfigFactory = Callable[..., Any]
PromptFactory = Callable[..., list[list[int]]]


def _head(target: Transformer, draft_vocab: int | None = None, seed: int = 0, **kw: Any) -> EagleHead:
    torch.manual_seed(seed)
    cfg = HeadConfig.for_target(target.config, draft_vocab or target.config.vocab_size, **kw)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(target.config.vocab_size, generator=g)[: cfg.draft_vocab_size].sort().values
    return head_for_target(target, cfg, ids).eval()


class _Recording(HeadProposer):
    """Keeps what the decoder hands the head, to compare with a full target pass."""

    def __init__(self, head: EagleHead) -> None:
        super().__init__(head)
        self.seen: dict[int, torch.Tensor] = {}

    def observe(self, hidden: Any, start: int) -> None:
        rows = torch.cat(list(hidden), dim=-1)
        for i in range(len(rows)):
            self.seen[start + i] = rows[i].clone()
        super().observe(hidden, start)


def test_aux_layers_default_to_low_middle_high() -> None:
    assert default_aux_layers(32) == (2, 16, 29)  # vLLM's EAGLE-3 choice
    assert default_aux_layers(6) == (1, 3, 5)  # (2, 3, 3) would repeat a layer
    assert default_aux_layers(2) == (1,)


def test_head_forward_shapes_and_the_states_it_reads(
    target: Transformer, make_prompts: PromptFactory
) -> None:
    head = _head(target, draft_vocab=100)
    d, layers = target.config.dim, head.config.aux_layers
    assert head.fc.weight.shape == (d, len(layers) * d)
    assert head.midlayer.self_attn.q_proj.weight.shape[1] == 2 * d  # [embedding ; state]
    assert head.lm_head.weight.shape == (100, d)
    assert "embed_weight" not in head.state_dict()  # the target's, shared, never saved
    # The draft vocabulary maps back into the target's ids.
    assert int(head.t2d.sum()) == 100 and bool(head.t2d[head.draft_ids].all())

    prompt = make_prompts(1, seed=5)[0]
    with torch.inference_mode():
        full: list[torch.Tensor] = []
        seq = torch.tensor([prompt + list(range(1, 30))])
        target.forward_cached(seq, target.new_cache(1), hidden_layers=layers, hidden_out=full)
        assert len(full) == len(layers) and full[0].shape == (1, seq.shape[1], d)
        out = head.forward_cached(head.fuse(torch.cat(full, dim=-1)), seq, head.new_cache())
        assert out.shape == (1, seq.shape[1], d) and head.logits(out).shape == (1, seq.shape[1], 100)


def test_unrolled_training_pass_matches_drafting(target: Transformer) -> None:
    """Step s of the training unroll at position t is what drafting the (s+1)-th token after
    position t-s computes: the same attention pattern, the same fed-back states."""
    head = _head(target, draft_vocab=64, seed=3)
    tokens = torch.randint(1, target.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    layers = head.config.aux_layers
    with torch.inference_mode():
        states: list[torch.Tensor] = []
        target.forward_cached(tokens, target.new_cache(1), hidden_layers=layers, hidden_out=states)
        hidden = torch.cat(states, dim=-1)  # [1, T, A*D]
        nxt = torch.roll(tokens, -1, dims=1)  # the token after each position (the last one unused)
        outs = head.unrolled(hidden, nxt, steps=3)
        for t in (5, 11, 20):
            for s in range(3):
                cache = head.new_cache()
                last = t - s  # the last position the target verified
                out = head.forward_cached(head.fuse(hidden[:, : last + 1]), nxt[:, : last + 1], cache)[:, -1:]
                for j in range(1, s + 1):
                    out = head.forward_cached(out, nxt[:, last + j : last + j + 1], cache)
                torch.testing.assert_close(outs[s][0, t], out[0, -1], rtol=1e-4, atol=1e-4)
        # A window (queries from position 6 on, keys everywhere) computes the same states where
        # the chain it unrolls starts inside it.
        windowed = head.unrolled(hidden, nxt, steps=3, first=torch.tensor([6]), width=15)
        for s in range(3):
            torch.testing.assert_close(windowed[s][0, s:], outs[s][0, 6 + s : 21], rtol=1e-4, atol=1e-4)


@pytest.mark.slow  # 10 s of decoding beside other runs, the slowest of the head's other tests
def test_greedy_speculation_with_a_head_is_identical_for_every_prompt(
    target: Transformer, tokenizer: Tokenizer, make_prompts: PromptFactory
) -> None:
    head = _head(target, draft_vocab=200)
    proposer = _Recording(head)
    dec = SpeculativeDecoder(target, tokenizer, proposer, k=4)
    forward = target.forward_cached
    calls = 0

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        nonlocal calls
        calls += 1
        return forward(*args, **kwargs)

    target.forward_cached = counted  # type: ignore[method-assign]
    try:
        for prompt in make_prompts(12, seed=1):
            calls = 0
            proposer.seen.clear()
            res = dec.generate(prompt, 40, stop_at_eos=False)
            assert res.token_ids == greedy_reference(target, prompt, 40)
            # One target pass per verify step plus the prefill: the head never runs the target.
            assert calls == 1 + res.metrics.verify_steps
            # It read the target's states at every position the target verified, as a full pass has them.
            seq = torch.tensor([prompt + res.token_ids])
            with torch.inference_mode():
                full: list[torch.Tensor] = []
                forward(seq, target.new_cache(1), hidden_layers=head.config.aux_layers, hidden_out=full)
            rows = torch.cat(full, dim=-1)[0]
            assert sorted(proposer.seen) == list(range(len(prompt) + len(res.token_ids) - 1))
            for pos, got in proposer.seen.items():
                torch.testing.assert_close(got, rows[pos], rtol=1e-4, atol=1e-4)
    finally:
        target.forward_cached = forward  # type: ignore[method-assign]


def test_a_head_behind_a_predicted_output_still_follows_the_target(
    target: Transformer, tokenizer: Tokenizer, make_prompts: PromptFactory
) -> None:
    """A prediction drafts some rounds; the head, its fallback, still sees every verified state."""
    dec = SpeculativeDecoder(target, tokenizer, HeadProposer(_head(target, draft_vocab=150)), k=3)
    for prompt in make_prompts(4, seed=2):
        want = greedy_reference(target, prompt, 30)
        res = dec.generate(prompt, 30, stop_at_eos=False, prediction=want[:10] + [7, 7, 7])
        assert res.token_ids == want
        assert (res.metrics.prediction_matched_tokens or 0) > 0  # the prediction did draft


def test_a_head_for_another_target_is_refused(
    target: Transformer, tokenizer: Tokenizer, tiny_config: ConfigFactory
) -> None:
    other = build_model(tiny_config(dim=32, n_heads=2, n_kv_heads=1), seed=1)
    with pytest.raises(ValueError, match="width"):
        SpeculativeDecoder(target, tokenizer, HeadProposer(_head(other)), k=3)
    with pytest.raises(ValueError, match="aux layers"):
        HeadConfig.for_target(target.config, 10, aux_layers=(0, 9))


@pytest.mark.slow  # 2,000 decodes: the slowest of the head's tests
def test_speculative_sampling_with_a_head_matches_target_joint_distribution(
    tokenizer: Tokenizer, tiny_config: ConfigFactory
) -> None:
    """The joint law of 4 tokens over a 3-token vocabulary, with temperature and top-p, equals the
    target's; the head's draft vocabulary is two of the three ids (the third is never drafted)."""
    vocab, new, temperature, top_p, n = 3, 4, 0.9, 0.9, 2000
    cfg = tiny_config(vocab_size=vocab, dim=16, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=32)
    target = build_model(cfg, seed=12).eval()
    with torch.no_grad():
        for p in target.parameters():
            p.mul_(3.0)
    prompt = [0, 1, 2, 0, 1]
    seqs = list(itertools.product(range(vocab), repeat=new))
    with torch.inference_mode():
        full = torch.tensor([prompt + list(s) for s in seqs])
        probs = logits_to_probs(target(full)[:, len(prompt) - 1 : -1], temperature, top_p)
        step_p = probs.gather(-1, full[:, len(prompt) :, None]).squeeze(-1)
    exact = dict(zip(seqs, step_p.prod(-1).tolist(), strict=True))
    head = head_for_target(target, HeadConfig.for_target(cfg, 2), torch.tensor([0, 2])).eval()
    with torch.no_grad():
        for p in head.parameters():
            p.mul_(20.0)  # confident drafts: some accepted, some rejected
    dec = SpeculativeDecoder(target, tokenizer, HeadProposer(head), k=3)
    g = torch.Generator().manual_seed(123)
    counts: Counter[tuple[int, ...]] = Counter()
    drafted = accepted = 0
    for _ in range(n):
        res = dec.generate(prompt, new, temperature, top_p, generator=g, stop_at_eos=False)
        counts[tuple(res.token_ids)] += 1
        drafted += res.metrics.drafted_tokens
        accepted += res.metrics.accepted_tokens
    assert 0 < accepted < drafted
    # Deterministic: seeded (generator 123). Fresh: P(Z > 4) = 3.2e-5 for an exact sampler.
    assert chi_square_z(counts, exact, n) < 4.0
