"""Draft-head folders: the layout and configs vLLM and SGLang load, field for field, and loading back.

The expected names and fields are those recorded from the upstream loaders (speculators 0.7.0's
Eagle3SpeculatorConfig and Eagle3DraftModel, vLLM 0.34.0's llama_eagle3.py and speculators config
reader, SGLang 0.5.23's llama_eagle3.py), written out here rather than read from our own module.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from workers.engine.eagle import EagleHead, HeadConfig, head_for_target
from workers.engine.head_io import (
    SGLANG_CONFIG_NAME,
    UPSTREAM_CHECKED,
    HeadFormatError,
    is_head_folder,
    load_head_folder,
    save_head_folder,
)
from workers.engine.hf_io import ChecksumMismatchError
from workers.engine.model import Transformer, build_model
from workers.engine.tokenizer import Tokenizer

# speculators' Eagle3DraftModel state dict as saved (bare names; layer 0 of the decoder stack).
UPSTREAM_TENSORS = {
    "fc.weight",
    "layers.0.input_layernorm.weight",
    "layers.0.hidden_norm.weight",
    "layers.0.self_attn.q_proj.weight",
    "layers.0.self_attn.k_proj.weight",
    "layers.0.self_attn.v_proj.weight",
    "layers.0.self_attn.o_proj.weight",
    "layers.0.post_attention_layernorm.weight",
    "layers.0.mlp.gate_proj.weight",
    "layers.0.mlp.up_proj.weight",
    "layers.0.mlp.down_proj.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
}
# Eagle3SpeculatorConfig's fields (plus the base SpeculatorModelConfig's) that vLLM's reader uses.
UPSTREAM_SPECULATORS_KEYS = {
    "architectures",
    "speculators_model_type",
    "speculators_version",
    "transformer_layer_config",
    "draft_vocab_size",
    "norm_before_residual",
    "target_hidden_size",
    "eagle_aux_hidden_state_layer_ids",
    "norm_before_fc",
    "fc_norm",
    "norm_output",
    "speculators_config",
}


def _head(target: Transformer) -> EagleHead:
    ids = torch.tensor(sorted(torch.randperm(target.config.vocab_size)[:96].tolist()))
    torch.manual_seed(0)
    return head_for_target(target, HeadConfig.for_target(target.config, 96), ids).eval()


def test_the_folder_matches_the_upstream_layout(
    target: Transformer, tokenizer: Tokenizer, tmp_path: Path
) -> None:
    head = _head(target)
    save_head_folder(head, tokenizer, tmp_path, verifier="acme/target-7b", k=4)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as sf:
        names = set(sf.keys())
        tensors = {n: sf.get_tensor(n) for n in names}
    assert names == UPSTREAM_TENSORS  # no embed_tokens: both engines take the target's
    d, cfg = target.config.dim, head.config
    assert tensors["fc.weight"].shape == (d, len(cfg.aux_layers) * d)
    assert tensors["layers.0.self_attn.q_proj.weight"].shape == (cfg.n_heads * cfg.head_dim, 2 * d)
    assert tensors["lm_head.weight"].shape == (96, d)
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    # d2t holds offsets: target id = draft id + d2t[draft id] (vLLM's compute_logits, SGLang's hot ids).
    assert torch.equal(torch.arange(96) + tensors["d2t"], head.draft_ids)
    assert int(tensors["t2d"].sum()) == 96 and tensors["t2d"].shape == (target.config.vocab_size,)

    config = json.loads((tmp_path / "config.json").read_text())
    assert UPSTREAM_SPECULATORS_KEYS <= set(config)
    assert "model_type" not in config  # how vLLM tells a speculators config apart
    assert config["speculators_model_type"] == "eagle3" and config["architectures"] == ["Eagle3Speculator"]
    assert config["norm_before_residual"] is False  # written: vLLM's reader defaults a missing key to True
    assert not (config["norm_before_fc"] or config["fc_norm"] or config["norm_output"])
    layer = config["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == 1
    assert (layer["hidden_size"], layer["vocab_size"]) == (d, target.config.vocab_size)
    assert config["draft_vocab_size"] == 96 and config["target_hidden_size"] == d
    assert config["eagle_aux_hidden_state_layer_ids"] == list(cfg.aux_layers)  # vLLM: state entering layer j
    spec = config["speculators_config"]
    assert spec["algorithm"] == "eagle3" and spec["default_proposal_method"] == "greedy"
    assert spec["proposal_methods"][0]["proposal_type"] == "greedy"
    assert spec["proposal_methods"][0]["speculative_tokens"] == 4
    assert spec["verifier"] == {"name_or_path": "acme/target-7b", "architectures": ["LlamaForCausalLM"]}

    sglang = json.loads((tmp_path / SGLANG_CONFIG_NAME).read_text())
    assert sglang["architectures"] == ["LlamaForCausalLMEagle3"] and sglang["model_type"] == "llama"
    assert sglang["draft_vocab_size"] == 96 and sglang["num_hidden_layers"] == 1
    # SGLang captures the state leaving layer j for id j: one less than ours.
    assert sglang["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in cfg.aux_layers]
    assert set(UPSTREAM_CHECKED) == {"speculators", "vllm", "sglang"}


def test_a_saved_head_loads_back_and_drafts_the_same(
    target: Transformer, tokenizer: Tokenizer, tmp_path: Path
) -> None:
    head = _head(target)
    sha = save_head_folder(head, tokenizer, tmp_path, verifier="t")
    assert is_head_folder(tmp_path)
    loaded, tok = load_head_folder(tmp_path, target, expected_sha256=sha)
    assert tok.fingerprint == tokenizer.fingerprint
    states = torch.randn(1, 5, target.config.dim)
    tokens = torch.randint(0, target.config.vocab_size, (1, 5))
    with torch.inference_mode():
        want = head.logits(head.forward_cached(states, tokens, head.new_cache()))
        got = loaded.logits(loaded.forward_cached(states, tokens, loaded.new_cache()))
    torch.testing.assert_close(got, want)
    assert torch.equal(loaded.draft_ids, head.draft_ids)
    with pytest.raises(ChecksumMismatchError):
        load_head_folder(tmp_path, target, expected_sha256="0" * 64)


def test_heads_this_engine_cannot_serve_are_refused(
    target: Transformer, tokenizer: Tokenizer, tiny_config: object, tmp_path: Path
) -> None:
    save_head_folder(_head(target), tokenizer, tmp_path, verifier="t")
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "norm_output": True}))
    with pytest.raises(HeadFormatError, match="norm_output"):
        load_head_folder(tmp_path, target)
    (tmp_path / "config.json").write_text(json.dumps(config))
    other = build_model(target.config, seed=9)  # same shape, other weights: not this head's target
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as sf:
        state = {n: sf.get_tensor(n) for n in sf.keys()}
    from safetensors.torch import save_file

    save_file(
        {**state, "embed_tokens.weight": other.model.embed_tokens.weight.detach()},
        str(tmp_path / "model.safetensors"),
    )
    with pytest.raises(HeadFormatError, match="another model"):
        load_head_folder(tmp_path, target)
    assert not is_head_folder(tmp_path / "missing")
