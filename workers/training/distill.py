"""Distil a drafter from the target on the target's own continuations of prompts.

Two steps, as vendors build a generic drafter: (1) let the target continue many prompts (batched
KV-cache generation, so traces cost a fraction of batch-1 decoding); (2) train the small drafter to
match the target's next-token distribution on those traces (forward KL on the target's logits,
recomputed on the fly, which carries far more signal per token than the sampled token alone).
A drafter trained on raw text instead of the target's outputs hits poorly everywhere (see
shared/FEASIBILITY.md), which is why the traces, not the corpus, are the training data.

The reference build feeds only prose prompts, which makes the "generic" drafter; the same functions
distil a drafter tuned to any traffic.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from workers.engine.model import ModelConfig, Transformer, build_model
from workers.training.common import (
    Progress,
    TokenStream,
    autocast,
    cosine_lr,
    eval_windows,
    load_checkpoint,
    log,
    make_optimizer,
    save_checkpoint,
    shared_vocab_size,
)


@dataclass
class TraceConfig:
    # Up to 448 positions: the bench's prompts (<= ~250 tokens) plus 128 new tokens stay inside what
    # the drafter was trained on (rotary positions it never saw would cost acceptance).
    prompt_lens: tuple[int, ...] = (32, 96, 192, 320)
    gen_len: int = 128
    sequences: int = 4096
    batch_size: int = 256
    # Greedy traces match what greedy serving asks of the drafter; a share of sampled ones widens
    # the contexts it sees (the target's own distribution, not the corpus's).
    sampled_share: float = 0.25
    temperature: float = 0.8
    seed: int = 1


@dataclass
class DistillConfig:
    dim: int = 128
    n_layers: int = 2
    n_heads: int = 4
    ffn_dim: int = 344
    batch_size: int = 64
    steps: int = 1500
    lr: float = 3e-3
    warmup: int = 100
    weight_decay: float = 0.05
    grad_clip: float = 1.0
    # Share of trace rows held out to report the drafter's agreement with the target.
    holdout_share: float = 0.05
    eval_every: int = 250
    checkpoint_every_s: float = 120.0
    max_seconds: float = 0.0
    seed: int = 2
    # "kl": forward KL on the target's logits (recomputed per batch; the richer signal, cheap on a GPU);
    # "ce": cross-entropy on the trace tokens (no target forward: ~10x cheaper per step on a CPU).
    loss: str = "kl"
    extra: dict[str, Any] = field(default_factory=dict)

    def model_config(self, vocab_size: int, max_seq_len: int) -> ModelConfig:
        return ModelConfig(
            vocab_size=vocab_size,
            dim=self.dim,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            n_kv_heads=self.n_heads,
            ffn_dim=self.ffn_dim,
            max_seq_len=max_seq_len,
            tie_embeddings=True,
        )


# ---------------------------------------------------------------------------------------------- traces


@torch.no_grad()
def generate(
    model: Transformer,
    prompts: torch.Tensor,
    new_tokens: int,
    device: torch.device,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Continue equal-length prompts [B, L] by ``new_tokens``; returns [B, L + new_tokens].

    Greedy when ``temperature`` is 0. All rows share one cache position, which is why prompts are
    cut to equal lengths rather than padded.
    """
    b, length = prompts.shape
    cache = model.new_cache(batch_size=b, max_len=length + new_tokens)
    out = torch.empty((b, length + new_tokens), dtype=torch.long, device=device)
    out[:, :length] = prompts.to(device)
    with autocast(device):
        logits = model.forward_cached(out[:, :length], cache, last_only=True)[:, -1]
        for i in range(new_tokens):
            if temperature > 0:
                probs = torch.softmax(logits.float() / temperature, dim=-1)
                nxt = torch.multinomial(probs, 1, generator=generator)[:, 0]
            else:
                nxt = logits.argmax(-1)
            out[:, length + i] = nxt
            if i + 1 < new_tokens:
                logits = model.forward_cached(nxt[:, None], cache)[:, -1]
    return out.cpu()


def make_traces(
    target: Transformer,
    streams: Sequence[TokenStream],
    cfg: TraceConfig,
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """{"len<L>": [N, L + gen_len]} continuations of random windows of the given token streams."""
    rng = np.random.default_rng(cfg.seed)
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    per_len = max(1, cfg.sequences // len(cfg.prompt_lens))
    total = per_len * len(cfg.prompt_lens)
    progress = Progress("traces", total)
    out: dict[str, torch.Tensor] = {}
    done = 0
    t0 = time.perf_counter()
    for length in cfg.prompt_lens:
        rows = []
        for start in range(0, per_len, cfg.batch_size):
            b = min(cfg.batch_size, per_len - start)
            windows = np.empty((b, length), dtype=np.int64)
            for i in range(b):
                s = streams[int(rng.integers(len(streams)))]
                off = int(rng.integers(0, len(s) - length))
                windows[i] = s[off : off + length]
            sampled = rng.random() < cfg.sampled_share
            temp = cfg.temperature if sampled else 0.0
            rows.append(generate(target, torch.from_numpy(windows), cfg.gen_len, device, temp, gen))
            done += b
            progress.update(done, tok_s=done * cfg.gen_len / (time.perf_counter() - t0))
        out[f"len{length}"] = torch.cat(rows)
    progress.update(done, force=True)
    return out


# ---------------------------------------------------------------------------------------------- distil


def kl_loss(teacher_logits: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """Forward KL(p_target || q_drafter), mean over positions: mass-covering, the divergence whose
    minimiser maximises expected greedy agreement when the drafter cannot match the target exactly.

    Embedding tables padded to different row counts: p is the target's distribution over the rows
    both models share, q the drafter's over all of its rows (its mass on rows the target lacks is
    mass no verification accepts), compared on the shared rows.
    """
    shared = min(teacher_logits.shape[-1], student_logits.shape[-1])
    if teacher_logits.shape[-1] > shared:
        teacher_logits = teacher_logits[..., :shared]
    t = F.log_softmax(teacher_logits.float(), dim=-1)
    s = F.log_softmax(student_logits.float(), dim=-1)
    if s.shape[-1] > shared:
        s = s[..., :shared]
    return (t.exp() * (t - s)).sum(-1).mean()


@torch.no_grad()
def agreement(
    drafter: Transformer,
    target: Transformer,
    windows: torch.Tensor,
    device: torch.device,
    batch_size: int = 16,
) -> float:
    """Share of positions where the drafter's argmax equals the target's (a proxy for greedy α).

    The target's argmax is taken over the rows both models share (padding rows are no tokens)."""
    shared = shared_vocab_size(target, drafter)
    hits, count = 0, 0
    for i in range(0, len(windows), batch_size):
        w = windows[i : i + batch_size].to(device)
        with autocast(device):
            a = target(w)[..., :shared].argmax(-1)
            b = drafter(w).argmax(-1)
        hits += int((a == b).sum())
        count += a.numel()
    return hits / max(count, 1)


def _batch(rows: torch.Tensor, batch_size: int, rng: np.random.Generator) -> torch.Tensor:
    return rows[torch.from_numpy(rng.integers(0, len(rows), size=batch_size))]


def distill_drafter(
    cfg: DistillConfig,
    target: Transformer,
    traces: Mapping[str, torch.Tensor],
    prompt_lens: Mapping[str, int],
    vocab_size: int,
    work: Path,
    device: torch.device,
    probe_streams: Mapping[str, TokenStream] | None = None,
    resume: bool = True,
    init_weights: Path | None = None,
) -> tuple[Transformer, dict[str, Any]]:
    """Train (or resume) the drafter on ``traces``; return it and a recipe/report dict.

    The loss covers only continuation positions (what the target wrote), not the prompt windows.
    ``probe_streams`` ("<domain>" -> held-out tokens) are scored for drafter/target argmax agreement
    at the end, an early read on where this drafter will pay. ``init_weights`` starts from an earlier
    drafter (same shape) instead of a random initialisation.
    """
    work.mkdir(parents=True, exist_ok=True)
    max_len = max(t.shape[1] for t in traces.values())
    model = build_model(cfg.model_config(vocab_size, target.config.max_seq_len), seed=cfg.seed).to(device)
    if resume and (work / "done.json").is_file():
        log(f"[drafter] already distilled in {work}; loading it")
        final = load_file(str(work / "final.safetensors"))
        model.load_state_dict({k: v.to(device) for k, v in final.items()}, strict=False)
        return model.eval(), json.loads((work / "done.json").read_text())
    if init_weights is not None:
        init = load_file(str(init_weights))
        model.load_state_dict({k: v.to(device, torch.float32) for k, v in init.items()}, strict=False)
        log(f"[drafter] starting from {init_weights}")

    split_rng = np.random.default_rng(cfg.seed)
    train_rows: dict[str, torch.Tensor] = {}
    held_rows: list[torch.Tensor] = []
    for key, rows in sorted(traces.items()):
        mask = split_rng.random(len(rows)) < cfg.holdout_share
        train_rows[key], held = rows[~torch.from_numpy(mask)], rows[torch.from_numpy(mask)]
        held_rows.append(held[:, : min(r.shape[1] for r in traces.values())])
    held_out = torch.cat(held_rows)[:256]
    keys = sorted(train_rows)

    target.eval()
    for p in target.parameters():
        p.requires_grad_(False)
    opt = make_optimizer(model, cfg.lr, cfg.weight_decay)
    state: dict[str, Any] = {"step": 0, "tokens": 0, "wall_s": 0.0, "history": []}
    if resume and (meta := load_checkpoint(work, model, opt)) is not None:
        state = meta
        log(f"[drafter] resumed at step {state['step']}")
    log(
        f"[drafter] {model.num_params():,} parameters; {sum(len(r) for r in train_rows.values()):,} "
        f"trace rows of up to {max_len} tokens; {cfg.steps} steps of {cfg.batch_size}"
    )
    progress = Progress("drafter", cfg.steps)
    t0 = time.perf_counter() - state["wall_s"]
    last_ckpt = time.perf_counter()
    step = state["step"]
    model.train()
    while step < cfg.steps:
        rng = np.random.default_rng([cfg.seed, step])
        key = keys[int(rng.integers(len(keys)))]
        rows = _batch(train_rows[key], cfg.batch_size, rng).to(device)
        start = prompt_lens[key] - 1  # first position whose next token the target generated
        lr = cosine_lr(step, cfg.steps, cfg.lr, cfg.warmup)
        for g in opt.param_groups:
            g["lr"] = lr
        with autocast(device):
            student = model(rows[:, :-1])[:, start:]
            if cfg.loss == "kl":
                with torch.no_grad():
                    teacher = target(rows[:, :-1])[:, start:]
                loss = kl_loss(teacher, student)
            else:
                # The trace tokens are the target's own choices (its argmax on greedy rows), so
                # cross-entropy on them teaches greedy agreement without a target forward per step.
                loss = F.cross_entropy(student.float().flatten(0, 1), rows[:, start + 1 :].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]  # torch leaves Tensor.backward unannotated
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        step += 1
        state["tokens"] += int(student.shape[0] * student.shape[1])
        last = step == cfg.steps
        out_of_time = cfg.max_seconds > 0 and time.perf_counter() - t0 > cfg.max_seconds
        if step % 25 == 0 or last:
            progress.update(step, loss=float(loss.detach()), lr=lr)
        if step % cfg.eval_every == 0 or last or out_of_time:
            agree = agreement(model, target, held_out, device)
            state["history"].append(
                {"step": step, "loss": round(float(loss.detach()), 4), "holdout_agreement": round(agree, 4)}
            )
            log(
                f"[drafter] step {step} {cfg.loss} {float(loss.detach()):.4f} "
                f"held-out trace agreement {agree:.3f}"
            )
        state["step"] = step
        state["wall_s"] = time.perf_counter() - t0
        if time.perf_counter() - last_ckpt > cfg.checkpoint_every_s or last or out_of_time:
            save_checkpoint(work, model, opt, state)
            last_ckpt = time.perf_counter()
        if out_of_time:
            log(f"[drafter] wall-time budget of {cfg.max_seconds:.0f}s spent at step {step}")
            break

    model.eval()
    probes = {}
    for domain, stream in (probe_streams or {}).items():
        windows = eval_windows(stream, min(256, target.config.max_seq_len - 1), 8192)
        probes[domain] = round(agreement(model, target, windows, device), 4)
    if probes:
        log(f"[drafter] argmax agreement with the target on held-out text: {probes}")
    save_file(
        {k: v.detach().cpu() for k, v in model.state_dict().items() if k != "lm_head.weight"},
        str(work / "final.safetensors"),
    )
    report = {
        "config": asdict(cfg),
        "parameters": model.num_params(),
        "steps_run": step,
        "trace_tokens_seen": state["tokens"],
        "wall_s": round(state["wall_s"], 1),
        "history": state["history"],
        "agreement_on_validation_text": probes,
        "initialised_from": str(init_weights) if init_weights is not None else None,
    }
    (work / "done.json").write_text(json.dumps(report, indent=1))
    return model, report
