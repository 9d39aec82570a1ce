"""Parity of the engine with transformers on every model family it runs (llama, qwen2, qwen3, mistral).

For each family (and the variants that exercise its distinct features: tied embeddings, Llama 3.x
rotary rescaling with Llama's biases, a Qwen2 sliding window), a small random-weight model is built
with transformers' own config class (no download), saved as an HF folder with the reference
tokenizer and loaded with `load_hf_folder`. Reported: the largest absolute logit difference from
transformers in float32 over the full forward, the cached incremental path and the NumPy step, and
whether greedy decoding (plain, and speculative with a same-family drafter) reproduces transformers'
greedy tokens exactly.

Prints a table and writes bench/results/model_families.json.

Usage: .venv/bin/python bench/model_families.py
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import transformers  # noqa: E402

from workers.engine.decoder import SpeculativeDecoder, greedy_reference  # noqa: E402
from workers.engine.hf_io import load_hf_folder  # noqa: E402
from workers.engine.model import Transformer  # noqa: E402
from workers.engine.proposers import DraftModelProposer  # noqa: E402
from workers.engine.tokenizer import Tokenizer  # noqa: E402

REFERENCE_TOKENIZER = ROOT / "workers" / "models" / "reference" / "target"
RESULTS = ROOT / "bench" / "results" / "model_families.json"
TOKENS = 4096  # the reference tokenizer's size
PROMPT = "def add(a, b):\n    return a + b\n\nSELECT name FROM"
NEW_TOKENS = 20
SEQ = 40  # inside the 48-token windows below

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
# name -> (model_type, config overrides); each family's plain variant carries the family's name.
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama3-rope": ("llama", {"rope_scaling": LLAMA3_ROPE, "attention_bias": True, "mlp_bias": True}),
    "qwen2": ("qwen2", {}),
    "qwen2-window": ("qwen2", {"use_sliding_window": True, "sliding_window": 48, "max_window_layers": 1}),
    "qwen3": ("qwen3", {"head_dim": 32}),
    "mistral": ("mistral", {"sliding_window": 48}),
}
HF_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
}


def build_hf(model_type: str, seed: int, vocab_size: int = TOKENS, **overrides: Any) -> Any:
    """A random-weight transformers model of the family: hidden 64, 2 layers, 4 heads, 2 kv heads,
    biases and norm weights away from transformers' zeros and ones (so a missed one shows)."""
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
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**kwargs)).eval()
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
    return model


def noisy_copy(hf: Any, seed: int, noise: float = 0.1) -> Any:
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


def _hf_greedy(hf: Any, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def _cached_logits(model: Transformer, x: torch.Tensor, numpy_rows: int) -> torch.Tensor:
    """Logits of x through the cached path: a prefill, single steps, then a 5-row chunk."""
    model.numpy_step_rows = numpy_rows
    try:
        cache = model.new_cache(x.shape[0])
        pieces = [model.forward_cached(x[:, :20], cache)]
        pieces += [model.forward_cached(x[:, i : i + 1], cache) for i in range(20, SEQ - 5)]
        pieces.append(model.forward_cached(x[:, SEQ - 5 :], cache))
    finally:
        model.numpy_step_rows = 0
    return torch.cat(pieces, dim=1)


def _measure(model_type: str, overrides: dict[str, Any], root: Path, seed: int) -> dict[str, Any]:
    # Built and loaded outside inference mode: parameters created inside it are inference tensors,
    # which have no version counter for the cached path's packed weights to follow.
    hf = build_hf(model_type, seed=seed, **overrides)
    target, tokenizer = load_hf_folder(write_folder(hf, root / "target"))
    drafter, _ = load_hf_folder(write_folder(noisy_copy(hf, seed=seed + 1), root / "drafter"))
    with torch.inference_mode():
        return _compare(model_type, hf, target, drafter, tokenizer)


def _compare(
    model_type: str, hf: Any, target: Transformer, drafter: Transformer, tokenizer: Tokenizer
) -> dict[str, Any]:
    x = torch.randint(0, TOKENS, (1, SEQ), generator=torch.Generator().manual_seed(3))
    want = hf(x).logits
    diffs = {
        "full": float((target(x) - want).abs().max()),
        "cached": float((_cached_logits(target, x, 0) - want).abs().max()),
        "numpy": float((_cached_logits(target, x, 5) - want).abs().max()),
    }
    prompt = tokenizer.encode(PROMPT)
    reference = _hf_greedy(hf, prompt, NEW_TOKENS)
    plain = greedy_reference(target, prompt, NEW_TOKENS)
    decoder = SpeculativeDecoder(target, tokenizer, DraftModelProposer(drafter), k=4)
    speculative = decoder.generate(prompt, NEW_TOKENS, stop_at_eos=False)
    metrics = speculative.metrics
    return {
        "family": model_type,
        "max_abs_diff": max(diffs.values()),
        "max_abs_diff_by_path": diffs,
        "greedy_identical": plain == reference and speculative.token_ids == reference,
        "speculative_acceptance": metrics.accepted_tokens / max(1, metrics.drafted_tokens),
        "context": target.config.max_seq_len,
    }


def parity_report() -> dict[str, Any]:
    """{"families": [...], "per_family": {name: {"max_abs_diff", "greedy_identical", ...}},
    "parity_max_abs_diff": the largest difference over all of them}."""
    per_family: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, (model_type, overrides)) in enumerate(VARIANTS.items()):
            per_family[name] = _measure(model_type, overrides, Path(tmp) / name, seed=1 + 2 * i)
    return {
        "families": list(per_family),
        "per_family": per_family,
        "parity_max_abs_diff": max(entry["max_abs_diff"] for entry in per_family.values()),
    }


def main() -> None:
    torch.set_num_threads(1)  # tiny models; parity does not depend on the thread count
    report = parity_report()
    report["versions"] = {"torch": torch.__version__, "transformers": transformers.__version__}
    print(f"{'variant':<14} {'family':<8} {'full':>9} {'cached':>9} {'numpy':>9} {'greedy':>7} {'accept':>7}")
    for name, entry in report["per_family"].items():
        d = entry["max_abs_diff_by_path"]
        print(
            f"{name:<14} {entry['family']:<8} {d['full']:9.2e} {d['cached']:9.2e} {d['numpy']:9.2e} "
            f"{'same' if entry['greedy_identical'] else 'DIFF':>7} {entry['speculative_acceptance']:7.2f}"
        )
    print(f"max abs logit difference over all families: {report['parity_max_abs_diff']:.2e}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
