"""Tiny models and a tiny tokenizer for the engine tests: random weights, fixed seeds, seconds to build.

Helpers are exposed as fixtures (factories where they take arguments) rather than importable
functions, so the tests need no package path tricks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from workers.engine.model import ModelConfig, Transformer, build_model
from workers.engine.tokenizer import Tokenizer, train_bpe

CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n",
    "SELECT name, total FROM orders WHERE total > 10 ORDER BY total DESC;",
    "Speculative decoding drafts tokens with a small model and verifies them with a large one.",
    "héllo wörld, naïve café — unicode survives byte-level BPE ✓",
]
VOCAB = 320

ConfigFactory = Callable[..., ModelConfig]
CopyFactory = Callable[[Transformer, float, int], Transformer]
PromptFactory = Callable[..., list[list[int]]]


def _tiny_config(**kw: Any) -> ModelConfig:
    base: dict[str, Any] = {
        "vocab_size": VOCAB,
        "dim": 64,
        "n_layers": 2,
        "n_heads": 4,
        "n_kv_heads": 2,
        "ffn_dim": 128,
        "max_seq_len": 256,
    }
    base.update(kw)
    return ModelConfig(**base)


def _peaked(model: Transformer, scale: float = 6.0) -> Transformer:
    """Scale weights up so logits are spread out: random 0.02-std weights give near-ties that float
    rounding between a 1-token and a (k+1)-token forward could flip, which no engine guarantees."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(scale)
    return model.eval()


def _noisy_copy(model: Transformer, noise: float, seed: int) -> Transformer:
    """A drafter that agrees with the target often but not always (noise is relative to each
    tensor's std; 0.05 gives a hit rate near 40% at k = 4 on these models)."""
    copy = build_model(model.config, seed=seed)
    copy.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in copy.named_parameters():
            if "norm" not in name:
                p.add_(torch.randn(p.shape, generator=g) * noise * p.std())
    return copy.eval()


def _prompts(n: int, vocab_size: int = VOCAB, seed: int = 0) -> list[list[int]]:
    """Random prompts; every other one repeats a snippet so n-gram lookup finds matches."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(4, 24, (1,), generator=g))
        ids = torch.randint(1, vocab_size, (length,), generator=g).tolist()
        if i % 2:
            ids = ids + ids[: max(3, length // 2)]
        out.append(ids)
    return out


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    return train_bpe(CORPUS * 4, vocab_size=VOCAB)


@pytest.fixture(scope="session")
def tiny_config() -> ConfigFactory:
    return _tiny_config


@pytest.fixture(scope="session")
def noisy_copy() -> CopyFactory:
    return _noisy_copy


@pytest.fixture(scope="session")
def make_prompts() -> PromptFactory:
    return _prompts


@pytest.fixture(scope="session")
def target() -> Transformer:
    return _peaked(build_model(_tiny_config(), seed=0))


@pytest.fixture(scope="session")
def drafter(target: Transformer) -> Transformer:
    return _noisy_copy(target, 0.05, 1)


@pytest.fixture(scope="session", autouse=True)
def _one_thread() -> Iterator[None]:
    # Tiny models gain nothing from intra-op threads, and on a shared 2-core machine the OpenMP
    # spin-waits of a second thread make each op slower by an order of magnitude under load.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
