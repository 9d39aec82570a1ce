"""EAGLE-3-style draft heads: a decoder layer over the target's own hidden states.

Owns `HeadConfig`, `EagleHead` and `HeadProposer`. A head drafts from what the target already
computed: the residual-stream states entering a few of the target's layers (low, middle, high:
EAGLE-3's fusion; `HeadConfig.aux_layers`, indices as `Transformer.forward_cached`'s
``hidden_layers``), fused by `fc` to one vector per position, paired with the embedding of the
token that follows that position (the target's own embedding table, shared, never stored by the
head). One decoder layer whose attention reads both halves ([embedding ; state], 2·D wide) turns
each pair into the state of the next position, and its own output projection over a reduced
*draft vocabulary* (the ids training traffic uses; ``d2t`` maps a draft id to the target's:
target = draft + d2t[draft]) proposes the token after it. From the second draft on, the head's
own output state (before its final norm) stands in for the target's: drafting is autoregressive in
the head's features, as EAGLE does.

Parameter and buffer names are those of the EAGLE-3 checkpoints vLLM and SGLang load (``fc``,
``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``), so export is a copy, not a translation.

`HeadProposer` keeps the head's own KV cache. The decoder hands it the target's states for every
position a target pass verified (`observe`: the prompt after prefill, then the accepted rows of each
verify pass), so the head needs no target pass of its own; `propose` feeds the new (state, next
token) pairs in one forward, then drafts. Training (``workers.training.eagle``) unrolls the same
layer on its own outputs with the attention pattern drafting produces (`EagleHead.unrolled`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from workers.engine.model import MLP, KVCache, ModelConfig, RMSNorm, Transformer, _rope_inv_freq, apply_rope
from workers.engine.proposers import Proposals, check_confidence_threshold
from workers.engine.verifier import SamplingParams, logits_to_probs, sample_from


def default_aux_layers(n_layers: int) -> tuple[int, ...]:
    """Which target states a head fuses: vLLM's EAGLE-3 choice (entering layers 2, L/2 and L-3)
    where those are three distinct layers, else a low, a middle and the last layer's input."""
    upstream = (2, n_layers // 2, n_layers - 3)
    if len(set(upstream)) == 3 and all(0 <= i < n_layers for i in upstream):
        return upstream
    return tuple(sorted({min(1, n_layers - 1), n_layers // 2, n_layers - 1}))


@dataclass
class HeadConfig:
    hidden_size: int  # = the target's: the shared embedding and the fused state are that wide
    intermediate_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int  # the target's embedding rows: drafts are target ids
    draft_vocab_size: int
    aux_layers: tuple[int, ...]
    max_seq_len: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    rope_scaling: dict[str, Any] | None = field(default=None)
    # EAGLE-3 variants differ in whether the residual is the fused state before or after hidden_norm.
    norm_before_residual: bool = False

    def __post_init__(self) -> None:
        self.aux_layers = tuple(int(i) for i in self.aux_layers)
        if not self.aux_layers:
            raise ValueError("a head fuses at least one target layer's states")
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} not in 1..{self.vocab_size}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")

    @classmethod
    def for_target(
        cls,
        target: ModelConfig,
        draft_vocab_size: int,
        aux_layers: Sequence[int] | None = None,
        intermediate_size: int | None = None,
    ) -> HeadConfig:
        """A head shaped like one of the target's layers (its width, heads and rotary)."""
        layers = tuple(aux_layers) if aux_layers is not None else default_aux_layers(target.n_layers)
        if any(not 0 <= i <= target.n_layers for i in layers):
            raise ValueError(f"aux layers {layers}: the target has layers 0..{target.n_layers}")
        return cls(
            hidden_size=target.dim,
            intermediate_size=intermediate_size or target.ffn_dim,
            n_heads=target.n_heads,
            n_kv_heads=target.n_kv_heads,
            head_dim=target.hd,
            vocab_size=target.vocab_size,
            draft_vocab_size=draft_vocab_size,
            aux_layers=layers,
            max_seq_len=target.max_seq_len,
            rope_theta=target.rope_theta,
            norm_eps=target.norm_eps,
            rope_scaling=target.rope_scaling,
        )

    def layer_config(self) -> ModelConfig:
        """The decoder layer's shape as a one-layer model config (its KV cache and rotary tables)."""
        return ModelConfig(
            vocab_size=self.draft_vocab_size,
            dim=self.hidden_size,
            n_layers=1,
            n_heads=self.n_heads,
            n_kv_heads=self.n_kv_heads,
            ffn_dim=self.intermediate_size,
            max_seq_len=self.max_seq_len,
            rope_theta=self.rope_theta,
            norm_eps=self.norm_eps,
            head_dim=self.head_dim,
            rope_scaling=self.rope_scaling,
        )

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["aux_layers"] = list(self.aux_layers)
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HeadConfig:
        return cls(**d)


def check_head_fits(head: HeadConfig, target: ModelConfig) -> None:
    """A head reads the target's states and embeddings: their widths, vocabulary and layers must match."""
    if head.hidden_size != target.dim or head.vocab_size != target.vocab_size:
        raise ValueError(
            f"the head is for a target of width {head.hidden_size} and {head.vocab_size} embedding rows; "
            f"this target has {target.dim} and {target.vocab_size}"
        )
    if any(i > target.n_layers for i in head.aux_layers):
        raise ValueError(
            f"the head reads layers {list(head.aux_layers)}; the target has 0..{target.n_layers}"
        )


class _HeadAttention(nn.Module):
    """Attention whose queries, keys and values read [embedding ; state] (2·D wide)."""

    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        d, hd = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(2 * d, cfg.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(2 * d, cfg.n_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(2 * d, cfg.n_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * hd, d, bias=False)


class _MidLayer(nn.Module):
    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        self.self_attn = _HeadAttention(cfg)
        self.mlp = MLP(cfg.layer_config())
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)  # on the token embedding
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)  # on the fused (or fed-back) state
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)


class EagleHead(nn.Module):
    d2t: torch.Tensor  # [Vd] int64: target id = draft id + d2t[draft id]
    t2d: torch.Tensor  # [V] bool: which target ids the draft vocabulary holds
    embed_weight: torch.Tensor  # [V, D]: the target's token embeddings (shared, not saved)
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor
    positions: torch.Tensor

    def __init__(
        self, cfg: HeadConfig, embed_weight: torch.Tensor, draft_ids: torch.Tensor | None = None
    ) -> None:
        """``embed_weight``: the target's embedding table; ``draft_ids``: the target ids of the draft
        vocabulary in draft-id order (None: the first ``draft_vocab_size`` ids)."""
        super().__init__()
        if embed_weight.shape != (cfg.vocab_size, cfg.hidden_size):
            raise ValueError(
                f"embedding {tuple(embed_weight.shape)} does not match the head's target "
                f"({cfg.vocab_size}, {cfg.hidden_size})"
            )
        self.config = cfg
        d = cfg.hidden_size
        self.fc = nn.Linear(len(cfg.aux_layers) * d, d, bias=False)
        self.midlayer = _MidLayer(cfg)
        self.norm = RMSNorm(d, cfg.norm_eps)
        self.lm_head = nn.Linear(d, cfg.draft_vocab_size, bias=False)
        ids = torch.arange(cfg.draft_vocab_size) if draft_ids is None else draft_ids.long()
        self.register_buffer("d2t", (ids - torch.arange(cfg.draft_vocab_size)).long())
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[ids] = True
        self.register_buffer("t2d", t2d)
        self.register_buffer("embed_weight", embed_weight.detach(), persistent=False)
        layer_cfg = cfg.layer_config()
        t = torch.arange(cfg.max_seq_len, dtype=torch.float32)
        freqs = torch.outer(t, _rope_inv_freq(layer_cfg))
        emb = torch.cat((freqs, freqs), dim=-1)  # [S, hd]
        self.register_buffer("rope_cos", emb.cos(), persistent=False)
        self.register_buffer("rope_sin", emb.sin(), persistent=False)
        self.register_buffer("positions", torch.arange(cfg.max_seq_len), persistent=False)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)

    @property
    def draft_ids(self) -> torch.Tensor:
        """[Vd] int64: the target id of every draft id."""
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def new_cache(self, max_len: int | None = None) -> KVCache:
        w = self.fc.weight
        return KVCache(self.config.layer_config(), 1, max_len, dtype=w.dtype, device=w.device)

    def fuse(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's states [.., A·D] (aux layers concatenated in order) -> one state [.., D]."""
        out: torch.Tensor = self.fc(hidden)
        return out

    def _inputs(self, states: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the attention's input [.., 2D], the residual [.., D]) for (state, next token) pairs."""
        layer = self.midlayer
        embeds = layer.input_layernorm(F.embedding(tokens, self.embed_weight).to(states.dtype))
        normed = layer.hidden_norm(states)
        residual = normed if self.config.norm_before_residual else states
        return torch.cat((embeds, normed), dim=-1), residual

    def _qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        cfg, attn = self.config, self.midlayer.self_attn
        b, t, _ = x.shape
        q = attn.q_proj(x).view(b, t, cfg.n_heads, cfg.head_dim).transpose(1, 2)  # [B,H,T,hd]
        k = attn.k_proj(x).view(b, t, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2)  # [B,Hkv,T,hd]
        v = attn.v_proj(x).view(b, t, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def _finish(self, y: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Attention output [B,H,T,hd] + residual -> the layer's output state (before the final norm)."""
        layer = self.midlayer
        b, _, t, _ = y.shape
        h = residual + layer.self_attn.o_proj(y.transpose(1, 2).reshape(b, t, -1))
        out: torch.Tensor = h + layer.mlp(layer.post_attention_layernorm(h))
        return out

    def logits(self, states: torch.Tensor) -> torch.Tensor:
        """Output states [.., D] -> draft-vocabulary logits [.., Vd]."""
        out: torch.Tensor = self.lm_head(self.norm(states))
        return out

    def forward_cached(self, states: torch.Tensor, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Append (state, next token) pairs [1,T,D], [1,T] at ``cache.pos``; returns output states [1,T,D]."""
        t = tokens.shape[1]
        pos, end = cache.pos, cache.pos + t
        if end > cache.max_len:
            raise ValueError(f"head KV cache full: {pos} + {t} > {cache.max_len}")
        dtype = states.dtype
        cos, sin = self.rope_cos[pos:end].to(dtype), self.rope_sin[pos:end].to(dtype)
        x, residual = self._inputs(states, tokens)
        q, k, v = self._qkv(x, cos, sin)
        cache.k[0][:, :, pos:end] = k
        cache.v[0][:, :, pos:end] = v
        mask = self.positions[:end] <= self.positions[pos:end, None] if t > 1 else None
        cfg = self.config
        y = F.scaled_dot_product_attention(
            q,
            cache.k[0][:, :, :end],
            cache.v[0][:, :, :end],
            attn_mask=mask,
            enable_gqa=cfg.n_heads != cfg.n_kv_heads,
        )
        cache.pos = end
        return self._finish(y, residual)

    def unrolled(
        self,
        hidden: torch.Tensor,
        tokens: torch.Tensor,
        steps: int,
        first: torch.Tensor | None = None,
        width: int | None = None,
    ) -> list[torch.Tensor]:
        """Training: the head run ``steps`` times over rows, as drafting runs it.

        hidden [B,T,A·D] (the target's states), tokens [B,T] (the token after each position).
        Step 0 reads the target's states; step s reads, at position t, the head's own step s-1
        output for position t-1, and attends as drafting the (s+1)-th token after position t-s
        would: to step 0's keys up to t-s, then to one key of each later step along the diagonal
        (step r's at t-s+r). Outputs are computed for a window of ``width`` positions per row from
        ``first`` [B] (default: every position): keys and values at every position, queries, the
        MLP and everything after only where a loss reads them (the prompt, most of a row, needs
        keys only). Returns each step's output states [B,W,D], window index w being position
        first + w; at step s the first s positions of a row have no such draft.
        """
        b, t = tokens.shape
        cfg = self.config
        dev = tokens.device
        if first is None:
            first = torch.zeros(b, dtype=torch.long, device=dev)
        w = width if width is not None else t
        pos_q = (first[:, None] + torch.arange(w, device=dev)[None, :]).clamp_max(t - 1)  # [B,W]
        rows = torch.arange(b, device=dev)[:, None]
        states_all = self.fuse(hidden)  # [B,T,D]
        dtype = states_all.dtype
        x_all, _ = self._inputs(states_all, tokens)
        cos_all, sin_all = self.rope_cos[:t].to(dtype), self.rope_sin[:t].to(dtype)
        attn = self.midlayer.self_attn
        k0 = attn.k_proj(x_all).view(b, t, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2)
        k0 = apply_rope(k0, cos_all, sin_all)  # [B,Hkv,T,hd]
        v0 = attn.v_proj(x_all).view(b, t, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2)
        groups = cfg.n_heads // cfg.n_kv_heads
        if groups > 1:
            k0, v0 = k0.repeat_interleave(groups, dim=1), v0.repeat_interleave(groups, dim=1)
        cos_q = self.rope_cos[pos_q].to(dtype)[:, None]  # [B,1,W,hd]
        sin_q = self.rope_sin[pos_q].to(dtype)[:, None]
        key_pos = self.positions[:t]
        scale = 1.0 / math.sqrt(cfg.head_dim)
        win = torch.arange(w, device=dev)
        tokens_w = tokens[rows, pos_q]  # [B,W]
        keys: list[torch.Tensor] = [k0]
        values: list[torch.Tensor] = [v0]
        outs: list[torch.Tensor] = []
        states = states_all[rows, pos_q]  # [B,W,D]
        for s in range(steps):
            if s == 0:
                x = x_all[rows, pos_q]
                residual = states if not cfg.norm_before_residual else self.midlayer.hidden_norm(states)
            else:
                x, residual = self._inputs(states, tokens_w)
            q = attn.q_proj(x).view(b, w, cfg.n_heads, cfg.head_dim).transpose(1, 2)
            q = apply_rope(q, cos_q, sin_q)  # [B,H,W,hd]
            base = (q @ k0.transpose(-1, -2)) * scale  # [B,H,W,T]
            visible = key_pos[None, None, :] <= (pos_q - s)[:, :, None]  # [B,W,T]
            base = base.masked_fill(~visible[:, None], float("-inf"))
            scores, diag_values = [base], []
            if s > 0:
                k = attn.k_proj(x).view(b, w, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2)
                v = attn.v_proj(x).view(b, w, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2)
                k = apply_rope(k, cos_q, sin_q)
                if groups > 1:
                    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
                keys.append(k)
                values.append(v)
                for r in range(1, s + 1):
                    lag = s - r  # step r's key sits lag positions before the query
                    kr = F.pad(keys[r], (0, 0, lag, 0))[:, :, :w] if lag else keys[r]
                    vr = F.pad(values[r], (0, 0, lag, 0))[:, :, :w] if lag else values[r]
                    score = (q * kr).sum(-1, keepdim=True) * scale  # [B,H,W,1]
                    if lag:
                        score = score.masked_fill((win < lag)[None, None, :, None], float("-inf"))
                    scores.append(score)
                    diag_values.append(vr)
            weights = torch.softmax(torch.cat(scores, dim=-1), dim=-1)  # every query sees its own key
            y = weights[..., :t] @ v0
            for r, vr in enumerate(diag_values):
                y = y + weights[..., t + r : t + r + 1] * vr
            out = self._finish(y, residual)
            outs.append(out)
            # The next step reads at t the state this step predicted for t (made at t-1).
            states = torch.cat((out[:, :1], out[:, :-1]), dim=1)
        return outs


class HeadProposer:
    """Drafts with an `EagleHead` from the target states the decoder hands it (`observe`)."""

    def __init__(
        self,
        head: EagleHead,
        max_len: int | None = None,
        name: str = "head",
        confidence_threshold: float = 0.0,
    ) -> None:
        check_confidence_threshold(confidence_threshold)
        self.head = head
        self.name = name
        self.confidence_threshold = confidence_threshold
        self.report_confidences = False
        self.cache = head.new_cache(max_len)
        self.vocab_limit: int | None = None  # set by the decoder: drafts stay below it
        self._draft_ids = head.draft_ids  # [Vd]
        self._blocked: torch.Tensor | None = None  # [Vd] bool: draft ids mapping at or past the limit
        self._blocked_for: int | None = None
        self._pending: list[torch.Tensor] = []  # fused states [T_i, D] not yet fed
        self._pending_start = 0  # position of the first pending state

    @property
    def aux_layers(self) -> tuple[int, ...]:
        return self.head.config.aux_layers

    def start_request(self, prompt_ids: Sequence[int]) -> None:
        self.cache.reset()
        self._pending.clear()
        self._pending_start = 0

    @torch.inference_mode()
    def observe(self, hidden: Sequence[torch.Tensor], start: int) -> None:
        """The target's states [T, D] per aux layer for positions start..start+T-1, verified."""
        if start != self._pending_start + sum(len(p) for p in self._pending):
            raise ValueError(f"states for position {start} do not follow the ones already observed")
        self._pending.append(self.head.fuse(torch.cat(list(hidden), dim=-1)))

    def _limit_mask(self) -> torch.Tensor | None:
        limit = self.vocab_limit
        if limit is None or limit >= self.head.config.vocab_size:
            return None
        if self._blocked_for != limit:
            self._blocked, self._blocked_for = self._draft_ids >= limit, limit
        return self._blocked

    @torch.inference_mode()
    def propose(
        self,
        context: Sequence[int],
        k: int,
        sampling: SamplingParams | None = None,
        generator: torch.Generator | None = None,
    ) -> Proposals:
        start = self._pending_start
        fed = sum(len(p) for p in self._pending)
        if fed == 0 or k <= 0:
            return Proposals.empty()
        if len(context) != start + fed + 1:
            raise ValueError(
                f"context of {len(context)} tokens, but the head holds target states through position "
                f"{start + fed - 1}: every observed position needs the token after it"
            )
        k = min(k, self.cache.max_len - (start + fed))
        if k <= 0:
            return Proposals.empty()
        head, cache = self.head, self.cache
        cache.rollback(start)  # forget last round's drafts: their states were the head's own
        states = torch.cat(self._pending).unsqueeze(0)  # [1, T, D]
        tokens = torch.tensor([list(context[start + 1 :])])  # [1, T]
        self._pending, self._pending_start = [], start + fed
        out = head.forward_cached(states, tokens, cache)[:, -1:]  # [1, 1, D]
        blocked = self._limit_mask()
        greedy = sampling is None or sampling.greedy
        limit = self.vocab_limit if self.vocab_limit is not None else head.config.vocab_size
        threshold = self.confidence_threshold
        confident = bool(threshold) or self.report_confidences
        toks: list[int] = []
        qs: list[torch.Tensor] = []
        confidences: list[float] = []
        for step in range(k):
            logits = head.logits(out)[0, -1]  # [Vd]
            if blocked is not None:
                logits = logits.masked_fill(blocked, float("-inf"))
            if greedy:
                draft = int(logits.argmax())
                confidence = float(torch.softmax(logits.float(), dim=-1)[draft]) if confident else 1.0
            else:
                assert sampling is not None
                q_draft = logits_to_probs(logits, sampling.temperature, sampling.top_p)  # [Vd]
                draft = int(sample_from(q_draft, generator))
                q = torch.zeros(limit, dtype=q_draft.dtype)  # over the target's ids, as the verifier reads
                keep = self._draft_ids < limit
                q[self._draft_ids[keep]] = q_draft[keep]
                qs.append(q)
                confidence = float(q_draft[draft])
            token = int(self._draft_ids[draft])
            toks.append(token)
            confidences.append(confidence)
            if step == k - 1 or (threshold and confidence < threshold):
                break
            out = head.forward_cached(out, torch.tensor([[token]]), cache)
        return Proposals(
            torch.tensor(toks, dtype=torch.long),
            torch.stack(qs) if qs else None,
            confidences=torch.tensor(confidences) if self.report_confidences else None,
        )


def head_for_target(target: Transformer, cfg: HeadConfig, draft_ids: torch.Tensor | None = None) -> EagleHead:
    """A fresh head over ``target`` (its embeddings shared), on the target's device and dtype, with
    its output projection and final norm started from the target's over the draft vocabulary."""
    head = EagleHead(cfg, target.model.embed_tokens.weight, draft_ids)
    with torch.no_grad():
        head.lm_head.weight.copy_(target.lm_head.weight[head.draft_ids])
        head.norm.weight.copy_(target.model.norm.weight)
    return head.to(device=target.device, dtype=target.dtype)
