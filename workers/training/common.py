"""Pieces every training stage shares: token streams, batches, checkpoints, precision and progress.

Checkpoints are safetensors plus a small JSON (never pickles, so a checkpoint from anywhere is safe
to open). Batches are drawn from a generator seeded by (seed, step), so a resumed run sees exactly
the batches the uninterrupted run would have seen without storing any RNG state.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from workers.devices import autocast_for
from workers.engine.model import Transformer


def log(msg: str) -> None:
    """One line to stdout, flushed: a long build is watched through a pipe or a log file."""
    print(msg, flush=True)


class Progress:
    """A plain-text progress line every ``every_s`` seconds (no terminal tricks: logs stay readable)."""

    def __init__(self, label: str, total: int, every_s: float = 10.0) -> None:
        self.label, self.total, self.every_s = label, total, every_s
        self.start = time.perf_counter()
        self.last = 0.0

    def update(self, done: int, force: bool = False, **fields: float | int | str) -> None:
        now = time.perf_counter()
        if not force and now - self.last < self.every_s and done < self.total:
            return
        self.last = now
        elapsed = now - self.start
        frac = done / max(self.total, 1)
        eta = elapsed / frac - elapsed if frac > 0 else float("nan")
        width = 24
        bar = "#" * int(frac * width) + "-" * (width - int(frac * width))
        extra = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in fields.items())
        log(f"[{self.label}] [{bar}] {done}/{self.total} {elapsed:6.0f}s eta {eta:5.0f}s {extra}")


def pick_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda asked for, but torch sees no CUDA device")
    return torch.device(name)


def autocast(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """bf16 autocast on CUDA (fp32 master weights); plain fp32 on CPU, where bf16 matmuls are slower.

    The same context as ``workers.devices.autocast_for``: training and serving share one precision rule.
    """
    return autocast_for(device)


def shared_vocab_size(*models: Transformer) -> int:
    """The embedding rows every model has: where their logits can be compared column by column.

    Models sharing a tokenizer may still pad their embedding tables to different row counts
    (Qwen2.5-0.5B has 151,936 rows, Qwen2.5-7B 152,064); the rows past the shared range are padding
    that no tokenizer id reaches, so a distribution compared across models is taken over the
    shared range only.
    """
    return min(m.config.vocab_size for m in models)


def setup_threads(device: torch.device) -> None:
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    else:
        torch.set_num_threads(max(1, min(os.cpu_count() or 1, int(os.environ.get("TRAIN_THREADS", "64")))))


# ----------------------------------------------------------------------------------------- token streams

# One domain/split of the corpora as a flat array of token ids.
TokenStream = npt.NDArray[np.int64]


def load_streams(path: Path) -> dict[str, TokenStream]:
    """{"<domain>/<split>": int64 token array} from the data stage's safetensors file."""
    return {k: v.numpy().astype(np.int64) for k, v in load_file(str(path)).items()}


def save_streams(streams: Mapping[str, TokenStream], path: Path) -> None:
    # int16 holds a 4096-token vocabulary and halves the file (it travels to the GPU machine).
    tensors = {}
    for k, v in streams.items():
        if v.size and int(v.max()) > np.iinfo(np.int16).max:
            raise ValueError(f"stream {k} has ids beyond int16; store int32 instead")
        tensors[k] = torch.from_numpy(v.astype(np.int16))
    save_file(tensors, str(path))


def sample_batch(
    streams: Mapping[str, TokenStream],
    weights: Mapping[str, float],
    batch_size: int,
    seq_len: int,
    seed: int,
    step: int,
) -> torch.Tensor:
    """[B, seq_len + 1] windows at random offsets; each row's domain drawn by ``weights``."""
    rng = np.random.default_rng([seed, step])
    names = sorted(weights)
    p = np.array([weights[n] for n in names], dtype=np.float64)
    picks = rng.choice(len(names), size=batch_size, p=p / p.sum())
    rows = np.empty((batch_size, seq_len + 1), dtype=np.int64)
    for i, j in enumerate(picks):
        s = streams[names[j]]
        off = int(rng.integers(0, len(s) - seq_len - 1))
        rows[i] = s[off : off + seq_len + 1]
    return torch.from_numpy(rows)


def eval_windows(stream: TokenStream, seq_len: int, max_tokens: int) -> torch.Tensor:
    """Non-overlapping [N, seq_len + 1] windows from the start of a held-out stream (fixed, so comparable)."""
    n = min(len(stream) - 1, max_tokens) // seq_len
    if n == 0:
        raise ValueError(f"held-out stream of {len(stream)} tokens is shorter than one window of {seq_len}")
    idx = np.arange(n)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    return torch.from_numpy(stream[idx])


@torch.no_grad()
def eval_loss(model: Transformer, windows: torch.Tensor, device: torch.device, batch_size: int = 16) -> float:
    """Mean next-token cross-entropy (nats per token) over the windows."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(windows), batch_size):
        w = windows[i : i + batch_size].to(device)
        with autocast(device):
            logits = model(w[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), w[:, 1:].flatten(), reduction="sum")
        total += float(loss)
        count += w[:, 1:].numel()
    model.train(was_training)
    return total / count


def cosine_lr(step: int, total: int, peak: float, warmup: int, floor: float = 0.1) -> float:
    """Linear warm-up, then cosine decay to ``floor * peak`` at ``total``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t)))


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW with decay on matrices only (norm gains and the like are not shrunk towards zero)."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    fused = next(model.parameters()).device.type == "cuda"
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=fused)


# ------------------------------------------------------------------------------------------ checkpoints


def save_checkpoint(
    folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> None:
    """Model + optimizer tensors to safetensors and the loop's counters to JSON, written atomically."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    config = getattr(model, "config", None)
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and config and config.tie_embeddings:
            continue  # shared with the embedding; safetensors refuses aliased storage
        tensors[f"model.{name}"] = t.detach().cpu().contiguous()
    opt = optimizer.state_dict()
    for pid, pstate in opt["state"].items():
        for key, value in pstate.items():
            tensors[f"opt.{pid}.{key}"] = torch.as_tensor(value).detach().cpu().contiguous()
    tmp = folder / "checkpoint.safetensors.tmp"
    save_file(tensors, str(tmp))
    meta = {
        **state,
        "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in opt["param_groups"]],
    }
    (folder / "checkpoint.json.tmp").write_text(json.dumps(meta, indent=1))
    os.replace(tmp, folder / "checkpoint.safetensors")
    os.replace(folder / "checkpoint.json.tmp", folder / "checkpoint.json")


def load_checkpoint(
    folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any] | None:
    """Restore what :func:`save_checkpoint` wrote; None when there is no checkpoint."""
    if not (folder / "checkpoint.safetensors").is_file() or not (folder / "checkpoint.json").is_file():
        return None
    tensors = load_file(str(folder / "checkpoint.safetensors"))
    meta: dict[str, Any] = json.loads((folder / "checkpoint.json").read_text())
    device = next(model.parameters()).device
    model_state = {k[len("model.") :]: v for k, v in tensors.items() if k.startswith("model.")}
    model.load_state_dict(model_state, strict=False)
    opt_state: dict[int, dict[str, torch.Tensor]] = {}
    for k, v in tensors.items():
        if k.startswith("opt."):
            _, pid, key = k.split(".", 2)
            opt_state.setdefault(int(pid), {})[key] = v if key == "step" else v.to(device)
    groups = optimizer.state_dict()["param_groups"]
    for g, saved in zip(groups, meta.pop("param_groups"), strict=True):
        g.update({k: v for k, v in saved.items() if k in g})
    optimizer.load_state_dict({"state": opt_state, "param_groups": groups})
    return meta


def iter_chunks(n: int, size: int) -> Iterator[tuple[int, int]]:
    for i in range(0, n, size):
        yield i, min(n, i + size)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)}, torch {torch.__version__})"
    return f"cpu ({os.cpu_count()} cores, {torch.get_num_threads()} threads, torch {torch.__version__})"


def python_version() -> str:
    return sys.version.split()[0]
