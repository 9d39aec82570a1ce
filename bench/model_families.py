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
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import transformers  # noqa: E402

from tests.engine.family_models import (  # noqa: E402
    NEW_TOKENS,
    PROMPT,
    SEQ,
    TOKENS,
    VARIANTS,
    build_hf,
    hf_greedy,
    noisy_copy,
    write_folder,
)
from workers.engine.decoder import SpeculativeDecoder, greedy_reference  # noqa: E402
from workers.engine.hf_io import load_hf_folder  # noqa: E402
from workers.engine.model import Transformer  # noqa: E402
from workers.engine.proposers import DraftModelProposer  # noqa: E402
from workers.engine.tokenizer import Tokenizer  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "model_families.json"


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
    reference = hf_greedy(hf, prompt, NEW_TOKENS)
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
