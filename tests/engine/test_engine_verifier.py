"""The verifier: rejection sampling reproduces the target's distribution (statistically, with fixed
seeds, as vLLM's rejection-sampler tests do), greedy verification, and top-p filtering."""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Callable

import pytest
import torch

from workers.engine.decoder import SpeculativeDecoder
from workers.engine.model import ModelConfig, Transformer, build_model
from workers.engine.proposers import DraftModelProposer, NgramProposer, Proposer
from workers.engine.tokenizer import Tokenizer
from workers.engine.verifier import logits_to_probs, rejection_sample, verify_greedy

ConfigFactory = Callable[..., ModelConfig]
CopyFactory = Callable[[Transformer, float, int], Transformer]


def chi_square_z(counts: Counter[tuple[int, ...]] | Counter[int], probs: dict, n: int) -> float:
    """Wilson-Hilferty z-score of Pearson's chi-square; cells with expected count < 5 are pooled.
    A count in a cell of probability 0 is an outright failure (returns inf)."""
    if any(probs.get(key, 0.0) == 0.0 for key in counts):
        return math.inf
    stat, df, pool_obs, pool_exp = 0.0, -1, 0.0, 0.0
    for key, p in probs.items():
        exp = p * n
        if exp == 0.0:
            continue
        if exp < 5:
            pool_obs += counts.get(key, 0)
            pool_exp += exp
            continue
        stat += (counts.get(key, 0) - exp) ** 2 / exp
        df += 1
    if pool_exp > 0:
        stat += (pool_obs - pool_exp) ** 2 / pool_exp
        df += 1
    a = 2.0 / (9.0 * df)
    return ((stat / df) ** (1.0 / 3.0) - (1.0 - a)) / math.sqrt(a)


def _random_dists(rows: int, vocab: int, g: torch.Generator) -> torch.Tensor:
    return torch.softmax(torch.randn(rows, vocab, generator=g) * 1.5, dim=-1)


@pytest.mark.parametrize("deterministic", [False, True])
def test_rejection_sampler_emits_target_distribution(deterministic: bool) -> None:
    """With context-independent target rows p_i, emitted token i must be distributed as p_i."""
    g = torch.Generator().manual_seed(0)
    vocab, k, n = 6, 3, 20_000
    p = _random_dists(k + 1, vocab, g)  # [k+1, V]
    q = _random_dists(k, vocab, g)  # [k, V]
    fixed = torch.tensor([2, 0, 5])  # the deterministic proposer always proposes these
    seen: list[Counter[int]] = [Counter() for _ in range(k + 1)]
    accepted = 0
    for _ in range(n):
        if deterministic:
            drafts, probs = fixed, None
        else:
            drafts, probs = torch.multinomial(q, 1, generator=g).squeeze(1), q
        m, emitted = rejection_sample(p, drafts, probs, g)
        accepted += m
        for i, tok in enumerate(emitted):
            seen[i][tok] += 1
    for i in range(2):  # positions 0 and 1 have enough samples for a sharp test
        total = sum(seen[i].values())
        z = chi_square_z(seen[i], dict(enumerate(p[i].tolist())), total)
        # Deterministic: seeded (generator 0), fails only if the code changes. With a fresh seed a
        # correct sampler would fail with P(Z > 4) = 3.2e-5 per position (Wilson-Hilferty normal).
        assert z < 4.0, f"position {i}: z = {z:.1f}"
    # Acceptance at position 0 is sum_x min(p, q) (1 - TV) for a sampled drafter, p(d) otherwise.
    alpha0 = float(torch.minimum(p[0], q[0]).sum()) if not deterministic else float(p[0, 2])
    # Deterministic: seeded. Fresh: the rate's sd is at most sqrt(0.25 / 20,000) = 0.0035, so 0.02 is
    # 5.7 sd (two-sided 1.5e-8).
    assert abs(sum(seen[1].values()) / n - alpha0) < 0.02


def test_a_wrong_sampler_fails_the_same_test() -> None:
    """Power check: emitting the drafter's tokens unconditionally is detected."""
    g = torch.Generator().manual_seed(1)
    p, q = _random_dists(2, 6, g), _random_dists(1, 6, g)
    seen: Counter[int] = Counter(int(torch.multinomial(q[0], 1, generator=g)) for _ in range(5000))
    # Deterministic: seeded (generator 1); the power check fails only if the code changes.
    assert chi_square_z(seen, dict(enumerate(p[0].tolist())), 5000) > 4.0


def test_greedy_verification() -> None:
    logits = torch.full((4, 5), -1.0)
    for row, best in enumerate([3, 1, 4, 0]):
        logits[row, best] = 1.0
    assert verify_greedy(logits, torch.tensor([3, 1, 4])) == (3, [3, 1, 4, 0])  # all + bonus
    assert verify_greedy(logits, torch.tensor([3, 2, 4])) == (1, [3, 1])  # corrected at position 1
    assert verify_greedy(logits[:1], torch.empty(0, dtype=torch.long)) == (0, [3])


def test_top_p_keeps_the_smallest_nucleus() -> None:
    probs = logits_to_probs(torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05])), 1.0, top_p=0.8)
    torch.testing.assert_close(probs, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    assert logits_to_probs(torch.tensor([1.0, 5.0]), 1.0, top_p=0.01).tolist() == [0.0, 1.0]


@pytest.mark.slow  # 3,000 decodes each: over half of the engine tests' time
@pytest.mark.parametrize("kind", ["draft", "draft-confident", "ngram"])
def test_speculative_sampling_matches_target_joint_distribution(
    kind: str, tokenizer: Tokenizer, tiny_config: ConfigFactory, noisy_copy: CopyFactory
) -> None:
    """End to end through the decoder: the joint law of 4 generated tokens over a 3-token vocabulary
    (81 outcomes, with temperature and top-p) equals the target's, computed exactly."""
    vocab, new, temperature, top_p, n = 3, 4, 0.9, 0.9, 3000
    cfg = tiny_config(vocab_size=vocab, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=32)
    target = build_model(cfg, seed=12).eval()
    with torch.no_grad():
        for p in target.parameters():
            p.mul_(3.0)  # spread the logits so some tokens fall outside the top-p nucleus
    prompt = [0, 1, 2, 0, 1]
    seqs = list(itertools.product(range(vocab), repeat=new))
    with torch.inference_mode():
        full = torch.tensor([prompt + list(s) for s in seqs])  # [81, 9]
        probs = logits_to_probs(target(full)[:, len(prompt) - 1 : -1], temperature, top_p)  # [81, 4, V]
        step_p = probs.gather(-1, full[:, len(prompt) :, None]).squeeze(-1)  # [81, 4]
    exact = dict(zip(seqs, step_p.prod(-1).tolist(), strict=True))
    assert sum(1 for v in exact.values() if v == 0.0) > 5  # top-p really pruned something
    assert sum(1 for v in exact.values() if v * n >= 5) > 40  # and many outcomes remain testable

    proposer: Proposer = {
        "draft": lambda: DraftModelProposer(noisy_copy(target, 0.3, 2)),
        # Rounds end early wherever the drafter's sampled token had q < 0.6: still exact.
        "draft-confident": lambda: DraftModelProposer(noisy_copy(target, 0.3, 2), confidence_threshold=0.6),
        "ngram": lambda: NgramProposer(1),
    }[kind]()
    dec = SpeculativeDecoder(target, tokenizer, proposer, k=3)
    g = torch.Generator().manual_seed(123)
    counts: Counter[tuple[int, ...]] = Counter()
    drafted = accepted = steps = 0
    for _ in range(n):
        res = dec.generate(prompt, new, temperature, top_p, generator=g, stop_at_eos=False)
        counts[tuple(res.token_ids)] += 1
        drafted += res.metrics.drafted_tokens
        accepted += res.metrics.accepted_tokens
        steps += res.metrics.verify_steps
    assert 0 < accepted < drafted
    if kind == "draft-confident":
        assert drafted < 3 * steps  # some rounds did stop early
    # Deterministic: seeded (generator 123, model seed 12). Fresh: P(Z > 4) = 3.2e-5 for an exact sampler.
    assert chi_square_z(counts, exact, n) < 4.0
