"""The decoder module: cached and uncached paths agree, rollback is exact, HF Llama gives equal logits."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from workers.engine.model import NUMPY_STEP_ROWS, FastLinear, ModelConfig, build_model

ConfigFactory = Callable[..., ModelConfig]


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
def test_cached_prefill_and_steps_match_full_forward(n_kv_heads: int, tiny_config: ConfigFactory) -> None:
    model = build_model(tiny_config(n_kv_heads=n_kv_heads), seed=3).eval()
    x = torch.randint(0, 320, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        full = model(x)  # [2,40,V]
        cache = model.new_cache(batch_size=2)
        parts = [model.forward_cached(x[:, :17], cache)]
        for t in range(17, 40):
            parts.append(model.forward_cached(x[:, t : t + 1], cache))
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
def test_numpy_steps_match_torch_and_share_its_cache(n_kv_heads: int, tiny_config: ConfigFactory) -> None:
    """Steps of one or several rows run in NumPy on the torch cache's buffers: same logits, same
    cached keys/values, also after a rollback, with any grouping of query heads."""
    model = build_model(tiny_config(n_kv_heads=n_kv_heads), seed=13).eval()
    x = torch.randint(0, 320, (1, 60), generator=torch.Generator().manual_seed(2))
    runs = {}
    for numpy_steps in (False, True):
        model.numpy_step_rows = 8 if numpy_steps else 0
        with torch.inference_mode():
            cache = model.new_cache()
            out = [model.forward_cached(x[:, :17], cache)]  # prefill: torch either way
            t = 17
            for rows in (1, 3, 8, 1, 2):
                out.append(model.forward_cached(x[:, t : t + rows], cache))
                t += rows
            cache.rollback(t - 4)  # undo a rejected draft, then continue from there
            out.append(model.forward_cached(x[:, t - 4 : t + 1], cache, last_only=True))
        end = cache.pos
        runs[numpy_steps] = (out, cache.k[:, :, :, :end].clone(), cache.v[:, :, :, :end].clone())
    assert model._numpy is not None  # the NumPy path really ran
    with torch.inference_mode():
        full = model(x[:, : t + 1])
    torch.testing.assert_close(torch.cat(runs[True][0][:-1], dim=1), full[:, :t], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(runs[True][0][-1][0, 0], full[0, t], atol=1e-5, rtol=1e-5)
    for got, want in zip(runs[True][0], runs[False][0], strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(runs[True][1], runs[False][1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(runs[True][2], runs[False][2], atol=1e-5, rtol=1e-5)


def test_numpy_steps_follow_weight_updates_and_stay_out_of_autograd(tiny_config: ConfigFactory) -> None:
    model = build_model(tiny_config(), seed=14).eval()
    model.numpy_step_rows = 2
    x = torch.randint(0, 320, (1, 12))

    def step_logits() -> torch.Tensor:
        with torch.inference_mode():
            cache = model.new_cache()
            model.forward_cached(x[:, :10], cache)
            return model.forward_cached(x[:, 10:], cache)  # 2 rows, in NumPy here

    step_logits()
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model(x).logsumexp(-1).mean().backward()
    opt.step()  # in place: the NumPy weight copies must be rebuilt
    model.eval()
    assert model.steps_in_numpy(2)
    with torch.inference_mode():
        torch.testing.assert_close(step_logits(), model(x)[:, 10:], atol=1e-5, rtol=1e-5)
    # With autograd on, a step stays on torch, whose output carries the graph to the parameters.
    model.invalidate_fast_path()
    assert model.forward_cached(x[:, :2], model.new_cache()).requires_grad
    assert model._numpy is None
    assert not model.steps_in_numpy(3)
    other = build_model(tiny_config(), seed=1)
    assert not other.steps_in_numpy(1)  # off by default
    other.numpy_step_rows = NUMPY_STEP_ROWS
    assert other.steps_in_numpy(NUMPY_STEP_ROWS) and not other.steps_in_numpy(NUMPY_STEP_ROWS + 1)
    assert not build_model(tiny_config(attention_bias=True), seed=1).steps_in_numpy(1)


def test_rollback_equals_recomputation(tiny_config: ConfigFactory) -> None:
    model = build_model(tiny_config(), seed=4).eval()
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 320, (1, 60), generator=g)
    junk = torch.randint(0, 320, (1, 7), generator=g)
    with torch.inference_mode():
        full = model(x)
        cache = model.new_cache()
        model.forward_cached(x[:, :30], cache)
        # Write rejected "drafts" past position 30, then roll back to several points and continue.
        for back in (30, 25, 12):
            cache.rollback(min(cache.pos, back + 3))
            model.forward_cached(junk, cache)
            cache.rollback(back)
            got = model.forward_cached(x[:, back : back + 5], cache)
            torch.testing.assert_close(got, full[:, back : back + 5], atol=1e-5, rtol=1e-5)
            assert cache.pos == back + 5
        with pytest.raises(ValueError):
            cache.rollback(cache.pos + 1)


def test_last_only_and_cache_overflow(tiny_config: ConfigFactory) -> None:
    model = build_model(tiny_config(max_seq_len=32), seed=5).eval()
    x = torch.randint(0, 320, (1, 20))
    with torch.inference_mode():
        cache = model.new_cache()
        last = model.forward_cached(x, cache, last_only=True)
        assert last.shape == (1, 1, 320)
        torch.testing.assert_close(last[0, 0], model(x)[0, -1], atol=1e-5, rtol=1e-5)
        with pytest.raises(ValueError, match="KV cache full"):
            model.forward_cached(torch.zeros(1, 13, dtype=torch.long), cache)


def test_state_dict_uses_hf_llama_names(tiny_config: ConfigFactory) -> None:
    model = build_model(tiny_config(n_layers=1, tie_embeddings=False), seed=0)
    names = set(model.state_dict())
    assert {
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.v_proj.weight",
        "model.layers.0.self_attn.o_proj.weight",
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.post_attention_layernorm.weight",
        "model.norm.weight",
        "lm_head.weight",
    } == names


@pytest.mark.parametrize("tie,n_kv", [(True, 4), (False, 2)])
def test_logits_match_transformers_llama(tie: bool, n_kv: int, tiny_config: ConfigFactory) -> None:
    transformers = pytest.importorskip("transformers")
    cfg = tiny_config(tie_embeddings=tie, n_kv_heads=n_kv, rope_theta=500.0)
    model = build_model(cfg, seed=6).eval()
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg.to_hf_dict())).eval()
    hf.load_state_dict(model.state_dict(), strict=not tie)
    x = torch.randint(0, 320, (2, 50), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        torch.testing.assert_close(model(x), hf(x).logits, atol=1e-4, rtol=1e-4)


def test_config_hf_round_trip(tiny_config: ConfigFactory) -> None:
    cfg = tiny_config(tie_embeddings=False)
    back = ModelConfig.from_hf_dict(cfg.to_hf_dict())
    assert back == cfg
    with pytest.raises(ValueError, match="hidden_act"):
        ModelConfig.from_hf_dict({**cfg.to_hf_dict(), "hidden_act": "gelu"})


def test_cached_path_follows_weight_updates(tiny_config: ConfigFactory) -> None:
    """The decode path caches weight references; in-place training updates must still be seen."""
    model = build_model(tiny_config(), seed=10).eval()
    x = torch.randint(0, 320, (1, 12))

    def cached_logits() -> torch.Tensor:
        with torch.inference_mode():
            return model.forward_cached(x, model.new_cache())

    cached_logits()  # builds the weight references
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model(x).logsumexp(-1).mean().backward()
    opt.step()
    model.eval()
    with torch.inference_mode():
        torch.testing.assert_close(cached_logits(), model(x), atol=1e-5, rtol=1e-5)
    # Swapping a Parameter object needs an explicit invalidation.
    model.lm_head.weight = torch.nn.Parameter(torch.randn_like(model.lm_head.weight))
    model.invalidate_fast_path()
    with torch.inference_mode():
        torch.testing.assert_close(cached_logits(), model(x), atol=1e-5, rtol=1e-5)


def test_fast_linear_matches_f_linear_and_follows_in_place_weight_changes() -> None:
    torch.manual_seed(0)
    # Big enough for the oneDNN path on several rows (where this torch build has it).
    weights = [torch.nn.Parameter(torch.randn(512, 384) * 0.05) for _ in range(3)]
    biases = [torch.nn.Parameter(torch.randn(512) * 0.05), None, torch.nn.Parameter(torch.randn(512) * 0.05)]
    fused = FastLinear(weights, biases)
    x = torch.randn(1, 5, 384)

    def expected() -> list[torch.Tensor]:
        return [F.linear(x, w, b) for w, b in zip(weights, biases, strict=True)]

    with torch.inference_mode():
        for got, want in zip(fused.parts(x), expected(), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        one_row = fused.parts(x[:, :1])
        for got, want in zip(one_row, [e[:, :1] for e in expected()], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # An optimizer step changes the weights in place: the packed copy must not be served stale.
    with torch.no_grad():
        weights[1].mul_(-2.0)
        biases[2].add_(1.0)
    with torch.inference_mode():
        for got, want in zip(fused.parts(x), expected(), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # With gradients wanted, the product goes through the parameters themselves.
    fused.parts(x)[0].sum().backward()
    assert weights[0].grad is not None and biases[0].grad is not None
