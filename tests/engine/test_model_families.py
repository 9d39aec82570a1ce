"""Real model families in the engine: Llama 2/3.x, Qwen2/2.5, Qwen3 and Mistral folders built by
transformers load, run (full, cached and NumPy paths), decode speculatively and save back as the same
family; target and drafter may pad their embeddings differently; tokenizers may differ by trailing
tokens.

Every model is a small random-weight config built locally with transformers' own config classes (no
download) over the reference tokenizer (4096 tokens), with biases and norm weights randomised so that
a bias or q/k norm the engine forgot shows in the logits.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors import safe_open

from tests.engine.family_models import (
    NEW_TOKENS,
    PROMPT,
    REFERENCE_TOKENIZER,
    SEQ,
    TOKENS,
    VARIANTS,
    build_hf,
    hf_greedy,
    noisy_copy,
    write_folder,
)
from workers.engine.decoder import ContextLengthError, SpeculativeDecoder, greedy_reference
from workers.engine.hf_io import load_hf_folder, save_hf_folder
from workers.engine.model import FAMILIES, ModelConfig, Transformer
from workers.engine.proposers import DraftModelProposer
from workers.engine.tokenizer import Tokenizer, TokenizerMismatchError, ensure_same_tokenizer
from workers.engine.verifier import rejection_sample


@dataclass
class Pair:
    name: str
    hf: Any
    target: Transformer
    drafter: Transformer
    tokenizer: Tokenizer
    folder: Path


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Pair:
    name = request.param
    model_type, overrides = VARIANTS[name]
    root = tmp_path_factory.mktemp(name)
    hf = build_hf(model_type, seed=1, **overrides)
    target, tokenizer = load_hf_folder(write_folder(hf, root / "target"))
    drafter, drafter_tokenizer = load_hf_folder(write_folder(noisy_copy(hf, seed=2), root / "drafter"))
    ensure_same_tokenizer(tokenizer, drafter_tokenizer)
    return Pair(name, hf, target, drafter, tokenizer, root / "target")


def test_loaded_config_is_the_family(pair: Pair) -> None:
    model_type, overrides = VARIANTS[pair.name]
    cfg = pair.target.config
    assert cfg.family == model_type and cfg.vocab_size == TOKENS
    assert cfg.tie_embeddings == bool(overrides.get("tie_word_embeddings", False))
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    names = set(pair.target.state_dict())
    assert names == set(pair.hf.state_dict()) | ({"lm_head.weight"} if cfg.tie_embeddings else set())
    if "sliding_window" in overrides:
        # The window is honoured by capping the context there (exact inside it).
        assert cfg.max_seq_len == overrides["sliding_window"]
        with pytest.raises(ContextLengthError):
            SpeculativeDecoder(pair.target, pair.tokenizer).generate([1, 2, 3], cfg.max_seq_len)


def test_logits_match_transformers(pair: Pair) -> None:
    x = torch.randint(0, TOKENS, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        want = pair.hf(x).logits
        torch.testing.assert_close(pair.target(x), want, atol=1e-4, rtol=0)
        # The cached path, incrementally: a prefill, a few single steps, then a verify-sized chunk.
        cache = pair.target.new_cache(2)
        pieces = [pair.target.forward_cached(x[:, :20], cache)]
        pieces += [pair.target.forward_cached(x[:, i : i + 1], cache) for i in range(20, 35)]
        pieces.append(pair.target.forward_cached(x[:, 35:], cache))
        torch.testing.assert_close(torch.cat(pieces, dim=1), want, atol=1e-4, rtol=0)
        # The NumPy step (biases, q/k norms) on the same cache, after a torch prefill.
        pair.target.numpy_step_rows = 5
        try:
            assert pair.target.steps_in_numpy(5)
            cache = pair.target.new_cache(1)
            pair.target.forward_cached(x[:1, :30], cache)
            steps = [pair.target.forward_cached(x[:1, i : i + 1], cache) for i in range(30, 35)]
            steps.append(pair.target.forward_cached(x[:1, 35:], cache))
        finally:
            pair.target.numpy_step_rows = 0
        torch.testing.assert_close(torch.cat(steps, dim=1), want[:1, 30:], atol=1e-4, rtol=0)


def test_greedy_and_speculative_decoding_reproduce_transformers(pair: Pair) -> None:
    prompt = pair.tokenizer.encode(PROMPT)
    want = hf_greedy(pair.hf, prompt, NEW_TOKENS)
    assert greedy_reference(pair.target, prompt, NEW_TOKENS) == want
    plain = SpeculativeDecoder(pair.target, pair.tokenizer)
    assert plain.generate(prompt, NEW_TOKENS, stop_at_eos=False).token_ids == want
    for numpy_rows in (0, 5):  # torch steps, then every step and verify pass in NumPy
        pair.target.numpy_step_rows = pair.drafter.numpy_step_rows = numpy_rows
        try:
            dec = SpeculativeDecoder(pair.target, pair.tokenizer, DraftModelProposer(pair.drafter), k=4)
            result = dec.generate(prompt, NEW_TOKENS, stop_at_eos=False)
        finally:
            pair.target.numpy_step_rows = pair.drafter.numpy_step_rows = 0
        assert result.token_ids == want
        assert 0 < result.metrics.accepted_tokens < result.metrics.drafted_tokens  # both paths exercised


def test_unknown_model_type_is_refused_with_the_supported_families() -> None:
    cfg = ModelConfig(
        vocab_size=TOKENS, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=64
    )
    with pytest.raises(ValueError, match="llama, qwen2, qwen3, mistral") as err:
        ModelConfig.from_hf_dict({**cfg.to_hf_dict(), "model_type": "gemma2"})
    assert "gemma2" in str(err.value)
    assert set(FAMILIES) == {"llama", "qwen2", "qwen3", "mistral"}


def test_family_configs_write_only_their_own_keys() -> None:
    base: dict[str, Any] = {
        "vocab_size": TOKENS,
        "dim": 64,
        "n_layers": 2,
        "n_heads": 4,
        "n_kv_heads": 2,
        "ffn_dim": 128,
        "max_seq_len": 256,
    }
    qwen2 = ModelConfig(**base, family="qwen2")
    assert qwen2.qkv_bias and not qwen2.o_bias and not qwen2.qk_norm
    hf = qwen2.to_hf_dict()
    assert hf["architectures"] == ["Qwen2ForCausalLM"] and hf["model_type"] == "qwen2"
    assert "attention_bias" not in hf and "mlp_bias" not in hf
    qwen3 = ModelConfig(**base, family="qwen3", head_dim=32)
    assert qwen3.qk_norm and not qwen3.qkv_bias
    assert qwen3.to_hf_dict()["attention_bias"] is False
    with pytest.raises(ValueError, match="qwen2 always biases q/k/v"):
        ModelConfig(**base, family="qwen2", attention_bias=True)
    with pytest.raises(ValueError, match="mlp_bias"):
        ModelConfig(**base, family="mistral", mlp_bias=True)
    with pytest.raises(ValueError, match="unsupported model family 'gpt2'"):
        ModelConfig(**base, family="gpt2")
    mistral = ModelConfig(**base, family="mistral", sliding_window=32)
    assert mistral.max_seq_len == 32 and ModelConfig.from_hf_dict(mistral.to_hf_dict()) == mistral


def test_padded_vocabularies_decode_over_the_shared_tokens(tmp_path: Path) -> None:
    """Qwen2.5-0.5B (tied, fewer rows) drafting for Qwen2.5-7B (untied, more rows), in miniature,
    then the other way round. The larger model's padding rows are made to win the argmax, so any
    logit comparison that read past the tokenizer would show."""
    small = build_hf("qwen2", seed=4, tie_word_embeddings=True)
    large = build_hf("qwen2", seed=5, vocab_size=TOKENS + 64)
    with torch.no_grad():
        large.lm_head.weight[TOKENS:] = 4.0 * large.lm_head.weight[:64]
    small_model, tokenizer = load_hf_folder(write_folder(small, tmp_path / "small"))
    large_model, _ = load_hf_folder(write_folder(large, tmp_path / "large"))
    assert large_model.config.vocab_size == TOKENS + 64 and small_model.config.vocab_size == TOKENS
    prompt = tokenizer.encode(PROMPT)
    assert max(greedy_reference(large_model, prompt, NEW_TOKENS)) >= TOKENS  # padding would win
    for target, drafter in ((large_model, small_model), (small_model, large_model)):
        want = greedy_reference(target, prompt, NEW_TOKENS, vocab_size=TOKENS)
        plain = SpeculativeDecoder(target, tokenizer).generate(prompt, NEW_TOKENS, stop_at_eos=False)
        dec = SpeculativeDecoder(target, tokenizer, DraftModelProposer(drafter), k=4)
        assert dec.vocab_size == TOKENS
        assert dec.generate(prompt, NEW_TOKENS, stop_at_eos=False).token_ids == plain.token_ids == want
        g = torch.Generator().manual_seed(0)
        sampled = dec.generate(prompt, NEW_TOKENS, temperature=0.8, generator=g, stop_at_eos=False)
        assert len(sampled.token_ids) == NEW_TOKENS and max(sampled.token_ids) < TOKENS


def test_drafter_without_a_row_for_every_token_is_refused(tmp_path: Path) -> None:
    target, tokenizer = load_hf_folder(write_folder(build_hf("llama", seed=6), tmp_path / "target"))
    short = build_hf("llama", seed=7, vocab_size=4000)
    drafter, _ = load_hf_folder(write_folder(short, tmp_path / "drafter"))
    with pytest.raises(ValueError, match="drafter has 4000 embedding rows and the target 4096"):
        SpeculativeDecoder(target, tokenizer, DraftModelProposer(drafter))


def test_verifier_refuses_distributions_over_different_ids() -> None:
    p, q = torch.full((3, TOKENS + 64), 1.0 / (TOKENS + 64)), torch.full((2, TOKENS), 1.0 / TOKENS)
    with pytest.raises(ValueError, match="cut both to the shared vocabulary"):
        rejection_sample(p, torch.tensor([1, 2]), q)


def test_qwen2_folder_trains_and_saves_back_as_qwen2(tmp_path: Path) -> None:
    source = write_folder(build_hf("qwen2", seed=8), tmp_path / "source")
    model, tokenizer = load_hf_folder(source)
    x = torch.randint(0, TOKENS, (2, SEQ), generator=torch.Generator().manual_seed(9))
    with torch.inference_mode():
        before = model(x)
    # A drafter update: one optimizer step through the training (full) forward.
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
    opt.step()
    model.eval()
    save_hf_folder(model, tokenizer, tmp_path / "saved")

    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["model_type"] == "qwen2"
    assert "attention_bias" not in config
    with (
        safe_open(str(source / "model.safetensors"), "pt") as a,
        safe_open(str(tmp_path / "saved" / "model.safetensors"), "pt") as b,
    ):
        assert set(a.keys()) == set(b.keys())
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved").eval()
    assert type(hf).__name__ == "Qwen2ForCausalLM"
    with torch.inference_mode():
        after = model(x)
        assert not torch.allclose(after, before)
        torch.testing.assert_close(hf(x).logits, after, atol=1e-4, rtol=0)
        again, _ = load_hf_folder(tmp_path / "saved")
        torch.testing.assert_close(again(x), after, atol=0.0, rtol=0.0)


def test_qwen2_biases_survive_the_prepacked_onednn_path(tmp_path: Path) -> None:
    """Wide enough that the fused q/k/v and gate/up products of several rows run on oneDNN's
    prepacked weights (where this torch build has them), where q/k/v carry a bias and gate/up none."""
    hf = build_hf("qwen2", seed=10, hidden_size=256, intermediate_size=512, num_hidden_layers=1)
    model, _ = load_hf_folder(write_folder(hf, tmp_path / "wide"))
    x = torch.randint(0, TOKENS, (1, 24), generator=torch.Generator().manual_seed(11))
    with torch.inference_mode():
        cache = model.new_cache()
        got = torch.cat([model.forward_cached(x[:, :16], cache), model.forward_cached(x[:, 16:], cache)], 1)
        torch.testing.assert_close(got, hf(x).logits, atol=1e-4, rtol=0)


def _reference_tokenizer_spec() -> dict[str, Any]:
    spec: dict[str, Any] = json.loads((REFERENCE_TOKENIZER / "tokenizer.json").read_text())
    return spec


def test_tokenizers_may_differ_by_trailing_tokens_only() -> None:
    base = Tokenizer.from_file(REFERENCE_TOKENIZER)
    spec = _reference_tokenizer_spec()
    spec["added_tokens"].append(
        {
            "id": TOKENS,
            "content": "<|im_start|>",
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
    )
    longer = Tokenizer.from_str(json.dumps(spec))
    assert longer.vocab_size == TOKENS + 1 and longer.fingerprint != base.fingerprint
    ensure_same_tokenizer(longer, base)
    ensure_same_tokenizer(base, longer)

    spec = _reference_tokenizer_spec()
    vocab = spec["model"]["vocab"]
    vocab["ion"], vocab["Ġs"] = vocab["Ġs"], vocab["ion"]  # ids 300 and 301 swapped
    swapped = Tokenizer.from_str(json.dumps(spec))
    with pytest.raises(TokenizerMismatchError) as err:
        ensure_same_tokenizer(base, swapped, "acme/target", "acme/drafter")
    msg = str(err.value)
    assert "id 300" in msg and "'ion'" in msg and "'Ġs'" in msg
    assert "acme/target" in msg and "acme/drafter" in msg
