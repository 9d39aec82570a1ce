"""A deployment's first drafter, built from its own target before any realignment.

``narrow_drafter_from_target`` is the default: a small model (two layers, a fraction of the
target's width) whose token embeddings and tied LM head are the target's embeddings projected onto
their leading principal directions, its layers freshly initialised; realignment then distils it on
the deployment's traces. Measured on the reference target (structured traffic, 512 traces, the
same realignment): 62.4% hit at k=4 for 0.075 of a target step, where the cut below reached
53-57% for 0.27-0.33, which its canary could not tell from no speculation.

The cut: a target with no drafter gets one cut from itself: the same tokenizer (nothing to align), the
target's token embeddings, its first ``n`` decoder layers, its final norm and its LM head. With
``n`` layers out of ``L`` such a drafter already proposes what a shallow exit of the target would
(early-exit self-speculation, as in LayerSkip / Draft&Verify), and the realignment that follows
(``workers.training.realign``) distils it on the deployment's traces like any incumbent.

``n`` is the largest count whose decode step costs at most ``max_cost_fraction`` of the target's
(counted in weights read per token: ``n`` layers plus the LM head against ``L`` layers plus the
head), and at least one layer. The embedding lookup reads one row, so it costs nothing here.

``random_drafter_like`` is the same architecture freshly initialised: what the copy is measured
against (``bench/drafters_day0.py``).
"""

from __future__ import annotations

import copy
from dataclasses import replace

import torch

from workers.engine.model import ModelConfig, Transformer

# A first drafter should cost a small fraction of a target step: speculation pays only when the
# hit rate is well above the cost ratio (DESIGN.md, "Numbers that decide").
DEFAULT_MAX_COST_FRACTION = 0.25
# The narrow drafter's budget: a generic drafter's share of its target (the bundled pair: 0.075).
NARROW_MAX_COST_FRACTION = 0.08
NARROW_LAYERS = 2
NARROW_HEAD_DIM = 32
# A first drafter knows nothing of the traffic and its data is a few hundred traces: more passes
# over them than a realignment's cap pay (measured: 10 epochs 57.0% hit, 40 epochs 62.4%).
FIRST_DRAFTER_MAX_EPOCHS = 40.0


def _layer_weights(cfg: ModelConfig) -> int:
    """Weights one decoder layer reads per token: q, k, v, o projections and the gated MLP."""
    q_and_o = 2 * cfg.dim * cfg.n_heads * cfg.hd
    k_and_v = 2 * cfg.dim * cfg.n_kv_heads * cfg.hd
    mlp = 3 * cfg.dim * cfg.ffn_dim
    return q_and_o + k_and_v + mlp


def step_weights(cfg: ModelConfig) -> int:
    """Weights a decode step of this model reads per token: its layers and its LM head."""
    return cfg.n_layers * _layer_weights(cfg) + cfg.vocab_size * cfg.dim


def cost_fraction(cfg: ModelConfig, n_layers: int) -> float:
    """The decode-step cost of an ``n_layers`` cut of the target relative to the whole target."""
    head = cfg.vocab_size * cfg.dim
    layer = _layer_weights(cfg)
    return (n_layers * layer + head) / (cfg.n_layers * layer + head)


def choose_layers(cfg: ModelConfig, max_cost_fraction: float = DEFAULT_MAX_COST_FRACTION) -> int:
    """The most leading layers whose step costs at most ``max_cost_fraction`` of the target's
    (at least 1, and fewer than the target has when it has more than one)."""
    most = max(1, cfg.n_layers - 1)
    n = 1
    while n < most and cost_fraction(cfg, n + 1) <= max_cost_fraction:
        n += 1
    return n


def narrow_config(
    target_cfg: ModelConfig, max_cost_fraction: float = NARROW_MAX_COST_FRACTION
) -> ModelConfig:
    """Two layers as wide as the cost allows: the widest multiple of 32 between 64 and half the
    target's width whose step (layers plus a tied head, in weights read per token) costs at most
    ``max_cost_fraction`` of the target's; 64 when none does; the target's width when it is 64 or
    less."""
    if target_cfg.dim <= 64:  # nothing narrower is worth having: two layers of the target's width
        return _narrow(target_cfg, target_cfg.dim)
    target_cost = step_weights(target_cfg)
    best = 64
    for dim in range(64, max(64, target_cfg.dim // 2) + 1, NARROW_HEAD_DIM):
        if step_weights(_narrow(target_cfg, dim)) <= max_cost_fraction * target_cost:
            best = dim
    return _narrow(target_cfg, best)


def _narrow(target_cfg: ModelConfig, dim: int) -> ModelConfig:
    # Heads of 32 wide; a width that 32 does not divide is the target's own, with its head count.
    heads = dim // NARROW_HEAD_DIM if dim % NARROW_HEAD_DIM == 0 else target_cfg.n_heads
    ffn = -(-dim * 8 // 3 // 8) * 8  # Llama's 8/3 ratio, a multiple of 8
    return ModelConfig(
        vocab_size=target_cfg.vocab_size,
        dim=dim,
        n_layers=NARROW_LAYERS,
        n_heads=heads,
        n_kv_heads=heads,
        ffn_dim=ffn,
        max_seq_len=target_cfg.max_seq_len,
        rope_theta=target_cfg.rope_theta,
        norm_eps=target_cfg.norm_eps,
        tie_embeddings=True,
        rope_scaling=copy.deepcopy(target_cfg.rope_scaling),
        bos_token_id=target_cfg.bos_token_id,
        eos_token_id=target_cfg.eos_token_id,
    )


def narrow_drafter_from_target(
    target: Transformer, max_cost_fraction: float = NARROW_MAX_COST_FRACTION, seed: int = 0
) -> Transformer:
    """A float32 ``narrow_config`` drafter on the target's device: layers from ``seed``, token
    embeddings (tied to the head) the target's input embeddings times their leading principal
    directions, so tokens the target places together start together. The target is only read."""
    cfg = narrow_config(target.config, max_cost_fraction)
    torch.manual_seed(seed)
    drafter = Transformer(cfg).to(device=target.device, dtype=torch.float32)
    with torch.no_grad():
        table = target.model.embed_tokens.weight.detach().float()  # [V, D_target]
        centred = table - table.mean(0)
        # eigh of the D x D covariance, not an SVD of the V x D table: a 128k vocabulary stays cheap.
        _, vectors = torch.linalg.eigh(centred.T @ centred)  # ascending eigenvalues
        directions = vectors[:, -cfg.dim :].flip(-1)  # [D_target, dim], leading first
        drafter.model.embed_tokens.weight.copy_(table @ directions)
    drafter.invalidate_fast_path()
    return drafter


def drafter_config(target_cfg: ModelConfig, n_layers: int) -> ModelConfig:
    """The target's config cut to ``n_layers`` (a Qwen window's first layer kept in range)."""
    cfg = copy.deepcopy(target_cfg)
    window_from = cfg.max_window_layers
    if window_from is not None:
        window_from = min(window_from, n_layers)
    return replace(cfg, n_layers=n_layers, max_window_layers=window_from)


def first_drafter_from_target(
    target: Transformer, n_layers: int | None = None, max_cost_fraction: float = DEFAULT_MAX_COST_FRACTION
) -> Transformer:
    """A float32 drafter on the target's device: the target's embeddings, first ``n_layers``
    decoder layers (``choose_layers`` when None), final norm and LM head. The target is only read."""
    n = n_layers if n_layers is not None else choose_layers(target.config, max_cost_fraction)
    if not 1 <= n <= target.config.n_layers:
        raise ValueError(f"a first drafter needs 1 to {target.config.n_layers} layers, got {n}")
    drafter = Transformer(drafter_config(target.config, n)).to(device=target.device, dtype=torch.float32)
    source = target.state_dict()
    wanted = drafter.state_dict()
    missing = [name for name in wanted if name not in source]
    if missing:
        raise ValueError(f"the target has no weights for {missing[:5]}")
    with torch.no_grad():
        for name, tensor in wanted.items():
            tensor.copy_(source[name].to(device=tensor.device, dtype=torch.float32))
    drafter.invalidate_fast_path()
    return drafter


def random_drafter_like(target: Transformer, n_layers: int, seed: int = 0) -> Transformer:
    """The same architecture as ``first_drafter_from_target(target, n_layers)``, randomly
    initialised (the baseline the copy is measured against)."""
    torch.manual_seed(seed)
    return Transformer(drafter_config(target.config, n_layers)).to(device=target.device, dtype=torch.float32)
