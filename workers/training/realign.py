"""Realignment: distil a deployment's drafter from the target on that deployment's own traffic.

Pure PyTorch (no Celery, no database): the task in ``workers.tasks`` hands in trace texts and
reports progress; this module owns

- the dataset: prompt + completion text per trace, tokenized as serving saw it (prompt tokens,
  then completion tokens), the loss on completion positions only (what the target wrote); recent
  traces plus replayed older ones so that the traffic before the drift is not forgotten, as many
  as ``workers.training.replay`` plans from how much of the old traffic the recent window lacks
  (per category) and how well the incumbent agrees with the target on held-out old rows; a
  held-out split *by content* (a hash of the trace key, its normalised prompt or source document,
  and the seed; ``controlplane.traces.holdout``), never by position, of both windows, from which
  any trace whose prompt or document also occurs among the traces that may be trained on is
  dropped: the new drafter is scored, and its weights chosen, on recent and on older traffic whose
  text never reached its training, and the overlap is counted (``heldout_prompt_overlap``). Every
  category gets held-out rows: where the hash holds out too few of a category's traces (traffic cut
  from a few recurring documents), more of its documents are held out (``reserve_keys``), and the
  held-out rows of a window are shared among its categories;
- the teacher: the target runs once over every row and its distribution is kept as the top-K
  tokens per position, so epochs cost drafter work only (the target forward dominates on a CPU).
  Its logits are computed a chunk of positions at a time within ``teacher_memory_mb`` (a batch's
  full [positions x vocab] never exists: at a 152k vocabulary that is 0.6 MB per position), and
  over the vocabulary range target and drafter share (models of one tokenizer may pad their
  embedding tables to different row counts), so every kept id is one the drafter has. The target
  is only read: forward passes under ``torch.no_grad`` on the device it was loaded on, no
  ``.to()``, no mode or ``requires_grad`` flips, so a worker may keep it loaded for the next job
  (``workers.model_cache``);
- precision: on a GPU the target runs in its bf16 weights under bf16 autocast and the drafter
  trains with float32 master weights under bf16 autocast; on a CPU everything is float32;
- the loss: forward KL to the (truncated) target distribution, mass-covering, plus total-variation
  distance, which is exactly 1 - expected acceptance of a sampled draft token;
- the anchor: replayed old rows, and recent rows of a category the incumbent still serves as well
  as before the drift (``steady_categories``), are fitted to the incumbent's own distribution, so
  the traffic that did not drift is kept rather than relearnt from the few documents it came from;
- hyperparameters from data size and a time budget: a timed probe step fixes how many steps fit,
  epochs are capped, the learning rate scales with the data, cosine schedule, and early stopping on
  held-out expected acceptance (sum of min(p, q)) with the best weights kept, where weights that
  put any category's held-out figure more than ``category_tolerance`` below the incumbent's are
  never kept (an aggregate over categories lets a gain on the new traffic hide a loss on the old);
- determinism: one seed drives initial state, split, replay choice and batch order;
- the artifact: an HF folder (``workers.engine.hf_io``), a sha256 manifest of every file, and a
  vLLM ``--speculative-config`` JSON.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from controlplane.artifacts.manifest import (
    MANIFEST_NAME,
    ArtifactVerificationError,
    verify_artifact_folder,
    write_manifest,
)
from controlplane.traces.holdout import (
    REALIGN_HOLDOUT_SHARE,
    Content,
    TrainedContent,
    content_of,
    holdout_rank,
    is_held_out,
    overlap_count,
)
from workers.devices import autocast_for, resolve_device
from workers.engine.hf_io import save_hf_folder
from workers.engine.model import DecoderLayer, Transformer
from workers.engine.tokenizer import Tokenizer
from workers.training.common import cosine_lr, make_optimizer, shared_vocab_size
from workers.training.replay import MAX_REPLAY_SHARE, UNCATEGORIZED, ReplayPlan, plan_replay

# progress(fraction, message) -> keep going? False stops the run (the job was cancelled).
ProgressFn = Callable[[float, str], bool]
# Peak bytes per logit while a chunk of positions is scored: its float32 logits (4) and their
# float32 softmax (4). On a GPU the head's bf16 output (2) lives only while it is converted to
# float32 (2 + 4 < 8).
SCORING_BYTES_PER_LOGIT = 8
# From this many vocabulary rows up, a CPU run trains over a sampled vocabulary (see
# RealignConfig.train_vocab): the bundled pair's 4,096 rows never are, a 49k-row model always is.
SAMPLED_VOCAB_FROM = 32_768
# What topk returns per kept entry: a float32 probability and an int64 id.
TOPK_BYTES_PER_ENTRY = 4 + 8
SPEC_CONFIG_NAME = "speculative_config.json"


class RealignCancelledError(RuntimeError):
    """The progress callback asked the run to stop."""


class NotEnoughDataError(ValueError):
    """Too few usable traces to train and hold some out."""


@dataclass(frozen=True, slots=True)
class TraceText:
    """One served request: its key (the hold-out unit), prompt and completion text."""

    key: str
    prompt: str
    completion: str
    category: str | None = None  # the request's category as the client sent it (None: not given)
    document: str | None = None  # the source document the prompt was cut from (None: not given)

    @property
    def content(self) -> Content:
        """What the held-out split compares: the normalised prompt's hash and the document."""
        return content_of(self.prompt, self.document)


@dataclass
class RealignConfig:
    seed: int = 0
    time_budget_s: float = 240.0
    # Share of training rows drawn from traffic before the drift point (forgetting guard). None:
    # sized by ``workers.training.replay.plan_replay`` from how much of the old traffic the recent
    # window lacks and how well the incumbent agrees with the target on held-out old rows.
    replay_share: float | None = None
    max_replay_share: float = MAX_REPLAY_SHARE
    holdout_share: float = REALIGN_HOLDOUT_SHARE  # the split the canary's replay selects from
    max_holdout_rows: int = 32  # per window, shared among its categories
    # Every category is scored on held-out rows: while fewer of its traces than this are held out
    # by the hash split, more of its keys (documents) are held out, each at most
    # max_reserved_share of the category's traces (see reserve_keys).
    holdout_rows_per_category: int = 8
    max_reserved_share: float = 0.25
    # At most this many training rows per content key (source document); None: no cap.
    max_rows_per_key: int | None = None
    min_train_rows: int = 4
    # Rows are cut to the last max_prompt_tokens of the prompt and max_completion_tokens of the
    # completion, and never beyond the drafter's context.
    # 320 leaves a 512-token drafter room for a 192-token completion. A shorter cut trains the
    # drafter only on short contexts: cut at 192, prose it was still served at 200-350 tokens of
    # context lost ten points of greedy agreement there after a realignment.
    max_prompt_tokens: int = 320
    max_completion_tokens: int = 192
    teacher_top_k: int = 32
    # Whose distribution the replayed old rows are fitted to. "incumbent": its own top-K there, a
    # distillation term toward the drafter being replaced, so the new one keeps the incumbent's
    # behaviour on the old traffic; "target": the target's, like the recent rows. Measured on the
    # structured shift (1,024 recent traces, 512 old prose traces from 28 documents): fitting the
    # target on the few old requests kept memorises them, and prose on unseen requests fell 9.4
    # points; see docs/benchmarks.md.
    replay_teacher: str = "incumbent"
    # Memory the target's top-K pass (and the held-out scoring) may hold at once for logits: they
    # are computed this many MB of positions at a time (see rows_per_chunk).
    teacher_memory_mb: float = 1024.0
    tvd_weight: float = 0.5
    kl_weight: float = 1.0
    # Cross-entropy on the teacher's argmax (greedy serving accepts exactly the argmax).
    ce_weight: float = 0.0
    # Where the training targets come from: "topk" runs the target once over every training row and
    # keeps its top-K distribution; "tokens" uses the completion tokens themselves (the target's own
    # choices: its argmax on greedy traffic, samples of its distribution on sampled traffic), which
    # needs no target pass over the training rows (sequence-level distillation). The held-out rows
    # always get the target pass: early stopping reads expected acceptance from it.
    # "auto": "topk" when the projected target pass over the training rows (timed on the held-out
    # rows) fits in teacher_budget_share of the time budget, else "tokens". On a CPU the target
    # pass costs several drafter training steps per token and would eat the budget.
    teacher: str = "auto"
    teacher_budget_share: float = 0.3
    # What the held-out rows (both windows) are scored against. "target": its top-K from a target
    # pass over them; "tokens": their completion tokens as point masses (no target pass: greedy
    # agreement is agreement with what the target wrote, expected acceptance the drafter's
    # probability of it), which implies token targets for training under teacher "auto". "auto":
    # "tokens" when a target pass over the held-out rows, timed on one trace, would take more than
    # scoring_budget_share of the time budget. On a CPU a 30-layer target reads 32 held-out chat
    # rows at ~25-120 row tokens/s (SmolLM2-135M, idle to loaded): one to three minutes of a
    # five-minute budget spent before the first step.
    scoring_teacher: str = "auto"
    scoring_budget_share: float = 0.1
    # Intra-op threads while training (None: leave torch's setting). Small drafters train faster
    # on one thread on a busy machine than on two that spin-wait for each other.
    train_threads: int | None = None
    # Held-out figure that picks the best weights and stops early: "expected_acceptance" (sum of
    # min(p, q), what sampled serving accepts), "greedy_agreement" (what greedy serving accepts) or
    # "auto": greedy agreement when the held-out completions are the target's argmax (greedy
    # traffic), else expected acceptance. Sharpening a drafter on greedy traces can lower sum
    # min(p, q) while it raises agreement, so the wrong figure stops a useful run early.
    select_on: str = "auto"
    # Weight of the held-out *old* rows' figure when weights are judged (the rest on the recent
    # rows'): None for the replay share of the training rows, 0 to judge on recent traffic only.
    select_old_weight: float | None = None
    # Weights whose held-out figure (select_on) on any category falls more than this below the
    # incumbent's are never kept, whatever they gain elsewhere: an aggregate over categories lets
    # a gain on the new traffic hide a loss on the old. Categories with fewer held-out completion
    # positions than min_category_positions are not guarded (too few to tell). None: no guard.
    # Off by default, measured on the partial shift: offline (bench/realign_partial_offline.py)
    # held-out prose agreement dipped 2.5-3.5 points while structured climbed from 0.15 to
    # 0.79-0.86, so 0.02 refused every checkpoint; in the fast loop (480 traces from a dozen
    # recurring prose documents) 0.03 refused all 310 steps and handed back the incumbent, so
    # the loop had nothing to canary. A deployment that must not trade its old traffic sets it.
    category_tolerance: float | None = None
    min_category_positions: int = 128
    # Recent rows of a category whose traffic did not drift for the incumbent (its held-out figure
    # on the recent window within category_tolerance of the old window's: steady_categories) are
    # fitted to the incumbent, as replayed rows are (needs replay_teacher "incumbent"): that part
    # of the traffic is kept, not relearnt from the few documents a window may hold of it.
    anchor_steady_categories: bool = True
    # With token targets (teacher "tokens"), anchored rows are fitted to the incumbent's top-K
    # (token rows padded to that width without changing their loss) rather than to its argmax.
    wide_anchor: bool = True
    # The vocabulary rows the training loss normalises over. "full": every row (exact). "sampled":
    # the rows the training targets name (every id with probability > 0 at any training position:
    # completion tokens, teacher or anchor top-K) and ``train_vocab_negatives`` more drawn at
    # random each step, a restricted softmax, while held-out scoring, early stopping and serving
    # stay over every row. Why: with a large vocabulary the output projection is nearly all of a
    # small drafter's step (SmolLM2's 49,152 rows at width 192: 18 s for a 16-row step on a loaded
    # CPU core, 85 completion tokens/s), while a deployment's traces name a few thousand tokens;
    # the random rows keep pushing the others down. "auto": "sampled" on a CPU from
    # SAMPLED_VOCAB_FROM rows (where the named rows and the negatives are under half of them).
    train_vocab: str = "auto"
    train_vocab_negatives: int = 2048
    warmup_share: float = 0.1  # of the planned steps (at least 10): a fresh Adam jolts a trained drafter
    batch_rows: int = 16
    teacher_batch_rows: int = 16
    max_epochs: float = 10.0
    lr: float | None = None  # None: chosen from the data size
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    evals: int = 10  # held-out evaluations over the planned run
    patience: int = 5
    # None: where the target is. Else a worker device setting ("auto", "cpu", "cuda", "cuda:N"),
    # which must be where the target was loaded: realign never moves the target.
    device: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Rows:
    """Token rows and where each row's completion starts; tensors stay on the CPU until batched."""

    ids: list[torch.Tensor]  # each [T_i] int64
    starts: list[int]  # index of the first completion token in each row
    keys: list[str]
    categories: list[str] = field(default_factory=list)  # each row's category (empty: none known)

    def __len__(self) -> int:
        return len(self.ids)

    def category(self, i: int) -> str:
        return self.categories[i] if i < len(self.categories) else UNCATEGORIZED

    def completion_tokens(self) -> int:
        return sum(len(t) - s for t, s in zip(self.ids, self.starts, strict=True))


@dataclass
class RealignDataset:
    """Training rows (recent, then replayed old ones), and the held-out rows of both windows."""

    train: Rows
    held_out: Rows  # recent traffic: what the new drafter is for, and what selects its weights
    recent_rows: int
    replay_rows: int
    # Older traffic held out by the same hash: what forgetting is measured on (may be empty).
    held_out_old: Rows = field(default_factory=lambda: Rows([], [], []))
    replay_plan: ReplayPlan | None = None
    # How the split came out (``held_out_split`` in the metrics): rows per side, the held-out
    # traces dropped because their prompt or document may be trained on, and the overlap left.
    split: dict[str, int] = field(default_factory=dict)


@dataclass
class Teacher:
    """The target's top-K distribution at every completion position of some rows.

    ``probs[i]``/``index[i]`` are [N_i, K] for row i (N_i completion positions), held on the CPU:
    float32 probabilities and integer ids (int32 from the target pass: every vocabulary fits, and
    it halves their memory). ``coverage`` is the mean top-K mass, the share of the target's
    distribution the loss actually sees.
    """

    probs: list[torch.Tensor]
    index: list[torch.Tensor]
    coverage: float


@dataclass
class RealignResult:
    model: Transformer
    metrics: dict[str, Any]


# --------------------------------------------------------------------------------------------- data


def _encode(traces: Sequence[TraceText], tokenizer: Tokenizer, cfg: RealignConfig, max_len: int) -> Rows:
    rows = Rows([], [], [])
    if not traces:
        return rows
    prompts = tokenizer.encode_batch([t.prompt for t in traces])
    completions = tokenizer.encode_batch([t.completion for t in traces])
    for trace, p, c in zip(traces, prompts, completions, strict=True):
        c = c[: cfg.max_completion_tokens]
        p = p[-cfg.max_prompt_tokens :] if cfg.max_prompt_tokens else []
        if len(p) + len(c) > max_len:
            c = c[: max_len - len(p)]
        if not p or len(c) < 2:
            continue  # a completion position needs the token before it (the last prompt token)
        rows.ids.append(torch.tensor(p + c, dtype=torch.long))
        rows.starts.append(len(p))
        rows.keys.append(trace.key)
        rows.categories.append(_category(trace))
    return rows


def build_dataset(
    recent: Sequence[TraceText],
    older: Sequence[TraceText],
    tokenizer: Tokenizer,
    cfg: RealignConfig,
    max_len: int,
    old_agreement: Callable[[Rows], float] | None = None,
) -> RealignDataset:
    """Recent traces split train/held-out by content; older traces split the same way, their
    held-out part kept for measuring forgetting and the rest replayed.

    A trace the key's hash holds out is kept out only if neither its normalised prompt nor its
    document occurs among the traces that may be trained on (the recent training share and the
    whole replay pool, as the canary's replay selection reckons them,
    ``controlplane.canary.shadow``); else it is dropped from both sides. The overlap between the
    held-out rows and the rows actually trained on is then counted, not assumed.

    The replay is ``cfg.replay_share`` of the training rows when set, else planned by
    ``plan_replay`` from the categories of both windows and ``old_agreement(held-out old rows)``
    (the incumbent's greedy agreement there; None or no held-out old rows: unscored). The replayed
    rows are a seeded choice within each category the plan names.
    """

    reserved = reserve_keys([*recent, *older], cfg)

    def keyed_out(trace: TraceText) -> bool:
        return trace.key in reserved or is_held_out(trace.key, cfg.seed, cfg.holdout_share)

    train_recent = [t for t in recent if not keyed_out(t)]
    pool = [t for t in older if not keyed_out(t)]
    may_train = TrainedContent.of(t.content for t in (*train_recent, *pool))
    held_keyed = [t for t in recent if keyed_out(t)]
    held = [t for t in held_keyed if not may_train.overlaps(t.content)]
    held_old_keyed = [t for t in older if keyed_out(t)]
    held_old = [t for t in held_old_keyed if not may_train.overlaps(t.content)]
    dropped = len(held_keyed) - len(held) + len(held_old_keyed) - len(held_old)
    if not held and len(train_recent) > 1:  # tiny sets: hold out one request rather than none
        held = _hold_out_one(train_recent, pool)
    held = _balanced(held, cfg.max_holdout_rows)
    held_old = _balanced(held_old, cfg.max_holdout_rows)
    capped = len(train_recent) + len(pool)
    train_recent = _cap_per_key(train_recent, cfg.max_rows_per_key, cfg.seed)
    pool = _cap_per_key(pool, cfg.max_rows_per_key, cfg.seed, Counter(t.key for t in train_recent))
    capped -= len(train_recent) + len(pool)
    train = _encode(train_recent, tokenizer, cfg, max_len)
    held_rows = _encode(held, tokenizer, cfg, max_len)
    held_old_rows = _encode(held_old, tokenizer, cfg, max_len)
    n_recent = len(train)
    plan: ReplayPlan | None = None
    pick: list[int] = []
    rng = np.random.default_rng([cfg.seed, 1])
    if pool and n_recent and cfg.replay_share is not None and cfg.replay_share > 0:
        # r / (n + r) = share  =>  r = n * share / (1 - share)
        want = round(n_recent * cfg.replay_share / (1 - cfg.replay_share))
        pick = sorted(int(i) for i in rng.permutation(len(pool))[:want])
    elif pool and n_recent and cfg.replay_share is None:
        agreement = old_agreement(held_old_rows) if old_agreement is not None and len(held_old_rows) else None
        plan = plan_replay(
            recent_rows=n_recent,
            recent_categories=Counter(_category(t) for t in recent),
            available=Counter(_category(t) for t in pool),
            old_agreement=agreement,
            max_share=cfg.max_replay_share,
        )
        for category, n in sorted(plan.per_category.items()):
            members = [i for i, t in enumerate(pool) if _category(t) == category]
            pick += [members[int(j)] for j in rng.permutation(len(members))[:n]]
        pick.sort()
    replayed = [pool[i] for i in pick]
    replay = _encode(replayed, tokenizer, cfg, max_len)
    trained = TrainedContent.of(t.content for t in (*train_recent, *replayed))
    overlap = overlap_count((t.content for t in (*held, *held_old)), trained)
    train.ids += replay.ids
    train.starts += replay.starts
    train.keys += replay.keys
    if len(train) < cfg.min_train_rows or not len(held_rows):
        raise NotEnoughDataError(
            f"{len(train)} usable training rows and {len(held_rows)} held out from {len(recent)} recent "
            f"traces; need at least {cfg.min_train_rows} and 1"
        )
    split = {
        "train_rows": len(train),
        "held_out_rows": len(held_rows),
        "held_out_old_rows": len(held_old_rows),
        "held_out_dropped_as_trained": dropped,
        # Traces whose content key (document) the split held out to give a category held-out rows.
        "held_out_reserved_keys": len(reserved),
        # Trainable traces left out because their document already gave max_rows_per_key rows.
        "dropped_over_key_cap": capped,
        # Held-out traces whose prompt or document is among the traces trained on (0 by construction).
        "heldout_prompt_overlap": overlap,
    }
    return RealignDataset(train, held_rows, n_recent, len(replay), held_old_rows, plan, split)


def reserve_keys(traces: Sequence[TraceText], cfg: RealignConfig) -> set[str]:
    """Content keys held out beyond the hash split, so that every category the traces hold is
    scored on rows whose document never reached training.

    Per category (both windows together), while fewer than ``cfg.holdout_rows_per_category`` of
    its traces are held out, the next key in the split's own order (the smallest hash value first:
    the keys a larger ``holdout_share`` would hold out next) is held out too, unless that would put
    more than ``cfg.max_reserved_share`` of the category's traces on the held-out side (a key that
    carries too much of its category is skipped). A category whose traces all share one key keeps
    it for training. Without this, traffic cut from a few recurring documents (a handful of keys
    per category) rarely has a held-out document at a 10% share, and the weights are then chosen
    with no held-out view of that category at all.
    """
    need = cfg.holdout_rows_per_category
    if need <= 0:
        return set()
    by_category: dict[str, Counter[str]] = {}
    for t in traces:
        by_category.setdefault(_category(t), Counter())[t.key] += 1
    reserved: set[str] = set()
    for counts in by_category.values():
        if len(counts) < 2:
            continue
        total = sum(counts.values())
        held = sum(n for key, n in counts.items() if is_held_out(key, cfg.seed, cfg.holdout_share))
        cap = max(need, int(cfg.max_reserved_share * total))
        for key in sorted(counts, key=lambda k: holdout_rank(k, cfg.seed)):
            if held >= need:
                break
            if is_held_out(key, cfg.seed, cfg.holdout_share) or held + counts[key] > cap:
                continue
            reserved.add(key)
            held += counts[key]
    return reserved


def _balanced(traces: Sequence[TraceText], limit: int) -> list[TraceText]:
    """At most ``limit`` traces, shared among the categories as evenly as their counts allow (each
    category's first ones, the order kept): every category keeps held-out rows however the traffic
    mixes them, and scoring costs what ``limit`` rows cost."""
    queues: dict[str, list[int]] = {}
    for i, t in enumerate(traces):
        queues.setdefault(_category(t), []).append(i)
    picked: list[int] = []
    depth = 0
    while len(picked) < limit and any(depth < len(q) for q in queues.values()):
        for queue in queues.values():
            if depth < len(queue) and len(picked) < limit:
                picked.append(queue[depth])
        depth += 1
    return [traces[i] for i in sorted(picked)]


def _cap_per_key(
    traces: list[TraceText], limit: int | None, seed: int, taken: Counter[str] | None = None
) -> list[TraceText]:
    """At most ``limit`` traces per content key, counting the ``taken`` ones already trained on
    (a seeded choice among a key's traces, their order kept); None: all."""
    if limit is None:
        return traces
    rng = np.random.default_rng([seed, 3])
    members: dict[str, list[int]] = {}
    for i, t in enumerate(traces):
        members.setdefault(t.key, []).append(i)
    keep: list[int] = []
    for key, indices in members.items():
        room = max(0, limit - (taken or Counter())[key])
        chosen = rng.permutation(len(indices))[:room] if len(indices) > room else range(len(indices))
        keep += [indices[int(j)] for j in chosen]
    return [traces[i] for i in sorted(keep)]


def _hold_out_one(train_recent: list[TraceText], pool: Sequence[TraceText]) -> list[TraceText]:
    """The newest recent trace whose prompt and document no other trainable trace shares, moved
    out of ``train_recent`` (none such: nothing is held out)."""
    contents = [t.content for t in (*train_recent, *pool)]
    prompts = Counter(c.prompt_hash for c in contents)
    documents = Counter(c.document for c in contents if c.document is not None)
    for i in reversed(range(len(train_recent))):
        content = contents[i]
        if prompts[content.prompt_hash] == 1 and (
            content.document is None or documents[content.document] == 1
        ):
            return [train_recent.pop(i)]
    return []


def _category(trace: TraceText) -> str:
    return trace.category or UNCATEGORIZED


def pad_rows(ids: Sequence[torch.Tensor], pad_id: int) -> torch.Tensor:
    width = max(len(t) for t in ids)
    out = torch.full((len(ids), width), pad_id, dtype=torch.long)  # [B, T]
    for i, t in enumerate(ids):
        out[i, : len(t)] = t
    return out


def _features(model: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    """tokens [B, T] -> final-normed hidden states [B, T, D]: ``Transformer.forward`` without the
    output projection, so that the [*, V] logits are computed only where a loss needs them (the
    projection is over half of a small drafter's work and most positions are prompt)."""
    t = tokens.shape[1]
    cos, sin = model.rope_cos[:t].to(model.dtype), model.rope_sin[:t].to(model.dtype)  # [T, hd]
    h = model.model.embed_tokens(tokens)  # [B, T, D]
    for layer in model.model.layers:
        assert isinstance(layer, DecoderLayer)
        h = h + layer.self_attn(layer.input_layernorm(h), cos, sin)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    out: torch.Tensor = model.model.norm(h)
    return out


def _completion_index(rows: Rows, picks: Sequence[int], width: int) -> torch.Tensor:
    """Flat indices into a [B, width] grid of the positions whose next token is a completion token."""
    parts = [torch.arange(rows.starts[i] - 1, len(rows.ids[i]) - 1) + b * width for b, i in enumerate(picks)]
    return torch.cat(parts)  # [N]


def _completion_features(
    model: Transformer, rows: Rows, picks: Sequence[int], device: torch.device
) -> torch.Tensor:
    """Final-normed hidden states at the completion positions of the picked rows: [N, D].

    Right padding is harmless under causal attention: no real position attends to a pad.
    """
    batch = pad_rows([rows.ids[i] for i in picks], 0).to(device)  # [B, T]
    inputs = batch[:, :-1]  # [B, T-1]
    index = _completion_index(rows, picks, inputs.shape[1]).to(device)  # [N]
    return _features(model, inputs).flatten(0, 1)[index]  # [N, D]


def completion_logits(
    model: Transformer, rows: Rows, picks: Sequence[int], device: torch.device
) -> torch.Tensor:
    """Logits at the completion positions of the picked rows, concatenated: [N, V] (float32).

    What the drafter trains through; scoring without gradients goes through chunks of positions
    instead (``_chunk_logits``), so that no [N, V] tensor is needed.
    """
    with autocast_for(device):
        logits: torch.Tensor = model.lm_head(_completion_features(model, rows, picks, device))  # [N, V]
    return logits.float()


def _chunk_logits(
    model: Transformer, hidden: torch.Tensor, device: torch.device, columns: int | None = None
) -> torch.Tensor:
    """hidden [R, D] -> float32 logits [R, columns] over the first ``columns`` vocabulary rows
    (all of the model's when None): the head's other rows are never multiplied."""
    with autocast_for(device):
        if columns is None or columns >= model.config.vocab_size:
            logits: torch.Tensor = model.lm_head(hidden)
        else:
            logits = F.linear(hidden, model.lm_head.weight[:columns])
    return logits.float()


def rows_per_chunk(vocab_size: int, budget_mb: float, bytes_per_logit: int, top_k: int = 0) -> int:
    """How many positions' logits to compute at once: the largest R with
    R * (vocab_size * bytes_per_logit + top_k * TOPK_BYTES_PER_ENTRY) <= budget_mb MiB, and at
    least 1 (one position's logits are the least a pass can hold, whatever the budget)."""
    if vocab_size < 1 or bytes_per_logit < 1 or top_k < 0:
        raise ValueError(f"vocab_size {vocab_size}, bytes_per_logit {bytes_per_logit}, top_k {top_k}")
    per_row = vocab_size * bytes_per_logit + top_k * TOPK_BYTES_PER_ENTRY
    return max(1, int(budget_mb * 2**20) // per_row)


@torch.no_grad()
def teacher_targets(
    target: Transformer,
    rows: Rows,
    top_k: int,
    device: torch.device,
    batch_rows: int = 16,
    *,
    columns: int | None = None,
    memory_mb: float = 1024.0,
) -> Teacher:
    """Run the target once over every row and keep its top-K next-token distribution.

    ``columns``: the vocabulary range the drafter shares with the target (the first ``columns``
    rows; all of the target's when None). The distribution is taken over that range, so every kept
    id is one the drafter has. Logits are computed ``rows_per_chunk`` positions at a time within
    ``memory_mb``. The target is only read (no mode, flag or device change): it may be a model a
    worker keeps loaded for other jobs.
    """
    width = min(columns or target.config.vocab_size, target.config.vocab_size)
    k = min(top_k, width)
    step = rows_per_chunk(width, memory_mb, SCORING_BYTES_PER_LOGIT, k)
    probs: list[torch.Tensor] = []
    index: list[torch.Tensor] = []
    mass = 0.0
    count = 0
    for lo in range(0, len(rows), batch_rows):
        picks = list(range(lo, min(len(rows), lo + batch_rows)))
        with autocast_for(device):
            hidden = _completion_features(target, rows, picks, device)  # [N, D]
        parts_p: list[torch.Tensor] = []
        parts_i: list[torch.Tensor] = []
        for start in range(0, len(hidden), step):
            p = torch.softmax(_chunk_logits(target, hidden[start : start + step], device, width), dim=-1)
            chunk_p, chunk_i = p.topk(k, dim=-1)  # [R, K]
            del p  # before the next chunk's logits: the budget holds one chunk at a time
            parts_p.append(chunk_p)
            parts_i.append(chunk_i)
        top_p, top_i = torch.cat(parts_p), torch.cat(parts_i).to(torch.int32)  # [N, K]
        mass += float(top_p.sum())
        count += len(top_p)
        offset = 0
        for i in picks:
            n = len(rows.ids[i]) - rows.starts[i]
            probs.append(top_p[offset : offset + n].cpu())
            index.append(top_i[offset : offset + n].cpu())
            offset += n
    return Teacher(probs, index, mass / max(count, 1))


def anchor_targets(
    incumbent: Transformer,
    data: RealignDataset,
    teacher: Teacher,
    top_k: int,
    device: torch.device,
    cfg: RealignConfig,
    picks: Sequence[int] | None = None,
) -> None:
    """Replace the targets of the training rows ``picks`` (None: the replayed rows, the last
    ``data.replay_rows``) with the incumbent's own top-K there, in place; with top_k 1 a point
    mass on its argmax."""
    if picks is None:
        picks = range(len(data.train) - data.replay_rows, len(data.train))
    picks = list(picks)
    if not picks:
        return
    rows = Rows([data.train.ids[i] for i in picks], [data.train.starts[i] for i in picks], [])
    own = teacher_targets(
        incumbent, rows, top_k, device, cfg.teacher_batch_rows, memory_mb=cfg.teacher_memory_mb
    )
    if top_k == 1:
        own = Teacher([torch.ones_like(p) for p in own.probs], own.index, 1.0)
    for j, i in enumerate(picks):
        teacher.probs[i] = own.probs[j]
        teacher.index[i] = own.index[j]


def steady_categories(
    recent: RowScores,
    old: RowScores | None,
    *,
    key: str,
    tolerance: float,
    min_positions: int,
    worth_keeping: float | None = None,
) -> list[str]:
    """The named categories the incumbent still serves as before: held out in both windows
    (``min_positions`` each at least), its ``key`` figure on the recent window no more than
    ``tolerance`` below the old one's, and at least ``worth_keeping`` there (None:
    ``OLD_NOTHING_TO_KEEP``, below which the learning-rate rule too finds nothing to protect).
    Uncategorized traffic cannot be matched across windows. A category it was as poor at before
    (the partial shift's structured requests, seen at 0.14 agreement among the no-speculation
    calibration requests of the old window) did not drift but holds nothing to keep: fitting its
    rows to the incumbent anchored every recent row and the realignment learnt nothing (140
    steps, agreement flat)."""
    if old is None:
        return []
    floor = OLD_NOTHING_TO_KEEP if worth_keeping is None else worth_keeping
    before = old.by_category()
    out = []
    for category, (positions, figures) in recent.by_category().items():
        if category == UNCATEGORIZED or category not in before:
            continue
        old_positions, old_figures = before[category]
        if (
            min(positions, old_positions) >= min_positions
            and figures[key] >= old_figures[key] - tolerance
            and figures[key] >= floor
        ):
            out.append(category)
    return out


def _gather(
    teacher: Teacher, picks: Sequence[int], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.cat([teacher.probs[i] for i in picks]).to(device),  # [N, K]
        torch.cat([teacher.index[i] for i in picks]).to(device=device, dtype=torch.long),  # [N, K]
    )


def token_targets(rows: Rows, width: int = 1, vocab_size: int | None = None) -> Teacher:
    """Targets without a target pass: each completion token as a point mass (probability 1).

    With these, the KL term is cross-entropy on the tokens the target wrote (sequence-level
    distillation) and the TVD term is 1 - q(token). ``width`` > 1 pads each position to that many
    entries with zero-probability ids (the token's successors modulo ``vocab_size``, all distinct
    from it), which leaves every term of ``distill_loss`` unchanged: so that rows fitted to a
    top-K distribution (the anchored ones) can share batches with them.
    """
    if width > 1 and (vocab_size is None or vocab_size < width):
        raise ValueError(f"padding to width {width} needs a vocabulary of at least {width} ids")
    probs, index = [], []
    for ids, start in zip(rows.ids, rows.starts, strict=True):
        nxt = ids[start:].unsqueeze(1)  # [N_i, 1]
        if width > 1:
            assert vocab_size is not None
            nxt = (nxt + torch.arange(width)) % vocab_size  # [N_i, width]
        point = torch.zeros(nxt.shape, dtype=torch.float32)
        point[:, 0] = 1.0
        index.append(nxt)
        probs.append(point)
    return Teacher(probs, index, 1.0)


def distill_loss(
    student_logits: torch.Tensor,
    top_p: torch.Tensor,
    top_i: torch.Tensor,
    tvd_weight: float,
    kl_weight: float = 1.0,
    ce_weight: float = 0.0,
    named: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, TVD) for student logits [N, V] against the teacher's top-K probs/ids [N, K].

    The student's distribution is over all of its V rows (what it drafts from: mass on rows the
    target lacks can never be accepted, so it counts against it); the teacher's ids lie in the
    shared range, hence in [0, V).

    KL term: cross-entropy to the renormalised top-K teacher (KL up to a constant). TVD term: with
    the teacher's mass outside its top K taken as zero, 0.5 * (sum_K |p - q| + (1 - sum_K q)).
    CE term: cross-entropy on the teacher's most likely token (column 0: top-K is sorted).

    ``named`` [N, K] (bool): the entries whose id is among the student's columns (a sampled
    vocabulary, ``TrainVocab``); the others must have teacher probability 0 (padding of token
    targets), their column in ``top_i`` is any valid one, and they count as q = 0, which leaves
    every term as it would be over the full vocabulary: a zero-probability entry adds q to
    sum |p - q| and takes it off 1 - sum q.
    """
    log_q = F.log_softmax(student_logits, dim=-1)  # [N, V]
    log_q_top = log_q.gather(-1, top_i)  # [N, K]
    q_top = log_q_top.exp()
    if named is not None:
        q_top = q_top * named
    tvd = 0.5 * ((top_p - q_top).abs().sum(-1) + (1 - q_top.sum(-1)).clamp_min(0)).mean()
    loss = tvd_weight * tvd
    if kl_weight:
        p_norm = top_p / top_p.sum(-1, keepdim=True)
        loss = loss + kl_weight * -(p_norm * log_q_top).sum(-1).mean()
    if ce_weight:
        loss = loss + ce_weight * -log_q_top[:, 0].mean()
    return loss, tvd


@dataclass
class RowScores:
    """Held-out sums per row: expected acceptance (sum over positions of sum_K min(p, q)), greedy
    agreements and completion positions, with each row's category."""

    accept: list[float] = field(default_factory=list)
    agree: list[float] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    categories: list[str] = field(default_factory=list)

    def __add__(self, other: RowScores) -> RowScores:
        return RowScores(
            self.accept + other.accept,
            self.agree + other.agree,
            self.positions + other.positions,
            self.categories + other.categories,
        )

    def figures(self, category: str | None = None) -> dict[str, float]:
        """Expected acceptance and greedy agreement per position, over every row or one category's."""
        picked = [i for i, c in enumerate(self.categories) if category is None or c == category]
        n = sum(self.positions[i] for i in picked)
        return {
            "expected_acceptance": sum(self.accept[i] for i in picked) / max(n, 1),
            "greedy_agreement": sum(self.agree[i] for i in picked) / max(n, 1),
        }

    def by_category(self) -> dict[str, tuple[int, dict[str, float]]]:
        """Per category: (completion positions, figures)."""
        out = {}
        for category in sorted(set(self.categories)):
            n = sum(p for p, c in zip(self.positions, self.categories, strict=True) if c == category)
            out[category] = (n, self.figures(category))
        return out


@torch.no_grad()
def score_rows(
    drafter: Transformer,
    rows: Rows,
    teacher: Teacher,
    device: torch.device,
    batch_rows: int = 16,
    memory_mb: float = 1024.0,
) -> RowScores:
    """Each row's held-out sums (see ``evaluate``), so that figures can be taken per category."""
    was_training = drafter.training
    drafter.eval()
    step = rows_per_chunk(drafter.config.vocab_size, memory_mb, SCORING_BYTES_PER_LOGIT)
    out = RowScores()
    for lo in range(0, len(rows), batch_rows):
        picks = list(range(lo, min(len(rows), lo + batch_rows)))
        with autocast_for(device):
            hidden = _completion_features(drafter, rows, picks, device)  # [N, D]
        top_p, top_i = _gather(teacher, picks, device)
        accept, agree = [], []
        for start in range(0, len(hidden), step):
            end = start + step
            q = torch.softmax(_chunk_logits(drafter, hidden[start:end], device), dim=-1)  # [R, V]
            accept.append(torch.minimum(top_p[start:end], q.gather(-1, top_i[start:end])).sum(-1))  # [R]
            agree.append((q.argmax(-1) == top_i[start:end, 0]).float())  # [R]
            del q
        per_accept, per_agree = torch.cat(accept).cpu(), torch.cat(agree).cpu()  # [N]
        offset = 0
        for i in picks:
            n = len(rows.ids[i]) - rows.starts[i]
            out.accept.append(float(per_accept[offset : offset + n].sum()))
            out.agree.append(float(per_agree[offset : offset + n].sum()))
            out.positions.append(n)
            out.categories.append(rows.category(i))
            offset += n
    drafter.train(was_training)
    return out


def evaluate(
    drafter: Transformer,
    rows: Rows,
    teacher: Teacher,
    device: torch.device,
    batch_rows: int = 16,
    memory_mb: float = 1024.0,
) -> dict[str, float]:
    """Held-out expected acceptance (sum over the teacher's top K of min(p, q): a lower bound on
    1 - TVD, tight when the top K holds the mass) and greedy agreement (drafter argmax = target's).

    q is the drafter's distribution over all of its rows, scored ``rows_per_chunk`` positions at a
    time within ``memory_mb``; the teacher's ids lie in the range both models share."""
    return score_rows(drafter, rows, teacher, device, batch_rows, memory_mb).figures()


# ------------------------------------------------------------------------------------------ training


def selection_key(cfg: RealignConfig, held_out: Rows, held_teacher: Teacher) -> str:
    """The held-out figure weights are chosen by: ``cfg.select_on``, or for "auto" greedy agreement
    when the held-out completions are the target's argmax (greedy traffic), else expected acceptance."""
    if cfg.select_on != "auto":
        return cfg.select_on
    return "greedy_agreement" if _argmax_share(held_out, held_teacher) >= 0.95 else "expected_acceptance"


def _argmax_share(rows: Rows, teacher: Teacher) -> float:
    """Share of completion tokens that are the target's most likely token (1.0: greedy traffic)."""
    hits = total = 0
    for ids, start, index in zip(rows.ids, rows.starts, teacher.index, strict=True):
        hits += int((ids[start:] == index[:, 0]).sum())
        total += len(index)
    return hits / max(1, total)


def run_device(setting: str | None, target: Transformer) -> torch.device:
    """Where a realignment runs: where the target is (``setting`` None), else the setting's device,
    which must hold the target already. Moving the target here would move the caller's model in
    place (``Module.to`` does), and that model may be one a worker keeps loaded for other jobs."""
    if setting is None:
        return target.device
    device = resolve_device(setting)
    if target.device != device:
        raise ValueError(
            f"the target is on {target.device} but the realignment is set to run on {device}: load "
            "the target on the device the run uses (realign never moves the target)"
        )
    return device


# Peak learning rate for a drafter that does not know the new traffic at all (measured on the
# structured shift, 200 traces, 84 steps: held-out greedy agreement 0.69 at 3e-4, 0.89 at 2e-3,
# 0.91 at 5e-3; on code, where the incumbent already agreed 74%, 2e-3 first lost ground).
NOVEL_TRAFFIC_LR = 4e-3
KNOWN_AGREEMENT = 0.7  # held-out greedy agreement above which the incumbent counts as knowing it
# Peak learning rate while replayed old traffic must be kept (measured on the structured shift,
# 1,024 recent and 512 old prose traces, old rows fitted to the incumbent: at 3.4e-3 structured
# 89.3% and prose -4.8 points on unseen requests, at 1.5e-3 87.0% and -3.1, at 1e-3 85.7% and -3.0).
PROTECTED_LR = 1.5e-3
# The incumbent's held-out greedy agreement on the old traffic from which it is wholly protected
# (PROTECTED_LR), and below which it has too little there to protect (no cap); linear between.
# The bundled generic drafter agrees ~0.6 on prose. SmolLM2-135M's day-0 drafter agreed 0.21 on
# chat, and under the cap its realignment on structured work was short of steps: held-out greedy
# agreement 0.40 after 92 steps at 1.5e-3; at 4e-3, 0.74 after 200 steps (the 10-epoch cap), chat
# 0.5 points lower (bench/real_model_loop_offline.py, a loaded 2-core machine).
OLD_WORTH_KEEPING = 0.5
OLD_NOTHING_TO_KEEP = 0.25


def choose_lr(
    train_tokens: int,
    start_agreement: float | None = None,
    protects_old: bool = False,
    old_agreement: float | None = None,
) -> float:
    """Fine-tuning learning rate. On traffic the incumbent already predicts, small (and smaller on
    little data), where a large step overwrites what it knows; on traffic it barely agrees with
    the target on, there is little to overwrite and a CPU budget allows few steps: larger, unless
    replayed old traffic must be kept (``protects_old``): then at most ``PROTECTED_LR``, a cap
    lifted as the incumbent's agreement on the old traffic (``old_agreement``, None: unknown, a
    full cap) falls from OLD_WORTH_KEEPING to OLD_NOTHING_TO_KEEP."""
    base = float(min(1e-3, max(3e-4, 1e-3 * math.sqrt(train_tokens / 60_000))))
    if start_agreement is None:
        return base
    novelty = min(1.0, max(0.0, (KNOWN_AGREEMENT - start_agreement) / KNOWN_AGREEMENT))
    lr = base + novelty * (NOVEL_TRAFFIC_LR - base)
    if not protects_old or lr <= PROTECTED_LR:
        return lr
    if old_agreement is None:
        return PROTECTED_LR
    span = OLD_WORTH_KEEPING - OLD_NOTHING_TO_KEEP
    protection = min(1.0, max(0.0, (old_agreement - OLD_NOTHING_TO_KEEP) / span))
    return PROTECTED_LR + (1.0 - protection) * (lr - PROTECTED_LR)


def realign(
    target: Transformer,
    incumbent: Transformer,
    tokenizer: Tokenizer,
    recent: Sequence[TraceText],
    older: Sequence[TraceText] = (),
    cfg: RealignConfig | None = None,
    progress: ProgressFn | None = None,
) -> RealignResult:
    """Distil a new drafter from ``target`` on the traces, starting from ``incumbent``'s weights.

    Neither model is modified: ``incumbent``'s weights are copied into the drafter that trains, and
    ``target`` is only read (forward passes without gradients, on the device it is on; no ``.to()``,
    no ``eval()``/``requires_grad_`` flips), so it may be a model a worker keeps loaded between
    jobs. Target and incumbent may have different embedding row counts (padded vocabularies of
    one tokenizer): the teacher's distribution is taken over the rows both share. Raises
    RealignCancelledError when ``progress`` returns False, NotEnoughDataError when the traces
    cannot make a training and a held-out set.
    """
    cfg = cfg or RealignConfig()
    if cfg.replay_teacher not in ("incumbent", "target"):
        raise ValueError(f"replay_teacher must be 'incumbent' or 'target', got {cfg.replay_teacher!r}")
    if cfg.teacher not in ("auto", "topk", "tokens"):
        raise ValueError(f"teacher must be 'auto', 'topk' or 'tokens', got {cfg.teacher!r}")
    if cfg.scoring_teacher not in ("auto", "target", "tokens"):
        raise ValueError(f"scoring_teacher must be 'auto', 'target' or 'tokens', got {cfg.scoring_teacher!r}")
    if cfg.select_on not in ("auto", "expected_acceptance", "greedy_agreement"):
        raise ValueError(
            f"select_on must be 'expected_acceptance' or 'greedy_agreement', got {cfg.select_on!r}"
        )
    started = time.perf_counter()
    device = run_device(cfg.device, target)
    columns = shared_vocab_size(target, incumbent)
    if tokenizer.vocab_size > columns:
        raise ValueError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but the target and the drafter share "
            f"only {columns} embedding rows"
        )
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    report = progress or (lambda _f, _m: True)

    def checkpoint(fraction: float, message: str) -> None:
        if not report(fraction, message):
            raise RealignCancelledError(message)

    torch.manual_seed(cfg.seed)
    max_len = min(target.config.max_seq_len, incumbent.config.max_seq_len)
    # The drafter that trains starts as a float32 copy of the incumbent on the run's device; before
    # any step it is the incumbent, so it scores the incumbent too.
    model = copy.deepcopy(incumbent).to(device=device, dtype=torch.float32)
    model.invalidate_fast_path()
    old_scoring: dict[str, Any] = {}

    def targets(rows: Rows) -> Teacher:
        return teacher_targets(
            target,
            rows,
            cfg.teacher_top_k,
            device,
            cfg.teacher_batch_rows,
            columns=columns,
            memory_mb=cfg.teacher_memory_mb,
        )

    scoring = cfg.scoring_teacher
    probe_s_per_token: float | None = None
    if scoring == "auto":
        probe_s_per_token = _target_seconds_per_token(targets, recent, tokenizer, cfg, max_len)
        windows = 2 if older else 1
        # Batches are padded to their longest row: project at the longest of a few traces (mixed
        # traffic, chat beside long few-shot prompts, ran 3x the one-row projection on SmolLM2).
        sample = _encode(recent[: cfg.teacher_batch_rows], tokenizer, cfg, max_len)
        row_len = max((len(ids) for ids in sample.ids), default=0)
        projected_scoring_s = probe_s_per_token * row_len * cfg.max_holdout_rows * windows
        scoring = "tokens" if projected_scoring_s > cfg.scoring_budget_share * cfg.time_budget_s else "target"

    def scoring_targets(rows: Rows) -> Teacher:
        return token_targets(rows) if scoring == "tokens" else targets(rows)

    def incumbent_on_old(rows: Rows) -> float:
        t0 = time.perf_counter()
        old_scoring["teacher"] = scoring_targets(rows)
        old_scoring["incumbent"] = evaluate(
            model, rows, old_scoring["teacher"], device, cfg.batch_rows, cfg.teacher_memory_mb
        )
        old_scoring["seconds"] = time.perf_counter() - t0
        return float(old_scoring["incumbent"]["greedy_agreement"])

    data = build_dataset(recent, older, tokenizer, cfg, max_len, incumbent_on_old)
    if len(data.held_out_old) and "teacher" not in old_scoring:  # a fixed replay share: still measured
        incumbent_on_old(data.held_out_old)
    checkpoint(
        0.02,
        f"dataset: {len(data.train)} train rows ({data.replay_rows} replay), {len(data.held_out)} held out"
        + (f"; {data.replay_plan.reason}" if data.replay_plan is not None else ""),
    )

    t_teacher = time.perf_counter()
    held_teacher = scoring_targets(data.held_out)
    held_s = time.perf_counter() - t_teacher
    row_tokens = sum(len(t) for t in data.train.ids)
    held_tokens = sum(len(t) for t in data.held_out.ids)
    if scoring == "tokens":
        projected_s = (probe_s_per_token or math.inf) * row_tokens
    else:
        projected_s = held_s * row_tokens / max(1, held_tokens)
    mode = cfg.teacher
    if mode == "auto":
        mode = "topk" if projected_s <= cfg.teacher_budget_share * cfg.time_budget_s else "tokens"
    anchor_k = min(cfg.teacher_top_k, columns)
    if mode == "tokens":
        # Padded to the anchor's width, so that anchored rows get the incumbent's whole top-K (a
        # point mass on its argmax alone anchors far less of what it knew).
        wide = cfg.replay_teacher == "incumbent" and cfg.wide_anchor
        anchor_k = anchor_k if wide else 1
        teacher = token_targets(data.train, anchor_k, columns)
        teacher_tokens = held_tokens if scoring == "target" else 0
    else:
        teacher = targets(data.train)
        teacher_tokens = held_tokens + row_tokens
    # ``model`` is still the incumbent (no step taken).
    if cfg.replay_teacher == "incumbent" and data.replay_rows:
        anchor_targets(model, data, teacher, anchor_k, device, cfg)
    steady: list[str] = []
    if cfg.anchor_steady_categories and cfg.replay_teacher == "incumbent" and "teacher" in old_scoring:
        key = selection_key(cfg, data.held_out, held_teacher)
        steady = steady_categories(
            score_rows(model, data.held_out, held_teacher, device, cfg.batch_rows, cfg.teacher_memory_mb),
            score_rows(
                model,
                data.held_out_old,
                old_scoring["teacher"],
                device,
                cfg.batch_rows,
                cfg.teacher_memory_mb,
            ),
            key=key,
            tolerance=cfg.category_tolerance or 0.0,
            min_positions=cfg.min_category_positions,
        )
        recent_rows = len(data.train) - data.replay_rows
        picks = [i for i in range(recent_rows) if data.train.category(i) in steady]
        anchor_targets(model, data, teacher, anchor_k, device, cfg, picks)
        data.split["recent_rows_anchored"] = len(picks)
    data.split["steady_categories"] = len(steady)
    teacher_s = time.perf_counter() - t_teacher + old_scoring.get("seconds", 0.0)
    checkpoint(
        0.1,
        f"targets ready ({mode}, {teacher_s:.1f}s, held-out top-{cfg.teacher_top_k} mass "
        f"{held_teacher.coverage:.3f})",
    )
    with _threads(cfg.train_threads):
        return _train(
            model=model,
            data=data,
            teacher=teacher,
            held_teacher=held_teacher,
            old_teacher=old_scoring.get("teacher"),
            old_before=old_scoring.get("incumbent"),
            cfg=cfg,
            device=device,
            started=started,
            teacher_s=teacher_s,
            teacher_tokens=teacher_tokens,
            shared_vocab=columns,
            teacher_mode=mode,
            scoring_mode=scoring,
            teacher_projected_s=projected_s,
            checkpoint=checkpoint,
        )


def _target_seconds_per_token(
    targets: Callable[[Rows], Teacher],
    traces: Sequence[TraceText],
    tokenizer: Tokenizer,
    cfg: RealignConfig,
    max_len: int,
) -> float:
    """Seconds the target's top-K pass takes per row token, timed on the first trace (the second
    of two passes: the first pays one-off warm-up); infinite when no trace makes a row."""
    rows = _encode(traces[:1], tokenizer, cfg, max_len)
    if not len(rows):
        return math.inf
    targets(rows)
    t0 = time.perf_counter()
    targets(rows)
    return (time.perf_counter() - t0) / len(rows.ids[0])


@contextlib.contextmanager
def _threads(n: int | None) -> Iterator[None]:
    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _train(
    *,
    model: Transformer,
    data: RealignDataset,
    teacher: Teacher,
    held_teacher: Teacher,
    old_teacher: Teacher | None,
    old_before: dict[str, float] | None,
    cfg: RealignConfig,
    device: torch.device,
    started: float,
    teacher_s: float,
    teacher_tokens: int,
    shared_vocab: int,
    teacher_mode: str,
    scoring_mode: str,
    teacher_projected_s: float,
    checkpoint: Callable[[float, str], None],
) -> RealignResult:
    model.train()
    guard = cfg.category_tolerance is not None
    # Weights are judged on both windows, the old one at the weight the replay gave it: the
    # planned replay share says how much the old traffic matters beside the new.
    old_weight = 0.0
    if old_teacher is not None and old_before is not None:
        old_weight = selection_old_weight(cfg, data)
    score_old = old_teacher is not None and len(data.held_out_old) > 0 and (bool(old_weight) or guard)

    def scored() -> tuple[RowScores, RowScores | None]:
        new = score_rows(model, data.held_out, held_teacher, device, cfg.batch_rows, cfg.teacher_memory_mb)
        if not score_old or old_teacher is None:
            return new, None
        old = score_rows(model, data.held_out_old, old_teacher, device, cfg.batch_rows, cfg.teacher_memory_mb)
        return new, old

    t_eval = time.perf_counter()
    new_before, old_rows_before = scored()
    eval_s = time.perf_counter() - t_eval
    before = new_before.figures()
    greedy_share = _argmax_share(data.held_out, held_teacher)
    key = selection_key(cfg, data.held_out, held_teacher)
    # The guard's floors: each category's held-out figure (both windows' rows pooled) for the
    # incumbent, less the tolerance, where enough positions were held out to tell.
    pooled_before = _pooled(new_before, old_rows_before)
    categories_before = pooled_before.by_category()
    floors = floors_of(
        pooled_before, key=key, tolerance=cfg.category_tolerance, min_positions=cfg.min_category_positions
    )
    train_tokens = data.train.completion_tokens()
    lr = cfg.lr or choose_lr(
        train_tokens,
        before.get("greedy_agreement"),
        protects_old=data.replay_rows > 0,
        old_agreement=(old_before or {}).get("greedy_agreement"),
    )
    opt = make_optimizer(model, lr, cfg.weight_decay)
    n_rows = len(data.train)
    b = min(cfg.batch_rows, n_rows)
    order_rng = np.random.default_rng([cfg.seed, 2])

    def batches() -> Any:
        while True:  # epochs of a seeded permutation: every row once per epoch
            perm = order_rng.permutation(n_rows)
            for lo in range(0, n_rows - b + 1, b):
                yield [int(i) for i in perm[lo : lo + b]]

    stream = batches()

    vocab = TrainVocab.choose(cfg, teacher, model.config.vocab_size, device)
    vocab_rng = np.random.default_rng([cfg.seed, 4])

    def train_step(picks: list[int], step: int, total: int) -> tuple[float, float, int]:
        for g in opt.param_groups:
            g["lr"] = cosine_lr(step, total, lr, min(max(10, int(cfg.warmup_share * total)), total // 2))
        top_p, top_i = _gather(teacher, picks, device)
        named = None
        if vocab is None:
            logits = completion_logits(model, data.train, picks, device)  # [N, V]
        else:
            columns, column_of = vocab.draw(vocab_rng)
            with autocast_for(device):
                hidden = _completion_features(model, data.train, picks, device)  # [N, D]
                logits = F.linear(hidden, model.lm_head.weight[columns]).float()  # [N, C]
            logits = logits + vocab.stand_in(columns)  # [N, C]
            top_i = column_of[top_i]  # [N, K]: -1 where the id is not a column (probability 0)
            named = top_i >= 0
            top_i = top_i.clamp_min(0)
        loss, tvd = distill_loss(
            logits,
            top_p,
            top_i,
            cfg.tvd_weight,
            cfg.kl_weight,
            cfg.ce_weight,
            named,
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]  # torch leaves Tensor.backward unannotated
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        return float(loss.detach()), float(tvd.detach()), len(top_p)

    # Plan from timed steps (the second one: the first pays one-off warm-up): how many steps the
    # budget left allows once the evaluations are paid for, capped at max_epochs.
    steps_per_epoch = max(1, n_rows // b)
    cap = max(2, int(cfg.max_epochs * steps_per_epoch))
    # The incumbent's weights, taken before any step: what comes back if no evaluation beats them.
    best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    t_train = time.perf_counter()
    loss, tvd, tokens = train_step(next(stream), 0, cap)
    t_probe = time.perf_counter()
    loss, tvd, n = train_step(next(stream), 1, cap)
    tokens += n
    step_s = time.perf_counter() - t_probe
    left = cfg.time_budget_s - (time.perf_counter() - started) - (cfg.evals + 1) * eval_s
    total = max(2, min(cap, int(left / step_s)))
    eval_every = max(1, total // max(1, cfg.evals))

    def judged() -> Judged:
        new, old = scored()
        return judge(new, old, key=key, old_weight=old_weight, floors=floors)

    best = dict(before)
    best_value = (1 - old_weight) * before[key] + old_weight * (old_before or {}).get(key, 0.0)
    best_categories = {c: figures[key] for c, (_, figures) in categories_before.items()}
    best_step = 0
    # Patience runs on the value alone, kept or not: a category's held-out figure dips while the
    # new traffic is first learnt and recovers as training goes on (measured on the partial shift:
    # prose 0.586 -> 0.510 -> 0.526 over 18 steps), so a run that still gains overall goes on.
    bad_evals = 0
    top_value = best_value
    refused: list[dict[str, Any]] = []  # evaluations that gained overall but lost a category

    def entry(step: int, j: Judged, loss: float | None) -> dict[str, Any]:
        return {
            "step": step,
            **({"loss": round(loss, 4)} if loss is not None else {}),
            **{k: round(v, 4) for k, v in j.scores.items()},
            **_prefixed("old_", j.old_scores),
            **_prefixed("category_", j.per_category),
        }

    history: list[dict[str, Any]] = [
        {
            "step": 0,
            **{k: round(v, 4) for k, v in before.items()},
            **_prefixed("old_", old_before),
            **_prefixed("category_", best_categories),
        }
    ]
    steps_run = 2
    stop_reason = "planned steps done"
    for step in range(2, total):
        if step % eval_every == 0:
            j = judged()
            scores = j.scores
            history.append(entry(step, j, loss))
            if j.value > best_value + 1e-4 and j.below:
                refused.append({"step": step, "below_floor": j.below})
            if j.beats(best_value + 1e-4):
                best, best_value, best_step = scores, j.value, step
                best_categories = j.per_category
                best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            if j.value > top_value + 1e-4:
                top_value, bad_evals = j.value, 0
            else:
                bad_evals += 1
            checkpoint(
                0.1 + 0.85 * step / total,
                f"step {step}/{total}: held-out expected acceptance {scores['expected_acceptance']:.3f}, "
                f"greedy agreement {scores['greedy_agreement']:.3f}",
            )
            if bad_evals >= cfg.patience:
                stop_reason = f"early stop: no held-out gain in {cfg.patience} evaluations"
                break
        if time.perf_counter() - started > cfg.time_budget_s:
            stop_reason = "time budget spent"
            break
        loss, tvd, n = train_step(next(stream), step, total)
        tokens += n
        steps_run += 1
    train_s = time.perf_counter() - t_train
    last = judged()
    history.append(entry(steps_run, last, loss))
    if last.value > best_value and last.below:
        refused.append({"step": steps_run, "below_floor": last.below})
    if last.beats(best_value):
        best, best_step, best_categories = last.scores, steps_run, last.per_category
    else:
        model.load_state_dict(best_state)
    old_after = (
        evaluate(model, data.held_out_old, old_teacher, device, cfg.batch_rows, cfg.teacher_memory_mb)
        if old_teacher is not None
        else None
    )
    model.eval()
    wall_s = time.perf_counter() - started
    metrics = {
        "device": str(device),
        "train_rows": len(data.train),
        "recent_rows": data.recent_rows,
        "replay_rows": data.replay_rows,
        "held_out_rows": len(data.held_out),
        "held_out_split": data.split,
        "heldout_prompt_overlap": data.split.get("heldout_prompt_overlap"),
        "train_completion_tokens": train_tokens,
        "tokens_trained": tokens,
        "steps_planned": total,
        "steps_run": steps_run,
        "best_step": best_step,
        "stop_reason": stop_reason,
        "lr": lr,
        "teacher": teacher_mode,
        "scoring_teacher": scoring_mode,
        "train_vocab_rows": vocab.rows if vocab is not None else model.config.vocab_size,
        "train_vocab_named_rows": len(vocab.named) if vocab is not None else None,
        "replay_teacher": cfg.replay_teacher if data.replay_rows else None,
        "teacher_projected_s": round(teacher_projected_s, 2),
        "teacher_top_k_mass": round(held_teacher.coverage, 4),
        "select_on": key,
        "select_old_weight": round(old_weight, 4),
        "held_out_completions_that_are_target_argmax": round(greedy_share, 4),
        "threads": torch.get_num_threads(),
        "held_out_before": {k: round(v, 4) for k, v in before.items()},
        "held_out_after": {k: round(v, 4) for k, v in best.items()},
        # The same figures on both windows: recent traffic (what the drafter is for) and the traffic
        # before it (what it must not forget), each for the incumbent and the realigned drafter.
        "held_out_new": held_out_figures(len(data.held_out), before, best),
        "held_out_old": held_out_figures(len(data.held_out_old), old_before, old_after),
        # Per category, both windows' held-out rows pooled: what the guard compared (select_on).
        "held_out_by_category": {
            c: {
                "positions": positions,
                "incumbent": round(figures[key], 4),
                "realigned": round(best_categories.get(c, figures[key]), 4),
                "floor": round(floors[c], 4) if c in floors else None,
            }
            for c, (positions, figures) in categories_before.items()
        },
        "selection": {
            "figure": key,
            "category_tolerance": cfg.category_tolerance,
            "guarded_categories": sorted(floors),
            # Evaluations that beat the best so far overall but put a category below its floor.
            "refused": refused,
        },
        "replay_plan": data.replay_plan.as_dict() if data.replay_plan is not None else None,
        "history": history,
        "teacher_s": round(teacher_s, 2),
        "teacher_tokens": teacher_tokens,
        "teacher_tokens_per_s": round(teacher_tokens / max(teacher_s, 1e-9), 1),
        "shared_vocab_size": shared_vocab,
        "train_s": round(train_s, 2),
        "train_tokens_per_s": round(tokens / max(train_s, 1e-9), 1),
        "wall_s": round(wall_s, 2),
        "throughput_definition": "completion tokens trained on / seconds of the training phase "
        "(steps, held-out evaluations, best-weight copies; the target pass excluded, it is teacher_s)",
        "teacher_throughput_definition": "row tokens (prompt and completion) through the target / teacher_s",
        "config": asdict(cfg),
    }
    if device.type == "cuda":
        metrics["peak_gpu_memory_mb"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
    checkpoint(
        0.97,
        f"trained: held-out {key.replace('_', ' ')} {before[key]:.3f} -> {best[key]:.3f}",
    )
    return RealignResult(model, metrics)


@dataclass(frozen=True, slots=True)
class TrainVocab:
    """A sampled training vocabulary (``RealignConfig.train_vocab``): the rows every training
    target names, and ``negatives`` random others per step."""

    named: torch.Tensor  # [M] sorted ids with probability > 0 at some training position
    vocab_size: int
    negatives: int
    device: torch.device

    @property
    def rows(self) -> int:
        """Columns of one step's logits (at most: random draws may repeat or hit named rows)."""
        return min(self.vocab_size, len(self.named) + self.negatives)

    @classmethod
    def choose(
        cls, cfg: RealignConfig, teacher: Teacher, vocab_size: int, device: torch.device
    ) -> TrainVocab | None:
        """The sampled vocabulary ``cfg.train_vocab`` asks for, or None for the full one."""
        if cfg.train_vocab not in ("auto", "full", "sampled"):
            raise ValueError(f"train_vocab must be 'auto', 'full' or 'sampled', got {cfg.train_vocab!r}")
        if cfg.train_vocab == "full" or (
            cfg.train_vocab == "auto" and (device.type != "cpu" or vocab_size < SAMPLED_VOCAB_FROM)
        ):
            return None
        named = torch.unique(torch.cat([i[p > 0] for p, i in zip(teacher.probs, teacher.index, strict=True)]))
        vocab = cls(named.to(torch.long), vocab_size, max(0, cfg.train_vocab_negatives), device)
        if cfg.train_vocab == "auto" and vocab.rows > vocab_size // 2:
            return None
        return vocab

    def draw(self, rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """(columns [C]: the named ids then fresh random ones, column_of [V]: an id's column or -1)."""
        drawn = torch.from_numpy(rng.integers(0, self.vocab_size, self.negatives))
        column_of = torch.full((self.vocab_size,), -1, dtype=torch.long)
        column_of[self.named] = 0
        others = torch.unique(drawn[column_of[drawn] < 0])
        columns = torch.cat([self.named, others])  # [C]
        column_of[columns] = torch.arange(len(columns))
        return columns.to(self.device), column_of.to(self.device)

    def stand_in(self, columns: torch.Tensor) -> torch.Tensor:
        """What to add to a step's logits [C]: 0 for the named rows, and log(unnamed rows / drawn
        ones) for the drawn ones, so that each stands in for its share of the rows left out and
        the softmax's normaliser estimates the full vocabulary's (the sampled-softmax correction
        for uniform draws). Without it the unnamed rows are pushed down ~20x too gently and keep
        probability the full softmax then gives them. (On SmolLM2-135M's day-0 chat the two
        measured alike, held-out greedy agreement 0.187 without and 0.183 with at equal budgets:
        there the drafter is short of training steps, not of a better normaliser.)"""
        named = len(self.named)
        drawn = len(columns) - named
        out = torch.zeros(len(columns), device=columns.device)
        if drawn:
            out[named:] = math.log((self.vocab_size - named) / drawn)
        return out


@dataclass(frozen=True, slots=True)
class Judged:
    """One evaluation of the training drafter: the recent and old windows' figures, the value the
    weights are chosen by, the select_on figure per category, and the guarded categories below
    their floor (any: these weights are never kept)."""

    scores: dict[str, float]
    old_scores: dict[str, float] | None
    value: float
    per_category: dict[str, float]
    below: list[str]

    def beats(self, best_value: float) -> bool:
        """Whether these weights replace the best so far: a higher value, and no category below its floor."""
        return self.value > best_value and not self.below


def floors_of(
    incumbent: RowScores, *, key: str, tolerance: float | None, min_positions: int
) -> dict[str, float]:
    """Per category with at least ``min_positions`` held-out positions: the incumbent's ``key``
    figure there less ``tolerance`` (None: no floors)."""
    if tolerance is None:
        return {}
    return {
        c: figures[key] - tolerance
        for c, (positions, figures) in incumbent.by_category().items()
        if positions >= min_positions
    }


def judge(
    new: RowScores,
    old: RowScores | None,
    *,
    key: str,
    old_weight: float,
    floors: dict[str, float],
) -> Judged:
    """Judge weights from their held-out row scores on the recent window (``new``) and the old one:
    the value is the recent figure, mixed with the old one at ``old_weight``; a category whose
    figure (both windows' rows pooled) is below its floor is named in ``below``."""
    scores = new.figures()
    old_scores = old.figures() if old is not None else None
    value = scores[key]
    if old_weight and old_scores is not None:
        value = (1 - old_weight) * scores[key] + old_weight * old_scores[key]
    per_category = {c: figures[key] for c, (_, figures) in _pooled(new, old).by_category().items()}
    below = sorted(c for c, floor in floors.items() if per_category.get(c, floor) < floor)
    return Judged(scores, old_scores, value, per_category, below)


def _pooled(new: RowScores, old: RowScores | None) -> RowScores:
    return new if old is None else new + old


def selection_old_weight(cfg: RealignConfig, data: RealignDataset) -> float:
    """The old window's weight when weights are judged: ``cfg.select_old_weight`` when set, else
    the replay share of the training rows (planned or fixed); 0 without held-out old rows."""
    if not len(data.held_out_old):
        return 0.0
    if cfg.select_old_weight is not None:
        return min(1.0, max(0.0, cfg.select_old_weight))
    return data.replay_rows / max(1, len(data.train))


def _prefixed(prefix: str, scores: dict[str, float] | None) -> dict[str, float]:
    return {prefix + k: round(v, 4) for k, v in (scores or {}).items()}


def held_out_figures(
    rows: int, incumbent: dict[str, float] | None, realigned: dict[str, float] | None
) -> dict[str, Any]:
    """Held-out scores of one traffic window: row count, incumbent's and realigned drafter's."""

    def rounded(scores: dict[str, float] | None) -> dict[str, float] | None:
        return None if scores is None else {k: round(v, 4) for k, v in scores.items()}

    return {"rows": rows, "incumbent": rounded(incumbent), "realigned": rounded(realigned)}


# ------------------------------------------------------------------------------------------ artifact


@dataclass(frozen=True, slots=True)
class Artifact:
    path: Path
    sha256: str  # of model.safetensors
    manifest: dict[str, Any]
    manifest_sha256: str  # of MANIFEST.json: what every later load verifies first


def save_drafter(
    model: Transformer,
    tokenizer: Tokenizer,
    folder: str | Path,
    *,
    num_speculative_tokens: int = 4,
    metadata: dict[str, Any] | None = None,
) -> Artifact:
    """Write the HF folder, the vLLM ``--speculative-config`` JSON and a sha256 manifest of every file.

    Written to a temporary sibling and renamed, so a crash never leaves a half-written artifact
    at ``folder`` (a rerun overwrites any earlier attempt's folder). The speculative config names
    the drafter by its folder name: the serving side points it at its own verified local copy.
    """
    final = Path(folder)
    tmp = final.with_name(final.name + ".tmp")
    if tmp.exists():
        _remove_tree(tmp)
    sha = save_hf_folder(model, tokenizer, tmp, metadata={"realign": "1"})
    spec = {
        "model": final.name,
        "method": "draft_model",
        "num_speculative_tokens": num_speculative_tokens,
    }
    (tmp / SPEC_CONFIG_NAME).write_text(json.dumps(spec, indent=2) + "\n")
    manifest_sha = write_manifest(tmp, metadata=metadata or {})
    if final.exists():
        _remove_tree(final)
    tmp.rename(final)
    return Artifact(final, sha, json.loads((final / MANIFEST_NAME).read_text()), manifest_sha)


def verify_artifact(folder: str | Path, manifest_sha256: str | None = None) -> bool:
    """True when the manifest (and, given, its digest) and every file it names still match."""
    try:
        verify_artifact_folder(folder, manifest_sha256)
    except ArtifactVerificationError:
        return False
    return True


def _remove_tree(path: Path) -> None:
    for child in path.iterdir():
        child.unlink() if child.is_file() else _remove_tree(child)
    path.rmdir()
