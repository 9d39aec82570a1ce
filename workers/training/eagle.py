"""Training draft heads (``workers.engine.eagle``) on a deployment's traces, as realignment trains drafters.

Owns `HeadOptions`, `train_head` and the head's pieces of data: the target's states at every
position of every row (its residual stream entering the head's aux layers, from one target pass
that also yields the teacher's top-K: the head needs both, so the target runs once), the draft
vocabulary (the fewest ids that cover ``draft_vocab_coverage`` of the completion tokens, in
multiples of 64) and the loss over the head's unrolled steps (``EagleHead.unrolled``: step s reads
the head's own states as drafting the (s+1)-th token does, weighted ``step_decay``^s as EAGLE-3's
training-time test).

It shares realignment's dataset (``workers.training.realign.build_dataset``: the held-out split by
request, replayed older traffic), its teacher's top-K and loss, its time-budgeted schedule (a timed
probe step plans the run, cosine learning rate, early stop on held-out figures with the best weights
kept) and its metrics, so a head and a drafter realigned on the same traces are judged alike.
A head is trained from the incumbent head's weights, or built fresh for a target that has none
(``head_for_target``: the output projection and final norm start from the target's own).
"""

from __future__ import annotations

import copy
import json
import math
import shutil
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from controlplane.artifacts.manifest import MANIFEST_NAME, write_manifest
from workers.devices import autocast_for
from workers.engine.eagle import EagleHead, HeadConfig, head_for_target
from workers.engine.head_io import save_head_folder
from workers.engine.model import DecoderLayer, Transformer
from workers.engine.tokenizer import Tokenizer
from workers.training.common import cosine_lr, make_optimizer
from workers.training.realign import (
    SCORING_BYTES_PER_LOGIT,
    SPEC_CONFIG_NAME,
    TOPK_BYTES_PER_ENTRY,
    Artifact,
    ProgressFn,
    RealignCancelledError,
    RealignConfig,
    Rows,
    Teacher,
    TraceText,
    build_dataset,
    pad_rows,
    run_device,
)

DRAFT_VOCAB_STEP = 64
MIN_DRAFT_VOCAB = 256


@dataclass
class HeadOptions:
    # Steps the training unroll runs (the first on the target's states, the rest on the head's own).
    ttt_steps: int = 3
    step_decay: float = 0.8
    # None: the fewest ids covering draft_vocab_coverage of the training completions' tokens.
    draft_vocab_size: int | None = None
    draft_vocab_coverage: float = 0.995
    aux_layers: tuple[int, ...] | None = None  # None: ``default_aux_layers`` of the target
    # The head's MLP width (None: half the target's). A budgeted run is short of steps, not of
    # capacity: on the reference target, half the MLP and a 99.5% draft vocabulary fit 573 steps
    # in 600 s instead of 344 and reached held-out agreement 0.97 instead of 0.95 (and cost 0.14
    # of a target step per draft instead of 0.18). See docs/benchmarks.md.
    intermediate_size: int | None = None
    lr: float = 3e-3
    # Train on every pair of the kept row, the prompt's too (the target's distribution there is as
    # good a teacher, and structured prompts hold worked examples of the answers), not only the
    # completion's. Held-out figures are always on completion pairs.
    prompt_pairs: bool = True
    # Prompt positions a training row keeps before its completion. The head attends over them; the
    # target's states there already carry the whole prompt, so a short window costs little
    # agreement and saves most of the work (a structured row is ~90% prompt).
    context_tokens: int = 96
    # The target's states for every training row are kept (bf16) for the run within this budget;
    # past it, the rows trained on are a seeded subset that fits.
    states_memory_mb: float = 4096.0


@dataclass
class HeadResult:
    model: EagleHead
    metrics: dict[str, Any]


@dataclass
class HeadRows:
    """Rows with the target's fused-layer states at every position ([T_i, A*D] bf16) and its top-K."""

    rows: Rows
    states: list[torch.Tensor]
    teacher: Teacher


def choose_draft_vocab(rows: Rows, vocab_size: int, coverage: float) -> torch.Tensor:
    """The target ids of the draft vocabulary, ascending: the most frequent completion tokens,
    enough to cover ``coverage`` of them, rounded up to a multiple of DRAFT_VOCAB_STEP."""
    counts = Counter[int]()
    for ids, start in zip(rows.ids, rows.starts, strict=True):
        counts.update(ids[start:].tolist())
    ranked = [tok for tok, _ in counts.most_common() if tok < vocab_size]
    total = sum(counts[t] for t in ranked)
    covered, size = 0, 0
    while size < len(ranked) and covered < coverage * total:
        covered += counts[ranked[size]]
        size += 1
    size = min(vocab_size, max(MIN_DRAFT_VOCAB, math.ceil(size / DRAFT_VOCAB_STEP) * DRAFT_VOCAB_STEP))
    chosen = set(ranked[:size])
    # Fill up to the rounded size with the lowest ids not chosen (never drafted in the traces, harmless).
    filler = (i for i in range(vocab_size) if i not in chosen)
    while len(chosen) < size:
        chosen.add(next(filler))
    return torch.tensor(sorted(chosen), dtype=torch.long)


def target_states(
    target: Transformer, tokens: torch.Tensor, layers: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [B, T] -> (the residual stream entering each aux layer, concatenated [B, T, A*D];
    the final-normed states [B, T, D] the target's logits come from)."""
    t = tokens.shape[1]
    cos, sin = target.rope_cos[:t].to(target.dtype), target.rope_sin[:t].to(target.dtype)
    h = target.model.embed_tokens(tokens)
    kept: dict[int, torch.Tensor] = {}
    for i, layer in enumerate(target.model.layers):
        assert isinstance(layer, DecoderLayer)
        if i in layers:
            kept[i] = h
        h = h + layer.self_attn(layer.input_layernorm(h), cos, sin)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    kept[len(target.model.layers)] = h
    return torch.cat([kept[i] for i in layers], dim=-1), target.model.norm(h)


@torch.no_grad()
def target_pass(
    target: Transformer,
    rows: Rows,
    layers: Sequence[int],
    top_k: int,
    device: torch.device,
    batch_rows: int = 16,
    memory_mb: float = 1024.0,
    context_tokens: int | None = None,
) -> HeadRows:
    """One target pass per row: its states and its top-K at completion positions. With
    ``context_tokens``, only the last that many prompt positions are kept (the states there were
    computed over the whole prompt)."""
    width = target.config.vocab_size
    k = min(top_k, width)
    chunk = max(1, int(memory_mb * 2**20) // (width * SCORING_BYTES_PER_LOGIT + k * TOPK_BYTES_PER_ENTRY))
    states: list[torch.Tensor] = []
    probs: list[torch.Tensor] = []
    index: list[torch.Tensor] = []
    kept = Rows([], [], [])
    mass, count = 0.0, 0
    for lo in range(0, len(rows), batch_rows):
        picks = list(range(lo, min(len(rows), lo + batch_rows)))
        batch = pad_rows([rows.ids[i] for i in picks], 0).to(device)
        with autocast_for(device):
            aux, final = target_states(target, batch, layers)
        for b, i in enumerate(picks):
            n = len(rows.ids[i])
            cut = max(0, rows.starts[i] - context_tokens) if context_tokens is not None else 0
            states.append(aux[b, cut:n].to("cpu", torch.bfloat16))
            kept.ids.append(rows.ids[i][cut:])
            kept.starts.append(rows.starts[i] - cut)
            kept.keys.append(rows.keys[i])
            hidden = final[b, cut : n - 1]  # entry j: the target's next token after kept position j
            parts_p, parts_i = [], []
            for start in range(0, len(hidden), chunk):
                with autocast_for(device):
                    logits = target.lm_head(hidden[start : start + chunk]).float()
                p, ids = torch.softmax(logits, dim=-1).topk(k, dim=-1)
                parts_p.append(p.cpu())
                parts_i.append(ids.to(torch.int32).cpu())
            top_p = torch.cat(parts_p)
            mass += float(top_p.sum())
            count += len(top_p)
            probs.append(top_p)
            index.append(torch.cat(parts_i))
    return HeadRows(kept, states, Teacher(probs, index, mass / max(count, 1)))


@dataclass
class HeadBatch:
    states: torch.Tensor  # [B,T,A*D] the target's states
    tokens: torch.Tensor  # [B,T] the token after each position
    first: torch.Tensor  # [B] the first position of each row's window
    width: int  # window positions per row
    # Per unrolled step: flat indices into [B, width] of the pairs scored, the teacher's top-K
    # probabilities there (mass on ids outside the draft vocabulary zeroed) and its ids as draft ids.
    per_step: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def _batch(
    data: HeadRows,
    picks: Sequence[int],
    to_draft: torch.Tensor,
    steps: int,
    device: torch.device,
    prompt_pairs: bool = False,
) -> HeadBatch:
    """One batch of rows. Scored: the pairs whose drafted token is a completion token, and with
    ``prompt_pairs`` every pair of the kept row (the whole row is then the window); else each row's
    window starts where its first scored pair's draft chain does and ends at its last pair."""
    ids = [data.rows.ids[i] for i in picks]
    length = max(len(t) for t in ids)
    tokens = pad_rows(ids, 0)
    nxt = F.pad(tokens[:, 1:], (0, 1))  # the token after each position (0 past the end: never scored)
    states = torch.zeros(len(picks), length, data.states[picks[0]].shape[-1])
    for b, i in enumerate(picks):
        states[b, : len(ids[b])] = data.states[i].float()
    lowest = [0 if prompt_pairs else max(0, data.rows.starts[i] - 2) for i in picks]
    first = [max(0, lo - (steps - 1)) for lo in lowest]
    width = max(1, max(len(t) - 2 - f for t, f in zip(ids, first, strict=True)))
    per_step = []
    for s in range(steps):
        flat, js = [], []
        for b in range(len(picks)):
            n = len(ids[b])
            # Pair t (state at t, token t+1) predicts the token at t+2: the teacher's entry t + 1.
            t = torch.arange(max(s, lowest[b]), n - 2)
            flat.append(t - first[b] + b * width)
            js.append((b, t + 1))
        index = torch.cat(flat)
        top_p = torch.cat([data.teacher.probs[picks[b]][j] for b, j in js])
        top_i = torch.cat([data.teacher.index[picks[b]][j] for b, j in js]).long()
        draft_i = to_draft[top_i]  # -1 where the target id is not in the draft vocabulary
        top_p = top_p.masked_fill(draft_i < 0, 0.0)
        per_step.append((index.to(device), top_p.to(device), draft_i.clamp_min(0).to(device)))
    return HeadBatch(states.to(device), nxt.to(device), torch.tensor(first, device=device), width, per_step)


def head_loss(
    logits: torch.Tensor, top_p: torch.Tensor, top_i: torch.Tensor, tvd_weight: float, kl_weight: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, TVD, greedy hits) of draft-vocabulary logits [N, Vd] against the teacher's top-K [N, K]
    in draft ids, its mass on ids the head cannot draft zeroed (counted against the head)."""
    log_q = F.log_softmax(logits.float(), dim=-1)
    log_q_top = log_q.gather(-1, top_i)
    q_top = log_q_top.exp()
    tvd = 0.5 * ((top_p - q_top).abs().sum(-1) + (1 - q_top.sum(-1)).clamp_min(0)).mean()
    p_norm = top_p / top_p.sum(-1, keepdim=True).clamp_min(1e-8)
    loss = tvd_weight * tvd + kl_weight * -(p_norm * log_q_top).sum(-1).mean()
    hits = ((logits.argmax(-1) == top_i[:, 0]) & (top_p[:, 0] > 0)).sum()
    return loss, tvd, hits


@torch.no_grad()
def evaluate_head(
    head: EagleHead, data: HeadRows, to_draft: torch.Tensor, steps: int, device: torch.device, batch_rows: int
) -> dict[str, float]:
    """Held-out figures per unrolled step: greedy agreement (the head's argmax is the target's) and
    expected acceptance (sum over the teacher's top K of min(p, q)); ``unrolled_agreement`` is their
    mean over the steps, what drafting ``steps`` tokens a round sees."""
    was = head.training
    head.eval()
    agree = [0.0] * steps
    accept = [0.0] * steps
    n = [0] * steps
    for lo in range(0, len(data.rows), batch_rows):
        picks = list(range(lo, min(len(data.rows), lo + batch_rows)))
        batch = _batch(data, picks, to_draft, steps, device)
        with autocast_for(device):
            outs = head.unrolled(batch.states, batch.tokens, steps, batch.first, batch.width)
        for s, (index, top_p, top_i) in enumerate(batch.per_step):
            with autocast_for(device):
                logits = head.logits(outs[s].flatten(0, 1)[index]).float()
            q = torch.softmax(logits, dim=-1)
            accept[s] += float(torch.minimum(top_p, q.gather(-1, top_i)).sum())
            agree[s] += float(((q.argmax(-1) == top_i[:, 0]) & (top_p[:, 0] > 0)).sum())
            n[s] += len(q)
    head.train(was)
    by_step = [a / max(c, 1) for a, c in zip(agree, n, strict=True)]
    return {
        "greedy_agreement": by_step[0],
        "expected_acceptance": accept[0] / max(n[0], 1),
        "unrolled_agreement": sum(by_step) / steps,
        **{f"greedy_agreement_step_{s}": v for s, v in enumerate(by_step)},
    }


def _fit_rows(data: Rows, per_token_bytes: int, budget_mb: float, seed: int) -> Rows:
    """A seeded subset of the rows whose states fit the budget (all of them when they do)."""
    total = sum(len(t) for t in data.ids) * per_token_bytes
    if total <= budget_mb * 2**20:
        return data
    order = np.random.default_rng([seed, 3]).permutation(len(data))
    keep, used = [], 0
    for i in order:
        size = len(data.ids[i]) * per_token_bytes
        if used + size > budget_mb * 2**20:
            continue
        keep.append(int(i))
        used += size
    keep.sort()
    return Rows([data.ids[i] for i in keep], [data.starts[i] for i in keep], [data.keys[i] for i in keep])


def train_head(
    target: Transformer,
    incumbent: EagleHead | None,
    tokenizer: Tokenizer,
    recent: Sequence[TraceText],
    older: Sequence[TraceText] = (),
    cfg: RealignConfig | None = None,
    options: HeadOptions | None = None,
    progress: ProgressFn | None = None,
) -> HeadResult:
    """Train a head for ``target`` on the traces: from ``incumbent``'s weights (copied, never
    modified), or built fresh when None. Returns the head and metrics
    shaped like realignment's."""
    cfg = cfg or RealignConfig()
    options = options or HeadOptions()
    started = time.perf_counter()
    device = run_device(cfg.device, target)
    torch.manual_seed(cfg.seed)

    def checkpoint(fraction: float, message: str) -> None:
        if progress is not None and progress(fraction, message) is False:
            raise RealignCancelledError(message)

    data = build_dataset(recent, older, tokenizer, cfg, target.config.max_seq_len)
    if incumbent is not None:
        head = copy.deepcopy(incumbent).to(device)
        head.embed_weight = target.model.embed_tokens.weight.detach()
    else:
        draft_ids = (
            choose_draft_vocab(data.train, target.config.vocab_size, options.draft_vocab_coverage)
            if options.draft_vocab_size is None
            else None
        )
        size = options.draft_vocab_size or len(draft_ids)  # type: ignore[arg-type]
        width = options.intermediate_size or max(1, target.config.ffn_dim // 2)
        head_cfg = HeadConfig.for_target(target.config, size, options.aux_layers, width)
        head = head_for_target(target, head_cfg, draft_ids)
    head = head.float() if device.type == "cuda" else head
    layers = head.config.aux_layers
    per_token = len(layers) * target.config.dim * 2
    train_rows = _fit_rows(data.train, per_token, options.states_memory_mb, cfg.seed)
    checkpoint(
        0.02,
        f"dataset: {len(train_rows)} train rows ({data.replay_rows} replay planned), "
        f"{len(data.held_out)} held out; "
        f"draft vocabulary {head.config.draft_vocab_size}, target layers {list(layers)}",
    )
    t_teacher = time.perf_counter()

    def states_of(rows: Rows) -> HeadRows:
        return target_pass(
            target,
            rows,
            layers,
            cfg.teacher_top_k,
            device,
            cfg.teacher_batch_rows,
            cfg.teacher_memory_mb,
            options.context_tokens,
        )

    held, train = states_of(data.held_out), states_of(train_rows)
    teacher_s = time.perf_counter() - t_teacher
    checkpoint(0.1, f"target states and top-{cfg.teacher_top_k} ready ({teacher_s:.1f}s)")

    to_draft = torch.full((target.config.vocab_size,), -1, dtype=torch.long)
    to_draft[head.draft_ids.cpu()] = torch.arange(head.config.draft_vocab_size)
    steps = options.ttt_steps
    weights = [options.step_decay**s for s in range(steps)]
    head.train()
    params = [p for p in head.parameters() if p.requires_grad]
    opt = make_optimizer(head, cfg.lr or options.lr, cfg.weight_decay)
    lr = cfg.lr or options.lr
    n_rows = len(train.rows)
    b = min(cfg.batch_rows, n_rows)
    rng = np.random.default_rng([cfg.seed, 2])

    def batches() -> Any:
        while True:
            perm = rng.permutation(n_rows)
            for lo in range(0, n_rows - b + 1, b):
                yield [int(i) for i in perm[lo : lo + b]]

    stream = batches()

    def train_step(picks: list[int], step: int, total: int) -> tuple[float, int]:
        for g in opt.param_groups:
            g["lr"] = cosine_lr(step, total, lr, min(max(10, int(cfg.warmup_share * total)), total // 2))
        batch = _batch(train, picks, to_draft, steps, device, options.prompt_pairs)
        with autocast_for(device):
            outs = head.unrolled(batch.states, batch.tokens, steps, batch.first, batch.width)
            loss = torch.zeros((), device=device)
            tokens = 0
            for s, (index, top_p, top_i) in enumerate(batch.per_step):
                logits = head.logits(outs[s].flatten(0, 1)[index])
                step_loss, _, _ = head_loss(logits, top_p, top_i, cfg.tvd_weight, cfg.kl_weight)
                loss = loss + weights[s] * step_loss
                tokens += len(index)
        opt.zero_grad(set_to_none=True)
        (loss / sum(weights)).backward()  # type: ignore[no-untyped-call]
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        return float(loss.detach()) / sum(weights), tokens

    t_eval = time.perf_counter()
    before = evaluate_head(head, held, to_draft, steps, device, cfg.batch_rows)
    eval_s = time.perf_counter() - t_eval
    steps_per_epoch = max(1, n_rows // b)
    cap = max(2, int(cfg.max_epochs * steps_per_epoch))
    t_train = time.perf_counter()
    loss, tokens = train_step(next(stream), 0, cap)
    t_probe = time.perf_counter()
    loss, n = train_step(next(stream), 1, cap)
    tokens += n
    step_s = time.perf_counter() - t_probe
    left = cfg.time_budget_s - (time.perf_counter() - started) - (cfg.evals + 1) * eval_s
    total = max(2, min(cap, int(left / step_s)))
    eval_every = max(1, total // max(1, cfg.evals))
    key = "unrolled_agreement"
    best, best_step = dict(before), 0
    best_state = {k: v.detach().clone() for k, v in head.state_dict().items()}
    history: list[dict[str, float]] = [{"step": 0, **{k: round(v, 4) for k, v in before.items()}}]
    bad_evals, steps_run, stop_reason = 0, 2, "planned steps done"
    for step in range(2, total):
        if step % eval_every == 0:
            scores = evaluate_head(head, held, to_draft, steps, device, cfg.batch_rows)
            history.append(
                {"step": step, "loss": round(loss, 4), **{k: round(v, 4) for k, v in scores.items()}}
            )
            if scores[key] > best[key] + 1e-4:
                best, best_step, bad_evals = scores, step, 0
                best_state = {k: v.detach().clone() for k, v in head.state_dict().items()}
            else:
                bad_evals += 1
            checkpoint(
                0.1 + 0.85 * step / total,
                f"step {step}/{total}: held-out agreement {scores['greedy_agreement']:.3f}, "
                f"unrolled {scores[key]:.3f}",
            )
            if bad_evals >= cfg.patience:
                stop_reason = f"early stop: no held-out gain in {cfg.patience} evaluations"
                break
        if time.perf_counter() - started > cfg.time_budget_s:
            stop_reason = "time budget spent"
            break
        loss, n = train_step(next(stream), step, total)
        tokens += n
        steps_run += 1
    train_s = time.perf_counter() - t_train
    final = evaluate_head(head, held, to_draft, steps, device, cfg.batch_rows)
    history.append({"step": steps_run, "loss": round(loss, 4), **{k: round(v, 4) for k, v in final.items()}})
    if final[key] > best[key]:
        best, best_step = final, steps_run
    else:
        head.load_state_dict(best_state)
    head.eval()
    wall_s = time.perf_counter() - started
    metrics = {
        "drafter_kind": "eagle3",
        "device": str(device),
        "train_rows": len(train.rows),
        "recent_rows": data.recent_rows,
        "replay_rows": data.replay_rows,
        "held_out_rows": len(data.held_out),
        "train_completion_tokens": train.rows.completion_tokens(),
        "tokens_trained": tokens,
        "steps_planned": total,
        "steps_run": steps_run,
        "best_step": best_step,
        "stop_reason": stop_reason,
        "lr": lr,
        "teacher": "topk",
        "teacher_top_k_mass": round(held.teacher.coverage, 4),
        "select_on": key,
        "ttt_steps": steps,
        "draft_vocab_size": head.config.draft_vocab_size,
        "aux_layers": list(layers),
        "held_out_before": {k: round(v, 4) for k, v in before.items()},
        "held_out_after": {k: round(v, 4) for k, v in best.items()},
        "history": history,
        "teacher_s": round(teacher_s, 2),
        "train_s": round(train_s, 2),
        "train_tokens_per_s": round(tokens / max(train_s, 1e-9), 1),
        "wall_s": round(wall_s, 2),
        "head_options": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(options).items()},
    }
    checkpoint(0.97, f"trained: held-out unrolled agreement {before[key]:.3f} -> {best[key]:.3f}")
    return HeadResult(head, metrics)


def save_head(
    head: EagleHead,
    tokenizer: Tokenizer,
    folder: str | Path,
    *,
    verifier: str,
    verifier_family: str = "llama",
    num_speculative_tokens: int = 4,
    metadata: dict[str, Any] | None = None,
) -> Artifact:
    """Write the head's folder (``workers.engine.head_io``), vLLM's ``--speculative-config`` JSON for
    it and a sha256 manifest of every file, through a temporary sibling renamed into place (as
    ``save_drafter`` does: a crash never leaves half an artifact)."""
    final = Path(folder)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    sha = save_head_folder(
        head, tokenizer, tmp, verifier=verifier, verifier_family=verifier_family, k=num_speculative_tokens
    )
    spec = {"model": final.name, "method": "eagle3", "num_speculative_tokens": num_speculative_tokens}
    (tmp / SPEC_CONFIG_NAME).write_text(json.dumps(spec, indent=2) + "\n")
    manifest_sha = write_manifest(tmp, metadata=metadata or {})
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    return Artifact(final, sha, json.loads((final / MANIFEST_NAME).read_text()), manifest_sha)
