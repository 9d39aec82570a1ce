"""Draft-head folders: the layout vLLM and SGLang load EAGLE-3 heads from, written and read.

Owns `save_head_folder`, `load_head_folder`, `is_head_folder` and the two configs a head ships:

- ``config.json``: the format vLLM's ``speculators`` package saves and vLLM reads for
  ``{"method": "eagle3"}`` (`speculators_config_dict`): ``speculators_model_type`` "eagle3", the
  decoder layer as a Llama ``transformer_layer_config``, ``draft_vocab_size``,
  ``norm_before_residual`` (always written: vLLM's reader takes True when it is missing),
  ``target_hidden_size``, ``eagle_aux_hidden_state_layer_ids`` (vLLM reads id j as the state
  entering layer j, exactly our ``aux_layers``) and ``speculators_config`` (algorithm, greedy
  proposal of k tokens, the verifier); no top-level ``model_type``, which is how vLLM tells the
  format apart.
- ``config.sglang.json``: SGLang reads no speculators format: its EAGLE-3 loader wants a Llama
  config with ``architectures: ["LlamaForCausalLMEagle3"]`` as the folder's config.json, and reads
  ``eagle_config.eagle_aux_hidden_state_layer_ids`` one layer later than vLLM (id j there is the
  state leaving layer j), so the ids are written minus one (`sglang_config_dict`). A fleet serving
  the head with SGLang uses this file as the draft folder's config.json.

Weights (model.safetensors) use the bare names both loaders map: ``fc.weight``, ``layers.0.*``
(our ``midlayer.*``), ``norm.weight``, ``lm_head.weight``, ``d2t`` (int64 offsets: target id =
draft id + d2t[draft id]) and ``t2d`` (bool). No ``embed_tokens``: both engines take the target's.
The folder also holds the tokenizer (the serving side checks it against the target's).

Checked against: speculators 0.7.0 (vllm-project/speculators c05b95b3), vLLM 0.34.0
(``llama_eagle3.py``, ``transformers_utils/configs/speculators``), SGLang 0.5.23 (``llama_eagle3.py``,
``set_eagle3_layers_to_capture``): `UPSTREAM_CHECKED`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from workers.engine.eagle import EagleHead, HeadConfig, check_head_fits, default_aux_layers
from workers.engine.hf_io import WEIGHTS_NAME, ChecksumMismatchError, sha256_of_file
from workers.engine.model import FAMILIES, Transformer
from workers.engine.tokenizer import Tokenizer

SGLANG_CONFIG_NAME = "config.sglang.json"
UPSTREAM_CHECKED = {
    "speculators": "0.7.0 (github.com/vllm-project/speculators c05b95b303f7)",
    "vllm": "0.34.0",
    "sglang": "0.5.23",
}
SPECULATORS_VERSION = "0.7.0"
# Options of the speculators format this engine does not implement: refused on load, never written true.
_UNSUPPORTED_FLAGS = ("norm_before_fc", "fc_norm", "norm_output")


class HeadFormatError(ValueError):
    """A folder that is not a draft head this engine can serve."""


def is_head_folder(folder: str | Path) -> bool:
    """Whether the folder's config.json is a speculators EAGLE-3 head (else: a model folder)."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        return False
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and "speculators_model_type" in config


def _layer_dict(cfg: HeadConfig, eos_id: int | None) -> dict[str, Any]:
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling,
        "rms_norm_eps": cfg.norm_eps,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        **({"eos_token_id": eos_id, "bos_token_id": eos_id} if eos_id is not None else {}),
    }


def speculators_config_dict(
    cfg: HeadConfig, verifier: str, verifier_architecture: str, k: int, eos_id: int | None = None
) -> dict[str, Any]:
    """The config.json ``speculators`` saves for an EAGLE-3 head (and vLLM reads)."""
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": _layer_dict(cfg, eos_id),
        "draft_vocab_size": cfg.draft_vocab_size,
        "norm_before_residual": cfg.norm_before_residual,
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "embed_requires_grad": False,
        "target_hidden_size": cfg.hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layers),
        "torch_dtype": "float32",
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": k,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": [verifier_architecture]},
        },
    }


def sglang_config_dict(cfg: HeadConfig, eos_id: int | None = None) -> dict[str, Any]:
    """The Llama-style config.json SGLang's ``LlamaForCausalLMEagle3`` loads (ids minus one: SGLang
    captures the state leaving layer j for id j)."""
    if cfg.norm_before_residual:
        raise HeadFormatError(
            "SGLang always adds the un-normed state as the residual: this head cannot run there"
        )
    return {
        **_layer_dict(cfg, eos_id),
        "architectures": ["LlamaForCausalLMEagle3"],
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.hidden_size,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in cfg.aux_layers]},
        "torch_dtype": "float32",
    }


def save_head_folder(
    head: EagleHead,
    tokenizer: Tokenizer,
    folder: str | Path,
    *,
    verifier: str,
    verifier_family: str = "llama",
    k: int = 4,
    metadata: dict[str, str] | None = None,
) -> str:
    """Write the head's folder (see the module doc); returns the sha256 of model.safetensors."""
    if any(i < 1 for i in head.config.aux_layers):
        raise HeadFormatError("a head reading the embeddings themselves (layer 0) has no SGLang form")
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    state: dict[str, torch.Tensor] = {}
    for name, t in head.state_dict().items():
        stored = "layers.0." + name.removeprefix("midlayer.") if name.startswith("midlayer.") else name
        dtype = t.dtype if name in ("d2t", "t2d") else torch.float32
        state[stored] = t.detach().to("cpu", dtype).contiguous()
    weights = out / WEIGHTS_NAME
    save_file(state, str(weights), metadata={"format": "pt", **(metadata or {})})
    eos = tokenizer.eos_id
    arch = FAMILIES.get(verifier_family, "LlamaForCausalLM")
    (out / "config.json").write_text(
        json.dumps(speculators_config_dict(head.config, verifier, arch, k, eos), indent=2) + "\n"
    )
    (out / SGLANG_CONFIG_NAME).write_text(json.dumps(sglang_config_dict(head.config, eos), indent=2) + "\n")
    tokenizer.save(out / "tokenizer.json")
    tok_cfg: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": head.config.max_seq_len,
    }
    if tokenizer.eos_token is not None:
        tok_cfg.update(eos_token=tokenizer.eos_token, bos_token=tokenizer.eos_token)
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    return sha256_of_file(weights)


def head_config_from_speculators(config: dict[str, Any], target_layers: int) -> HeadConfig:
    """Our HeadConfig from a speculators EAGLE-3 config.json, refusing what this engine does not run."""
    if config.get("speculators_model_type") != "eagle3":
        raise HeadFormatError(
            f"speculators_model_type {config.get('speculators_model_type')!r}: only eagle3 heads"
        )
    on = [flag for flag in _UNSUPPORTED_FLAGS if config.get(flag)]
    if on:
        raise HeadFormatError(f"this engine does not implement the head options {on}")
    layer = config.get("transformer_layer_config") or {}
    if layer.get("model_type") != "llama" or int(layer.get("num_hidden_layers", 1)) != 1:
        raise HeadFormatError("only one-layer Llama heads are served")
    hidden = int(layer["hidden_size"])
    if config.get("target_hidden_size") not in (None, hidden):
        raise HeadFormatError("a head narrower than its target (target_hidden_size) is not served")
    ids = config.get("eagle_aux_hidden_state_layer_ids") or default_aux_layers(target_layers)
    return HeadConfig(
        hidden_size=hidden,
        intermediate_size=int(layer["intermediate_size"]),
        n_heads=int(layer["num_attention_heads"]),
        n_kv_heads=int(layer.get("num_key_value_heads") or layer["num_attention_heads"]),
        head_dim=int(layer.get("head_dim") or hidden // int(layer["num_attention_heads"])),
        vocab_size=int(layer["vocab_size"]),
        draft_vocab_size=int(config.get("draft_vocab_size") or layer["vocab_size"]),
        aux_layers=tuple(int(i) for i in ids),
        max_seq_len=int(layer.get("max_position_embeddings", 2048)),
        rope_theta=float(layer.get("rope_theta", 10000.0)),
        norm_eps=float(layer.get("rms_norm_eps", 1e-5)),
        rope_scaling=layer.get("rope_scaling"),
        # vLLM's reading: a config without the key means True.
        norm_before_residual=bool(config.get("norm_before_residual", True)),
    )


def load_head_folder(
    folder: str | Path,
    target: Transformer,
    expected_sha256: str | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[EagleHead, Tokenizer]:
    """Load a head for ``target`` (its embeddings shared) as (head in eval mode, tokenizer)."""
    path = Path(folder)
    weights = path / WEIGHTS_NAME
    if not weights.is_file():
        raise FileNotFoundError(f"no {WEIGHTS_NAME} in {path} (heads load from safetensors only)")
    if expected_sha256 is not None and (actual := sha256_of_file(weights)) != expected_sha256:
        raise ChecksumMismatchError(f"{weights} has sha256 {actual}, expected {expected_sha256}")
    cfg = head_config_from_speculators(json.loads((path / "config.json").read_text()), target.config.n_layers)
    cfg.max_seq_len = min(cfg.max_seq_len, target.config.max_seq_len)
    state: dict[str, torch.Tensor] = {}
    with safe_open(str(weights), framework="pt", device="cpu") as sf:
        for name in sf.keys():
            t = sf.get_tensor(name)
            if name == "embed_tokens.weight":
                if not torch.equal(t.to(target.dtype), target.model.embed_tokens.weight.detach().cpu()):
                    raise HeadFormatError(
                        f"{path}: its embeddings are not this target's: a head for another model"
                    )
                continue
            key = "midlayer." + name.removeprefix("layers.0.") if name.startswith("layers.0.") else name
            state[key] = t if key in ("d2t", "t2d") else t.to(dtype)
    draft_ids = None
    if "d2t" in state:
        draft_ids = torch.arange(cfg.draft_vocab_size) + state["d2t"].long()
    else:
        state["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.long)
    head = EagleHead(cfg, target.model.embed_tokens.weight, draft_ids)
    if "t2d" not in state:
        state["t2d"] = head.t2d
    missing, unexpected = head.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise HeadFormatError(
            f"{path} is not an EAGLE-3 head: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    check_head_fits(cfg, target.config)
    tokenizer = Tokenizer.from_file(path)
    return head.to(device=target.device, dtype=dtype).eval(), tokenizer
