"""Train the target on the mixture of all traffic domains.

The corpora are small (about 4.5M training tokens), so the target sees each token many times on a
GPU; the loop therefore evaluates every domain's validation loss as it goes and keeps the weights
with the lowest mean (over domains) validation loss, which guards against over-fitting without
guessing the right number of epochs in advance. Batches depend only on (seed, step), so a resumed
run continues exactly where an interrupted one stopped.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from workers.engine.model import ModelConfig, Transformer, build_model
from workers.training.common import (
    Progress,
    TokenStream,
    autocast,
    cosine_lr,
    eval_loss,
    eval_windows,
    load_checkpoint,
    log,
    make_optimizer,
    sample_batch,
    save_checkpoint,
)

DOMAIN_WEIGHTS = {"prose": 0.3, "code": 0.45, "structured": 0.25}


@dataclass
class PretrainConfig:
    # Model: ~12.2M parameters with a 4096-token vocabulary (tied embeddings).
    dim: int = 384
    n_layers: int = 6
    n_heads: int = 6
    ffn_dim: int = 1024
    seq_len: int = 512
    # Optimisation.
    batch_size: int = 64
    steps: int = 3000
    lr: float = 2e-3
    warmup: int = 200
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    domain_weights: dict[str, float] = field(default_factory=lambda: dict(DOMAIN_WEIGHTS))
    # Evaluation and bookkeeping.
    eval_every: int = 250
    eval_tokens: int = 32_768
    checkpoint_every_s: float = 120.0
    # Stop early (keeping the best weights) once this much wall time is spent; 0 = no limit.
    max_seconds: float = 0.0
    seed: int = 0

    def model_config(self, vocab_size: int) -> ModelConfig:
        return ModelConfig(
            vocab_size=vocab_size,
            dim=self.dim,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            n_kv_heads=self.n_heads,
            ffn_dim=self.ffn_dim,
            max_seq_len=self.seq_len,
            tie_embeddings=True,
        )


def _state_to_cpu(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items() if k != "lm_head.weight"
    }


def load_weights(model: Transformer, path: Path) -> Transformer:
    """Load fp32/fp16 weights saved by this module into an existing model (tied head re-linked)."""
    state = load_file(str(path))
    model.load_state_dict({k: v.to(model.dtype) for k, v in state.items()}, strict=False)
    return model


def train_target(
    cfg: PretrainConfig,
    streams: Mapping[str, TokenStream],
    vocab_size: int,
    work: Path,
    device: torch.device,
    resume: bool = True,
    on_best: Callable[[Transformer, dict[str, Any]], None] | None = None,
) -> tuple[Transformer, dict[str, Any]]:
    """Train (or resume) the target in ``work``; return the best model and a recipe/report dict.

    ``streams`` holds "<domain>/train" and "<domain>/validation" token arrays.
    """
    work.mkdir(parents=True, exist_ok=True)
    done_file = work / "done.json"
    model = build_model(cfg.model_config(vocab_size), seed=cfg.seed).to(device)
    if resume and done_file.is_file():
        log(f"[target] already trained in {work}; loading its best weights")
        return load_weights(model, work / "best.safetensors").eval(), json.loads(done_file.read_text())

    train = {d: streams[f"{d}/train"] for d in cfg.domain_weights}
    val = {
        d: eval_windows(streams[f"{d}/validation"], cfg.seq_len, cfg.eval_tokens) for d in cfg.domain_weights
    }
    opt = make_optimizer(model, cfg.lr, cfg.weight_decay)
    state: dict[str, Any] = {"step": 0, "tokens": 0, "wall_s": 0.0, "best": None, "history": []}
    if resume and (meta := load_checkpoint(work, model, opt)) is not None:
        state = meta
        log(f"[target] resumed at step {state['step']} ({state['tokens']:,} tokens)")
    best_state = load_file(str(work / "best.safetensors")) if (work / "best.safetensors").is_file() else None

    log(
        f"[target] {model.num_params():,} parameters on {device}; {cfg.steps} steps of "
        f"{cfg.batch_size}x{cfg.seq_len} tokens"
    )
    progress = Progress("target", cfg.steps)
    model.train()
    t0 = time.perf_counter() - state["wall_s"]
    last_ckpt = time.perf_counter()
    step = state["step"]
    loss_ema: float | None = None
    while step < cfg.steps:
        lr = cosine_lr(step, cfg.steps, cfg.lr, cfg.warmup)
        for g in opt.param_groups:
            g["lr"] = lr
        batch = sample_batch(train, cfg.domain_weights, cfg.batch_size, cfg.seq_len, cfg.seed, step)
        batch = batch.to(device, non_blocking=True)
        with autocast(device):
            logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]  # torch leaves Tensor.backward unannotated
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        step += 1
        state["tokens"] += cfg.batch_size * cfg.seq_len
        last = step == cfg.steps
        out_of_time = cfg.max_seconds > 0 and time.perf_counter() - t0 > cfg.max_seconds
        if step % 25 == 0 or last or out_of_time:
            loss_ema = (
                float(loss.detach()) if loss_ema is None else 0.8 * loss_ema + 0.2 * float(loss.detach())
            )
            wall = time.perf_counter() - t0
            progress.update(step, loss=loss_ema, lr=lr, tok_s=state["tokens"] / max(wall, 1e-9))
        if step % cfg.eval_every == 0 or last or out_of_time:
            losses = {d: round(eval_loss(model, w, device), 4) for d, w in val.items()}
            mean = sum(losses.values()) / len(losses)
            state["history"].append(
                {"step": step, "tokens": state["tokens"], "val": losses, "mean": round(mean, 4)}
            )
            improved = state["best"] is None or mean < state["best"]["mean"]
            log(f"[target] step {step} val {losses} mean {mean:.4f}{' (best)' if improved else ''}")
            if improved:
                state["best"] = {
                    "step": step,
                    "tokens": state["tokens"],
                    "val": losses,
                    "mean": round(mean, 4),
                }
                best_state = _state_to_cpu(model)
                save_file(best_state, str(work / "best.safetensors"))
                if on_best is not None:
                    on_best(model, state["best"])
        state["step"] = step
        state["wall_s"] = time.perf_counter() - t0
        if time.perf_counter() - last_ckpt > cfg.checkpoint_every_s or last or out_of_time:
            save_checkpoint(work, model, opt, state)
            last_ckpt = time.perf_counter()
        if out_of_time:
            log(f"[target] wall-time budget of {cfg.max_seconds:.0f}s spent at step {step}; keeping the best")
            break

    assert best_state is not None
    model.load_state_dict({k: v.to(device) for k, v in best_state.items()}, strict=False)
    report = {
        "config": asdict(cfg),
        "parameters": model.num_params(),
        "steps_run": step,
        "tokens_seen": state["tokens"],
        "wall_s": round(state["wall_s"], 1),
        "best": state["best"],
        "history": state["history"],
        "stopped_early": step < cfg.steps,
    }
    done_file.write_text(json.dumps(report, indent=1))
    return model.eval(), report
