"""Small random-weight models of every family the engine runs, built with `transformers`' own
config and model classes (no download), and written as Hugging Face folders with the reference
tokenizer: shared by the family parity tests and bench/model_families.py."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
import transformers

REFERENCE_TOKENIZER = Path(__file__).resolve().parents[2] / "workers" / "models" / "reference" / "target"
TOKENS = 4096  # the reference tokenizer's size
PROMPT = "def add(a, b):\n    return a + b\n\nSELECT name FROM"
NEW_TOKENS = 20
SEQ = 40  # parity sequences; inside the Mistral variant's 48-token window

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,  # small, so the rescaling bends frequencies at this size
}
# name -> (model_type, config overrides). Llama's biases ride on the llama3 variant so that the
# all-four-projections bias (Llama semantics) is covered next to Qwen2's q/k/v-only one.
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama3-rope": ("llama", {"rope_scaling": LLAMA3_ROPE, "attention_bias": True, "mlp_bias": True}),
    "qwen2": ("qwen2", {}),
    "qwen2-window": ("qwen2", {"use_sliding_window": True, "sliding_window": 48, "max_window_layers": 1}),
    "qwen3": ("qwen3", {"head_dim": 32}),  # head_dim != hidden / heads, as in real Qwen3 configs
    "mistral": ("mistral", {"sliding_window": 48}),
}
HF_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
}


def build_hf(model_type: str, seed: int, vocab_size: int = TOKENS, **overrides: Any) -> Any:
    """A random-weight transformers model of the family: hidden 64, 2 layers, 4 heads, 2 kv heads."""
    kwargs: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "rope_theta": 500.0,
        "rms_norm_eps": 1e-6,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "tie_word_embeddings": False,
        **overrides,
    }
    config_cls, model_cls = HF_CLASSES[model_type]
    config = getattr(transformers, config_cls)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    randomise(model, seed)
    return model


def randomise(model: torch.nn.Module, seed: int) -> None:
    """Biases and norm weights away from transformers' zeros and ones; weights spread enough that
    greedy choices are far from ties."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.3 * noise)
            else:
                p.copy_(0.1 * noise)


def noisy_copy(hf: Any, seed: int, noise: float = 0.1) -> Any:
    """Same family and shape, weights perturbed: a drafter that agrees with the target often."""
    copy = type(hf)(hf.config).eval()
    copy.load_state_dict(hf.state_dict())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in copy.parameters():
            p.add_(torch.randn(p.shape, generator=g) * noise * p.std())
    return copy


def write_folder(hf: Any, folder: Path) -> Path:
    hf.save_pretrained(folder, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(REFERENCE_TOKENIZER / name, folder / name)
    return folder


def hf_greedy(hf: Any, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]
