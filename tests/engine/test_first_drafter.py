"""A first drafter cut from its target: how many layers, which weights, the target untouched; and
the shadow replay of a canary whose incumbent has no drafter (no speculation, measured once)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from workers.canary.replay import shadow_replay
from workers.engine.decoder import SpeculativeDecoder
from workers.engine.model import ModelConfig, Transformer, build_model
from workers.engine.proposers import Proposer
from workers.engine.tokenizer import Tokenizer
from workers.training.first_drafter import (
    choose_layers,
    cost_fraction,
    first_drafter_from_target,
    narrow_config,
    narrow_drafter_from_target,
    random_drafter_like,
)

PromptFactory = Any


def test_layers_are_chosen_by_the_cost_of_a_step() -> None:
    # The bundled reference target: 6 layers of 384 wide, a 4096-token head.
    reference = ModelConfig(
        vocab_size=4096, dim=384, n_layers=6, n_heads=6, n_kv_heads=6, ffn_dim=1024, max_seq_len=512
    )
    assert cost_fraction(reference, 1) == pytest.approx(0.274, abs=1e-3)
    assert choose_layers(reference) == 1  # over the fraction already, but never fewer than one
    # An 8B-class target (32 layers, grouped-query attention, a 128k-token head).
    large = ModelConfig(
        vocab_size=128_256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14_336, max_seq_len=512
    )
    n = choose_layers(large)
    assert cost_fraction(large, n) <= 0.25 < cost_fraction(large, n + 1)
    assert n == 6
    assert choose_layers(large, max_cost_fraction=0.1) == 1
    assert cost_fraction(large, 32) == pytest.approx(1.0)


def test_the_narrow_drafter_is_as_wide_as_its_cost_allows() -> None:
    reference = ModelConfig(
        vocab_size=4096, dim=384, n_layers=6, n_heads=6, n_kv_heads=6, ffn_dim=1024, max_seq_len=512
    )
    narrow = narrow_config(reference)
    # The bundled generic drafter's shape, found from the cost alone.
    assert (narrow.dim, narrow.n_layers, narrow.n_heads, narrow.ffn_dim) == (128, 2, 4, 344)
    assert narrow.vocab_size == 4096 and narrow.tie_embeddings and narrow.max_seq_len == 512
    assert narrow_config(reference, max_cost_fraction=0.105).dim == 160
    assert narrow_config(reference, max_cost_fraction=0.001).dim == 64  # never narrower than 64
    large = ModelConfig(
        vocab_size=128_256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14_336, max_seq_len=512
    )
    assert narrow_config(large).dim == 2048  # half the target's width at most
    tiny = ModelConfig(
        vocab_size=512, dim=48, n_layers=2, n_heads=3, n_kv_heads=1, ffn_dim=96, max_seq_len=128
    )
    assert (narrow_config(tiny).dim, narrow_config(tiny).n_heads, narrow_config(tiny).n_kv_heads) == (
        48,
        3,
        3,
    )


def test_the_narrow_drafter_starts_from_the_targets_embeddings_projected() -> None:
    # Wider than 64, so the drafter is narrower than its target (at 64 or less it keeps the width).
    target = build_model(
        ModelConfig(
            vocab_size=320, dim=192, n_layers=2, n_heads=6, n_kv_heads=2, ffn_dim=384, max_seq_len=128
        ),
        seed=0,
    ).eval()
    before = {name: t.clone() for name, t in target.state_dict().items()}
    drafter = narrow_drafter_from_target(target)
    table = target.model.embed_tokens.weight.detach().float()
    own = drafter.model.embed_tokens.weight.detach()
    assert drafter.lm_head.weight is drafter.model.embed_tokens.weight and drafter.dtype == torch.float32
    # own = table @ W for a W with orthonormal columns: a projection of the target's own table.
    assert own.shape[1] < table.shape[1]
    w = torch.linalg.lstsq(table, own).solution  # [D_target, dim]
    assert torch.allclose(table @ w, own, atol=1e-3)
    assert torch.allclose(w.T @ w, torch.eye(own.shape[1]), atol=1e-3)
    # The leading directions: they keep more of the table's spread than any other choice would.
    centred = table - table.mean(0)
    kept = float(((centred @ w) ** 2).sum() / (centred**2).sum())
    random_basis = torch.linalg.qr(
        torch.randn(table.shape[1], own.shape[1], generator=torch.Generator().manual_seed(0))
    )[0]
    # Not a sampled figure: the leading principal directions keep at least the spread of any
    # orthonormal basis (Eckart-Young); the basis compared against is seeded.
    assert kept > float(((centred @ random_basis) ** 2).sum() / (centred**2).sum())
    for name, tensor in target.state_dict().items():
        assert torch.equal(tensor, before[name]), name
    again = narrow_drafter_from_target(target)
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in drafter.state_dict().items())


def test_the_first_drafter_is_the_targets_own_weights_and_the_target_is_only_read(
    target: Transformer, make_prompts: PromptFactory
) -> None:
    before = {name: t.clone() for name, t in target.state_dict().items()}
    whole = first_drafter_from_target(target, n_layers=target.config.n_layers)
    tokens = torch.tensor([make_prompts(1, seed=4)[0]])
    with torch.no_grad():
        assert torch.equal(whole(tokens), target(tokens))  # every layer copied: the target itself
    cut = first_drafter_from_target(target, n_layers=1)
    assert cut.config.n_layers == 1 and cut.dtype == torch.float32
    assert torch.equal(cut.model.embed_tokens.weight, target.model.embed_tokens.weight)
    assert torch.equal(cut.lm_head.weight, target.lm_head.weight)
    assert torch.equal(
        cut.model.layers[0].self_attn.q_proj.weight, target.model.layers[0].self_attn.q_proj.weight
    )
    with torch.no_grad():
        cut.model.embed_tokens.weight.add_(1.0)  # the drafter trains its own copy
    for name, tensor in target.state_dict().items():
        assert torch.equal(tensor, before[name]), name
    random = random_drafter_like(target, 1, seed=3)
    assert random.config == cut.config
    assert not torch.equal(random.model.layers[0].mlp.up_proj.weight, cut.model.layers[0].mlp.up_proj.weight)
    with pytest.raises(ValueError, match="1 to 2 layers"):
        first_drafter_from_target(target, n_layers=3)


def test_a_drafterless_incumbent_is_replayed_once_as_the_baseline(
    target: Transformer, tokenizer: Tokenizer, make_prompts: PromptFactory
) -> None:
    runs: dict[str, int] = {}

    class Counting(SpeculativeDecoder):
        arm = ""

        def generate(self, prompt: Any, max_new_tokens: int, **kw: Any) -> Any:
            runs[self.arm] = runs.get(self.arm, 0) + 1
            return super().generate(prompt, max_new_tokens, **kw)

    def factory(name: str, proposer: Proposer | None, k: int) -> SpeculativeDecoder:
        decoder = Counting(target, tokenizer, proposer, k=k)
        decoder.arm = name
        return decoder

    prompts = make_prompts(4, seed=7)
    candidate = first_drafter_from_target(target, n_layers=1)
    arms = {"baseline": None, "incumbent": None, "candidate": candidate}
    r = shadow_replay(target, tokenizer, arms, prompts, 4, 12, measure_cost=False, decoder_factory=factory)
    assert runs == {"baseline": 1 + len(prompts), "candidate": 1 + len(prompts)}  # warm-up + prompts
    assert list(r.arms) == ["baseline", "incumbent", "candidate"] and r.broken_arms == []
    incumbent, baseline = r.arms["incumbent"], r.arms["baseline"]
    assert incumbent.name == "incumbent" and not incumbent.speculative and incumbent.hit_rate is None
    assert incumbent.tokens_per_s == baseline.tokens_per_s
    assert r.per_prompt["incumbent"] == r.per_prompt["baseline"]
    assert r.outputs["incumbent"] == r.outputs["candidate"]  # lossless
    assert r.arms["candidate"].drafted_tokens > 0
