"""The decoder-only transformers the engine runs as target and drafter, and their rollback-able KV cache.

Owns: `ModelConfig` (with the mapping to and from a Hugging Face `config.json`), the `Transformer`
module and `KVCache`. One module covers the model families whose blocks are the same pre-norm
RMSNorm / rotary / SwiGLU / grouped-query attention stack and differ only in details the config
names (`ModelConfig.family`, see FAMILIES):
- llama (Llama 2 and 3.x): optional biases on all four attention projections and on the MLP,
  Llama 3.x's rescaled rotary frequencies, tied or untied embeddings;
- qwen2 (Qwen2, Qwen2.5): a bias on q/k/v but never on o_proj (its config has no key for it);
- qwen3: RMSNorm over head_dim on each query and key head before the rotation, an explicit head_dim;
- mistral: Llama's block with a sliding attention window.
A sliding window is honoured by capping the usable context at the window (see
`ModelConfig.__post_init__`): within it, windowed attention is full causal attention, so the logits
stay exact without a windowed mask or a ring-buffer cache.

Parameter names are exactly those of `transformers`' `*ForCausalLM` classes (`model.embed_tokens.weight`,
`model.layers.N.self_attn.q_proj.weight`, `...self_attn.q_norm.weight`, ..., `model.norm.weight`,
`lm_head.weight`), so a state dict moves between the two without renaming and the logits agree to
float rounding.

Two forward paths:
- `forward(tokens)` is the full causal pass for training and scoring (no cache, SDPA with
  `is_causal=True`).
- `forward_cached(tokens, cache)` appends `tokens` at `cache.pos` and attends over everything cached.
  `cache.rollback(pos)` forgets every position >= pos, which is how a rejected draft is undone: the
  stale keys/values stay in the preallocated buffer but are never read again and are overwritten by
  the next write. A decoding step of a few rows on a CPU can run in NumPy instead (`NumpyStep`, on
  the same cache buffers; off by default, see NUMPY_STEP_ROWS): torch's per-operator cost
  dominates at that size.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F
from threadpoolctl import ThreadpoolController
from torch import nn

# The families this engine implements: HF `model_type` -> the `architectures` entry it saves.
FAMILIES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
}
# Families whose config.json has an `attention_bias` key (on all four projections, Llama semantics)
# or an `mlp_bias` key; the others have a fixed layout that no key changes.
_ATTENTION_BIAS_FAMILIES = ("llama", "qwen3")
_MLP_BIAS_FAMILIES = ("llama",)
_WINDOW_FAMILIES = ("qwen2", "qwen3", "mistral")
# Qwen configs say which layers use the window by `max_window_layers` (the layers from that index on).
_LAYERED_WINDOW_FAMILIES = ("qwen2", "qwen3")


@dataclass
class ModelConfig:
    vocab_size: int  # embedding rows; may exceed the tokenizer's size (padded vocabularies)
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    max_seq_len: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    # Only needed for foreign checkpoints: HF lets head_dim differ from dim // n_heads, Llama and
    # Qwen3 may put a bias on every attention projection, and Llama 3.x rescales the rotary
    # frequencies.
    head_dim: int | None = None
    attention_bias: bool = False
    mlp_bias: bool = False
    rope_scaling: dict[str, Any] | None = field(default=None)
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    family: str = "llama"
    # The attention window of the layers that have one (None: every layer attends to everything),
    # and for Qwen families the first layer that has it (Mistral windows every layer).
    sliding_window: int | None = None
    max_window_layers: int | None = None

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"unsupported model family {self.family!r}: supported are {', '.join(FAMILIES)}")
        if self.head_dim is None:
            if self.dim % self.n_heads:
                raise ValueError(f"dim {self.dim} is not divisible by n_heads {self.n_heads}")
            self.head_dim = self.dim // self.n_heads
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")
        # A flag the family's config.json cannot express would be lost on saving: refuse it here.
        if self.attention_bias and self.family not in _ATTENTION_BIAS_FAMILIES:
            raise ValueError(
                f"attention_bias does not apply to {self.family} (qwen2 always biases q/k/v and never "
                "o_proj; mistral has no biases)"
            )
        if self.mlp_bias and self.family not in _MLP_BIAS_FAMILIES:
            raise ValueError(f"mlp_bias does not apply to {self.family}")
        if self.sliding_window is not None and self.family not in _WINDOW_FAMILIES:
            raise ValueError(f"{self.family} has no sliding attention window")
        if self.max_window_layers is not None and self.family not in _LAYERED_WINDOW_FAMILIES:
            raise ValueError(f"max_window_layers does not apply to {self.family}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")
        window = self.sliding_window
        if window is not None and self.windowed_layers and self.max_seq_len > window:
            # Honest windows without a windowed mask: a query at position p attends to the keys at
            # p - window + 1 .. p, so on sequences no longer than the window it sees every earlier
            # key and windowed attention is exactly full causal attention. The context is capped
            # there (max_position_embeddings is saved capped too), rather than computing something
            # else past it.
            self.max_seq_len = window

    @property
    def hd(self) -> int:
        assert self.head_dim is not None
        return self.head_dim

    @property
    def qkv_bias(self) -> bool:
        """Whether q_proj, k_proj and v_proj carry a bias."""
        return self.attention_bias or self.family == "qwen2"

    @property
    def o_bias(self) -> bool:
        """Whether o_proj carries a bias (never for qwen2, whatever its q/k/v do)."""
        return self.attention_bias

    @property
    def qk_norm(self) -> bool:
        """Whether each query and key head is RMS-normalised over head_dim before the rotation."""
        return self.family == "qwen3"

    @property
    def windowed_layers(self) -> int:
        """How many layers attend through the sliding window."""
        if self.sliding_window is None:
            return 0
        if self.family in _LAYERED_WINDOW_FAMILIES:
            first = self.max_window_layers if self.max_window_layers is not None else 0
            return max(0, self.n_layers - first)
        return self.n_layers

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_hf_dict(self) -> dict[str, Any]:
        """The `config.json` of the equivalent transformers model of this family."""
        out: dict[str, Any] = {
            "architectures": [FAMILIES[self.family]],
            "model_type": self.family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.dim,
            "intermediate_size": self.ffn_dim,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "head_dim": self.hd,
            "max_position_embeddings": self.max_seq_len,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.norm_eps,
            "tie_word_embeddings": self.tie_embeddings,
            "hidden_act": "silu",
            "attention_dropout": 0.0,
            "rope_scaling": self.rope_scaling,
            "initializer_range": 0.02,
            "use_cache": True,
        }
        if self.family in _ATTENTION_BIAS_FAMILIES:
            out["attention_bias"] = self.attention_bias
        if self.family in _MLP_BIAS_FAMILIES:
            out["mlp_bias"] = self.mlp_bias
        if self.family in _LAYERED_WINDOW_FAMILIES:
            windowed = self.sliding_window is not None
            out["use_sliding_window"] = windowed
            out["sliding_window"] = self.sliding_window
            out["max_window_layers"] = (
                self.max_window_layers if windowed and self.max_window_layers is not None else self.n_layers
            )
        elif self.family == "mistral":
            out["sliding_window"] = self.sliding_window
        if self.bos_token_id is not None:
            out["bos_token_id"] = self.bos_token_id
        if self.eos_token_id is not None:
            out["eos_token_id"] = self.eos_token_id
        return out

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Read the HF `config.json` of a supported family; refuse what this engine does not implement."""
        family = d.get("model_type")
        if family is None:  # very old folders name only the class
            by_class = {arch: name for name, arch in FAMILIES.items()}
            family = next((by_class[a] for a in d.get("architectures") or [] if a in by_class), None)
        if family not in FAMILIES:
            raise ValueError(
                f"unsupported model_type {family!r} (architectures {d.get('architectures')}): "
                f"this engine runs the {', '.join(FAMILIES)} families"
            )
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r}: only SwiGLU (silu) models")
        scaling = d.get("rope_scaling")
        if scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind not in ("default", "linear", "llama3"):
                raise ValueError(f"unsupported rope_scaling type {kind!r}")
        rope_params = d.get("rope_parameters")  # transformers 5 nests theta (and scaling) here
        theta = d.get("rope_theta")
        if theta is None and isinstance(rope_params, dict):
            theta = rope_params.get("rope_theta")
            kind = rope_params.get("rope_type", "default")
            if kind not in ("default", None):
                if kind not in ("linear", "llama3"):
                    raise ValueError(f"unsupported rope_type {kind!r}")
                scaling = rope_params
        n_heads = int(d["num_attention_heads"])
        n_layers = int(d["num_hidden_layers"])
        eos = d.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        window, first_windowed = _hf_sliding_window(family, d, n_layers)
        return cls(
            vocab_size=int(d["vocab_size"]),
            dim=int(d["hidden_size"]),
            n_layers=n_layers,
            n_heads=n_heads,
            n_kv_heads=int(d.get("num_key_value_heads") or n_heads),
            ffn_dim=int(d["intermediate_size"]),
            max_seq_len=int(d.get("max_position_embeddings", 2048)),
            rope_theta=float(theta if theta is not None else 10000.0),
            norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(d.get("tie_word_embeddings", False)),
            head_dim=d.get("head_dim") or int(d["hidden_size"]) // n_heads,
            # Qwen2's q/k/v bias is implied by the family (its config has no key for it).
            attention_bias=family in _ATTENTION_BIAS_FAMILIES and bool(d.get("attention_bias", False)),
            mlp_bias=family in _MLP_BIAS_FAMILIES and bool(d.get("mlp_bias", False)),
            rope_scaling=scaling,
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=eos,
            family=family,
            sliding_window=window,
            max_window_layers=first_windowed,
        )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def _hf_sliding_window(family: str, d: dict[str, Any], n_layers: int) -> tuple[int | None, int | None]:
    """(window, first windowed layer) from a config.json; (None, None) when no layer has a window."""
    if family == "mistral":
        window = d.get("sliding_window")
        return (int(window), None) if window is not None else (None, None)
    if family not in _LAYERED_WINDOW_FAMILIES:
        return None, None
    window = d.get("sliding_window")
    layer_types = d.get("layer_types")
    if layer_types is not None:  # transformers 5 spells the layers out
        windowed = [i for i, kind in enumerate(layer_types) if kind == "sliding_attention"]
        first = windowed[0] if windowed else n_layers
        if windowed != list(range(first, n_layers)):
            raise ValueError(f"unsupported layer_types {layer_types}: windowed layers must be the last ones")
    elif d.get("use_sliding_window") and window is not None:
        first = int(d.get("max_window_layers", 28))  # transformers' default
    else:
        first = n_layers
    if first >= n_layers:
        return None, None
    if window is None:
        raise ValueError("layer_types names sliding_attention layers but sliding_window is null")
    return int(window), first


def _rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    hd = cfg.hd
    # In float32 with transformers' own expression, not float64 rounded once: the two tables differ
    # by an ulp here and there (cos by up to 2e-6), and that alone put SmolLM2-135M's logits 2.6e-4
    # from transformers'. With the same table the full pass is bit-identical to transformers' on a
    # CPU, and neither table is closer to the exact rotation (both 5.4e-6 off in cos).
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    sc = cfg.rope_scaling
    if not sc:
        return inv_freq
    kind = sc.get("rope_type", sc.get("type"))
    if kind == "linear":
        return inv_freq / float(sc["factor"])
    if kind == "llama3":
        # Same piecewise rule as transformers' _compute_llama3_parameters.
        factor = float(sc["factor"])
        low, high = float(sc.get("low_freq_factor", 1.0)), float(sc.get("high_freq_factor", 4.0))
        old_len = float(sc.get("original_max_position_embeddings", 8192))
        low_wl, high_wl = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wl, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wl) & (wavelen <= low_wl)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    # HF layout: the two rotated halves are the first and second half of head_dim (not interleaved).
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B,H,T,hd]; cos/sin [T,hd]."""
    return x * cos + _rotate_half(x) * sin


class KVCache:
    """Preallocated keys/values for every layer; `pos` is how many positions are valid.

    Shapes: `k[layer]`, `v[layer]` are [B, n_kv_heads, max_len, head_dim]. Rolling back is O(1).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        batch_size: int = 1,
        max_len: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.max_len = max_len or cfg.max_seq_len
        if self.max_len > cfg.max_seq_len:
            raise ValueError(f"cache length {self.max_len} exceeds max_seq_len {cfg.max_seq_len}")
        shape = (cfg.n_layers, batch_size, cfg.n_kv_heads, self.max_len, cfg.hd)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.batch_size = batch_size
        self.pos = 0

    def rollback(self, pos: int) -> None:
        """Forget every position >= pos (positions < pos stay valid)."""
        if not 0 <= pos <= self.pos:
            raise ValueError(f"cannot roll back to {pos}: cache holds {self.pos} positions")
        self.pos = pos

    truncate = rollback

    def reset(self) -> None:
        self.pos = 0

    @property
    def remaining(self) -> int:
        return self.max_len - self.pos


class Attention(nn.Module):
    q_norm: RMSNorm | None
    k_norm: RMSNorm | None

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.hd = cfg.n_heads, cfg.n_kv_heads, cfg.hd
        self.gqa = cfg.n_heads != cfg.n_kv_heads
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * cfg.hd, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.hd, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.hd, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.hd, cfg.dim, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.hd, cfg.norm_eps)
            self.k_norm = RMSNorm(cfg.hd, cfg.norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def _qkv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.hd)
        k = self.k_proj(x).view(b, t, self.n_kv_heads, self.hd)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)  # per head, over head_dim, before the rotation
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # [B,H,T,hd], [B,Hkv,T,hd]
        v = self.v_proj(x).view(b, t, self.n_kv_heads, self.hd).transpose(1, 2)  # [B,Hkv,T,hd]
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self._qkv(x, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.gqa)  # [B,H,T,hd]
        out: torch.Tensor = self.o_proj(y.transpose(1, 2).reshape(b, t, -1))  # [B,T,D]
        return out


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.dim, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)  # one fused kernel
        # HF normalises in fp32 and casts back before scaling; match it for half-precision runs.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)


class _Backbone(nn.Module):
    """Holds the `model.*` parameters so names match transformers' `*ForCausalLM` classes exactly."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList([DecoderLayer(cfg) for _ in range(cfg.n_layers)])
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)


def _onednn_linear_available() -> bool:
    """Whether this torch build can prepack a weight for oneDNN's inner-product kernels."""
    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return False
    try:
        w = torch.zeros(8, 8)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 8)
        out = torch.ops.mkldnn._linear_pointwise(torch.ones(2, 8), packed, None, "none", [], "")
        return bool(out.shape == (2, 8))
    except (RuntimeError, AttributeError):
        return False


_ONEDNN_LINEAR = _onednn_linear_available()
# Weight sizes (elements) from which oneDNN's prepacked kernel beats MKL's GEMM: on several rows,
# and on a single row.
_ONEDNN_MIN_SIZE = 1 << 17
_ONEDNN_ONE_ROW_SIZE = 1 << 20


class FastLinear:
    """``F.linear`` for the decoding path over one weight, or over several read from the same input
    (q/k/v, gate/up), on a oneDNN-prepacked (and then fused) copy when that pays: float32 on a CPU,
    no gradient wanted, enough rows.

    Why: batch-1 decoding multiplies 1 to k+1 rows by every weight. On CPUs where MKL's small-row
    GEMM is slow (the AMD EPYC measured here), a verify pass over 5 rows cost 1.4-1.9x a one-row
    step; on oneDNN's prepacked weights, fused so that a layer makes four calls instead of seven,
    ~1.1-1.25x. One row stays on MKL (as fast as oneDNN there, without its ~30 us per call), except
    for the largest weights (an LM head). The packed copy is rebuilt whenever a source weight changes
    in place (its version counter moves: optimizer steps, load_state_dict), so it is never stale.
    """

    __slots__ = (
        "weights",
        "biases",
        "_pairs",
        "_sources",
        "_trainable",
        "_sizes",
        "_min_rows",
        "_packed",
        "_bias",
        "_versions",
    )

    def __init__(self, weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None]) -> None:
        self.weights = tuple(weights)
        self.biases = tuple(biases)
        self._pairs = list(zip(self.weights, self.biases, strict=True))
        self._sources = [*self.weights, *(b for b in self.biases if b is not None)]
        self._trainable = any(p.requires_grad for p in self._sources)
        self._sizes = [w.shape[0] for w in self.weights]
        self._packed: torch.Tensor | None = None
        self._bias: torch.Tensor | None = None
        self._versions: list[int] = []
        # Rows from which oneDNN is used (0: never). Measured per shape in both libraries on 1
        # and 5 rows: small weights (a drafter's) never, medium ones from 2 rows, the largest
        # from 1. Device and dtype are fixed for this object's life (Transformer._apply drops it).
        w, size = self.weights[0], sum(w.numel() for w in self.weights)
        usable = _ONEDNN_LINEAR and w.device.type == "cpu" and w.dtype == torch.float32
        self._min_rows = (
            0 if not usable else 1 if size >= _ONEDNN_ONE_ROW_SIZE else 2 if size >= _ONEDNN_MIN_SIZE else 0
        )

    def _onednn(self, x: torch.Tensor) -> torch.Tensor | None:
        """The fused product on oneDNN, or None when this call should stay on MKL."""
        min_rows = self._min_rows
        if not min_rows or x.numel() < min_rows * x.shape[-1]:
            return None
        if self._trainable and torch.is_grad_enabled():
            return None  # training through the cached path: autograd must see the parameters
        versions = [p._version for p in self._sources]
        if self._packed is None or versions != self._versions:
            with torch.no_grad():
                weight = torch.cat([w.detach() for w in self.weights])
                self._bias = (
                    None
                    if all(b is None for b in self.biases)
                    else torch.cat(
                        [
                            b.detach() if b is not None else w.new_zeros(w.shape[0])
                            for w, b in zip(self.weights, self.biases, strict=True)
                        ]
                    )
                )
                self._packed = torch.ops.mkldnn._reorder_linear_weight(weight, 8)
            self._versions = versions
        shape = x.shape
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
            x.reshape(-1, shape[-1]), self._packed, self._bias, "none", [], ""
        )
        return out.view(*shape[:-1], out.shape[-1])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The product with the (single) weight."""
        out = self._onednn(x)
        return out if out is not None else F.linear(x, self.weights[0], self.biases[0])

    def parts(self, x: torch.Tensor) -> Sequence[torch.Tensor]:
        """The products with each weight, in order."""
        out = self._onednn(x)
        if out is not None:
            return torch.split(out, self._sizes, dim=-1)
        return [F.linear(x, w, b) for w, b in self._pairs]


class Transformer(nn.Module):
    rope_cos: torch.Tensor  # [S, hd]
    rope_sin: torch.Tensor  # [S, hd]
    positions: torch.Tensor  # [S]

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self._fast: _FastWeights | None = None
        self._numpy: NumpyStep | None = None
        # Steps of one sequence over at most this many rows run in NumPy where it can (NumpyStep);
        # 0, the default for now, keeps every step on torch (see NUMPY_STEP_ROWS for why).
        self.numpy_step_rows = 0
        self.config = cfg
        self.model = _Backbone(cfg)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.init_buffers()
        self.apply(self._init_weights)

    def init_buffers(self, device: torch.device | str | None = None) -> None:
        """(Re)compute the derived rotary tables; needed after `to_empty()` left them uninitialised."""
        cfg = self.config
        inv_freq = _rope_inv_freq(cfg).to(device)
        t = torch.arange(cfg.max_seq_len, dtype=torch.float32, device=device)
        freqs = torch.outer(t, inv_freq)  # [S, hd/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [S, hd]
        # Non-persistent: derived from the config, so they never appear in a checkpoint.
        self.register_buffer("rope_cos", emb.cos(), persistent=False)
        self.register_buffer("rope_sin", emb.sin(), persistent=False)
        self.register_buffer("positions", torch.arange(cfg.max_seq_len, device=device), persistent=False)

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())  # tied weights are counted once

    def new_cache(self, batch_size: int = 1, max_len: int | None = None) -> KVCache:
        return KVCache(self.config, batch_size, max_len, dtype=self.dtype, device=self.device)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B,T] -> logits [B,T,V]; full causal attention from position 0, no cache."""
        t = tokens.shape[1]
        if t > self.config.max_seq_len:
            raise ValueError(f"sequence of {t} tokens exceeds max_seq_len {self.config.max_seq_len}")
        cos, sin = self.rope_cos[:t].to(self.dtype), self.rope_sin[:t].to(self.dtype)  # [T,hd]
        h = self.model.embed_tokens(tokens)  # [B,T,D]
        for layer in self.model.layers:
            assert isinstance(layer, DecoderLayer)
            h = h + layer.self_attn(layer.input_layernorm(h), cos, sin)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        logits: torch.Tensor = self.lm_head(self.model.norm(h))  # [B,T,V]
        return logits

    def forward_cached(
        self,
        tokens: torch.Tensor,
        cache: KVCache,
        last_only: bool = False,
        hidden_layers: Sequence[int] = (),
        hidden_out: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Append tokens [B,T] at `cache.pos`; returns logits [B,T,V] ([B,1,V] when last_only).

        Advances `cache.pos` by T. The caller rolls back whatever it does not keep.
        ``hidden_layers``: residual-stream states to hand out in ``hidden_out``, one [B,T,D] per
        listed index in order, index i being what enters layer i (n_layers: what leaves the last
        one, before the final norm). A draft head reads them from the pass that verifies drafts
        anyway, so it costs the target nothing more.
        """
        t = tokens.shape[1]
        pos = cache.pos
        end = pos + t
        if end > cache.max_len:
            raise ValueError(f"KV cache full: {pos} + {t} tokens > {cache.max_len}")
        capture = {i: n for n, i in enumerate(hidden_layers)}
        if capture and hidden_out is None:
            raise ValueError("hidden_layers needs a hidden_out list to hand the states out in")
        if any(not 0 <= i <= self.config.n_layers for i in capture):
            raise ValueError(
                f"hidden_layers {list(hidden_layers)}: the model has layers 0..{self.config.n_layers}"
            )
        captured: list[torch.Tensor | None] = [None] * len(hidden_layers)
        if not capture and t <= self.numpy_step_rows and tokens.shape[0] == 1 and not torch.is_grad_enabled():
            step = self._numpy_step()
            if step is not None:
                return step(tokens, cache, last_only)
        cos, sin = self.rope_cos[pos:end], self.rope_sin[pos:end]  # [T,hd]
        if self.dtype != torch.float32:
            cos, sin = cos.to(self.dtype), sin.to(self.dtype)
        # A single new token attends to everything cached, so it needs no mask (the fast path).
        # Built per call rather than stored: an [S, S] table is gigabytes for 128k-context checkpoints.
        mask = self.positions[:end] <= self.positions[pos:end, None] if t > 1 else None  # [T, pos+T]
        layers, embed, final_norm, head = self._fast_weights()
        cfg = self.config
        b, dim, eps = tokens.shape[0], cfg.dim, cfg.norm_eps
        h_q, h_kv, hd, gqa = cfg.n_heads, cfg.n_kv_heads, cfg.hd, cfg.n_heads != cfg.n_kv_heads
        h = F.embedding(tokens, embed)  # [B,T,D]
        for i, (n1, wqkv, q_norm, k_norm, wo, n2, wgu, wd) in enumerate(layers):
            if capture and i in capture:
                captured[capture[i]] = h
            x = F.rms_norm(h, (dim,), n1, eps)  # [B,T,D]
            q, k, v = wqkv.parts(x)
            q = q.view(b, t, h_q, hd)
            k = k.view(b, t, h_kv, hd)
            if q_norm is not None and k_norm is not None:
                q, k = F.rms_norm(q, (hd,), q_norm, eps), F.rms_norm(k, (hd,), k_norm, eps)
            q, k = q.transpose(1, 2), k.transpose(1, 2)  # [B,H,T,hd], [B,Hkv,T,hd]
            v = v.view(b, t, h_kv, hd).transpose(1, 2)  # [B,Hkv,T,hd]
            k_buf, v_buf = cache.k[i], cache.v[i]
            k_buf[:, :, pos:end] = apply_rope(k, cos, sin)
            v_buf[:, :, pos:end] = v
            y = F.scaled_dot_product_attention(
                apply_rope(q, cos, sin), k_buf[:, :, :end], v_buf[:, :, :end], attn_mask=mask, enable_gqa=gqa
            )  # [B,H,T,hd]
            h = h + wo(y.transpose(1, 2).reshape(b, t, -1))
            x = F.rms_norm(h, (dim,), n2, eps)
            gate, up = wgu.parts(x)
            h = h + wd(F.silu(gate) * up)  # [B,T,D]
        cache.pos = end
        if capture:
            assert hidden_out is not None
            if len(layers) in capture:
                captured[capture[len(layers)]] = h
            hidden_out.extend(state for state in captured if state is not None)
        if last_only:
            h = h[:, -1:]
        logits: torch.Tensor = head(F.rms_norm(h, (dim,), final_norm, eps))  # [B,T,V]
        return logits

    # The cached path is what decoding runs k+1 times per round, so it calls the functional ops on
    # weights collected once instead of going through nn.Module.__call__ and __getattr__ for every
    # layer (25% faster for a one-layer drafter step). The collected references stay valid through
    # in-place updates (optimizer steps, load_state_dict, .to()); anything that swaps a Parameter
    # object must call `invalidate_fast_path()`. train()/eval() and _apply() do so automatically.
    def _fast_weights(self) -> _FastWeights:
        if self._fast is None:
            layers: list[_LayerWeights] = []
            for layer in self.model.layers:
                assert isinstance(layer, DecoderLayer)
                a, m = layer.self_attn, layer.mlp
                qkv, gate_up = (a.q_proj, a.k_proj, a.v_proj), (m.gate_proj, m.up_proj)
                layers.append(
                    (
                        layer.input_layernorm.weight,
                        FastLinear([p.weight for p in qkv], [p.bias for p in qkv]),
                        a.q_norm.weight if a.q_norm is not None else None,
                        a.k_norm.weight if a.k_norm is not None else None,
                        FastLinear([a.o_proj.weight], [a.o_proj.bias]),
                        layer.post_attention_layernorm.weight,
                        FastLinear([p.weight for p in gate_up], [p.bias for p in gate_up]),
                        FastLinear([m.down_proj.weight], [m.down_proj.bias]),
                    )
                )
            fast: _FastWeights = (
                layers,
                self.model.embed_tokens.weight,
                self.model.norm.weight,
                FastLinear([self.lm_head.weight], [None]),
            )
            self._fast = fast
            return fast
        return self._fast

    def steps_in_numpy(self, rows: int) -> bool:
        """Whether `forward_cached` over `rows` rows of one sequence, without autograd, runs in NumPy."""
        return rows <= self.numpy_step_rows and NumpyStep.supports(self)

    def _numpy_step(self) -> NumpyStep | None:
        step = self._numpy
        if step is None:
            if not NumpyStep.supports(self):
                return None
            step = self._numpy = NumpyStep(self)
        step.refresh()
        return step

    def invalidate_fast_path(self) -> None:
        self._fast = None
        self._numpy = None

    def train(self, mode: bool = True) -> Transformer:
        self._fast = None
        self._numpy = None
        return super().train(mode)

    def _apply(self, fn: Any, recurse: bool = True) -> Transformer:
        self._fast = None
        self._numpy = None
        out: Transformer = super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
        return out


# (input norm, fused q/k/v, q head norm, k head norm (both None without), o, post-attention norm,
# fused gate/up, down)
_LayerWeights = tuple[
    torch.Tensor,
    FastLinear,
    torch.Tensor | None,
    torch.Tensor | None,
    FastLinear,
    torch.Tensor,
    FastLinear,
    FastLinear,
]
_FastWeights = tuple[list[_LayerWeights], torch.Tensor, torch.Tensor, FastLinear]

_F32 = npt.NDArray[np.float32]


class _NumpyLayer(NamedTuple):
    """One layer's weights for `NumpyStep`, products as x @ W ([in, out]); None where absent."""

    norm1: _F32
    w_qkv: _F32  # [D, n_q + 2 n_kv]
    b_qkv: _F32 | None
    q_norm: _F32 | None  # [hd]
    k_norm: _F32 | None
    w_o: _F32  # [n_q, D]
    b_o: _F32 | None
    norm2: _F32
    w_gate_up: _F32  # [D, 2 F]
    b_gate_up: _F32 | None
    w_down: _F32  # [F, D]
    b_down: _F32 | None


# What `Transformer.numpy_step_rows` should be set to when NumPy steps are wanted: one-row steps
# (every drafter step, every plain target step). Verify passes of k+1 rows stay on torch: there
# NumPy on one thread was only even with it (target, five rows: 9.7 against 10.6 ms idle, 11.8
# against 11.4 ms next to a busy process; NumPy products with oneDNN's in between gained nothing
# measurable), and torch can take a second thread (MultiRowThreads). Prefill stays on torch.
#
# Off by default for now. It makes every arm faster (bench/engine.py --numpy-steps: plain step
# 4.2 against 6.6 ms, drafter step 0.62 against 1.19 ms) but the plain arm most, because a verify
# pass still costs 1.9x a NumPy step: speculation's edge on this CPU fell from 1.7-1.9x to 1.15x
# in the full demo, and in the fast end-to-end demo (45 s of realignment) the candidate no longer
# beat no speculation, so the canary rightly never promoted and the loop could not close in the
# test's budget. Turning it on waits for a cheaper verify pass.
NUMPY_STEP_ROWS = 1


_blas_pinned = False


def _pin_numpy_blas_to_one_thread() -> None:
    """NumPy's OpenBLAS on one thread, for the whole process (once).

    Its default (one thread per core) spin-waits for the other core: next to a busy process (the
    trainer, in the demo) a five-row verify took 23.7 ms on two threads against 11.1 ms on one,
    and the steps here are too small to gain from a second thread on an idle machine either.
    """
    global _blas_pinned
    if not _blas_pinned:
        ThreadpoolController().select(internal_api="openblas").limit(limits=1)
        _blas_pinned = True


class NumpyStep:
    """`Transformer.forward_cached` for a few rows of one sequence, in NumPy on float32 CPU weights.

    Why: a decoding step of a small model is dozens of tiny operators, and torch spends ~15-20 us
    dispatching each; NumPy spends a few. Measured on this project's 2-core AMD EPYC, one thread:
    a 0.92M-parameter drafter step 0.5 ms against 1.2 ms, the 12.2M target's one-row step 3.5-4.6 ms
    against 6.2-7.6 ms (MKL's one-row product is also slower than OpenBLAS's on this CPU). It runs
    any number of rows; which ones it gets is `Transformer.numpy_step_rows`. Same arithmetic in
    float32, so the logits agree with torch's to float rounding. NumPy's BLAS is pinned to one
    thread (see `_pin_numpy_blas_to_one_thread`).

    It reads and writes the same `KVCache` buffers (NumPy views of them), so a request can prefill
    on torch and decode here. Weight copies (fused q/k/v and gate/up, transposed) are rebuilt when
    any parameter changes in place (its version counter moves), so they are never stale.
    """

    def __init__(self, model: Transformer) -> None:
        self.model = model
        cfg = model.config
        self.h_q, self.h_kv, self.hd = cfg.n_heads, cfg.n_kv_heads, cfg.hd
        self.group = cfg.n_heads // cfg.n_kv_heads
        self.eps = cfg.norm_eps
        self.ffn = cfg.ffn_dim
        self.scale = 1.0 / math.sqrt(cfg.hd)  # a Python float: a NumPy float64 scalar would upcast
        half = cfg.hd // 2
        cos = model.rope_cos.detach().cpu().numpy()
        sin = model.rope_sin.detach().cpu().numpy()
        # rotate_half(x) * sin == x[..., perm] * signed_sin: one gather instead of a concatenation.
        self.cos = np.ascontiguousarray(cos, dtype=np.float32)  # [S, hd]
        self.signed_sin = np.concatenate((-sin[:, :half], sin[:, half:]), axis=1).astype(np.float32)
        self.perm = np.concatenate((np.arange(half, cfg.hd), np.arange(half)))
        self._params = list(model.parameters())
        self._versions: list[int] = []
        self.layers: list[_NumpyLayer] = []
        _pin_numpy_blas_to_one_thread()

    @staticmethod
    def supports(model: Transformer) -> bool:
        # Biases (Llama's, Qwen2's q/k/v only) and Qwen3's per-head q/k norms are all implemented.
        return model.device.type == "cpu" and model.dtype == torch.float32 and model.config.hd % 2 == 0

    def refresh(self) -> None:
        versions = [p._version for p in self._params]
        if versions == self._versions:
            return
        m = self.model

        def arr(t: torch.Tensor) -> _F32:
            return np.ascontiguousarray(t.detach().numpy())

        def fused_t(*weights: torch.Tensor) -> _F32:  # x @ W.T for several W, as one [in, out]
            return np.ascontiguousarray(np.concatenate([arr(w) for w in weights]).T)

        def fused_bias(*linears: nn.Linear) -> _F32 | None:  # zeros where one of them has none
            if all(lin.bias is None for lin in linears):
                return None
            parts = [
                arr(lin.bias) if lin.bias is not None else np.zeros(lin.out_features, np.float32)
                for lin in linears
            ]
            return np.concatenate(parts)

        def optional(norm: RMSNorm | None) -> _F32 | None:
            return arr(norm.weight) if norm is not None else None

        layers: list[_NumpyLayer] = []
        for layer in m.model.layers:
            assert isinstance(layer, DecoderLayer)
            a, mlp = layer.self_attn, layer.mlp
            layers.append(
                _NumpyLayer(
                    norm1=arr(layer.input_layernorm.weight),
                    w_qkv=fused_t(a.q_proj.weight, a.k_proj.weight, a.v_proj.weight),
                    b_qkv=fused_bias(a.q_proj, a.k_proj, a.v_proj),
                    q_norm=optional(a.q_norm),
                    k_norm=optional(a.k_norm),
                    w_o=fused_t(a.o_proj.weight),
                    b_o=fused_bias(a.o_proj),
                    norm2=arr(layer.post_attention_layernorm.weight),
                    w_gate_up=fused_t(mlp.gate_proj.weight, mlp.up_proj.weight),
                    b_gate_up=fused_bias(mlp.gate_proj, mlp.up_proj),
                    w_down=fused_t(mlp.down_proj.weight),
                    b_down=fused_bias(mlp.down_proj),
                )
            )
        self.layers = layers
        self.embed = arr(m.model.embed_tokens.weight)  # [V, D]
        self.final_norm = arr(m.model.norm.weight)
        self.head_t = fused_t(m.lm_head.weight)  # [D, V]
        self._versions = versions

    def _rms(self, x: _F32, weight: _F32) -> _F32:
        normed: _F32 = x * (1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps)) * weight
        return normed

    def __call__(self, tokens: torch.Tensor, cache: KVCache, last_only: bool) -> torch.Tensor:
        t = tokens.shape[1]
        pos = cache.pos
        end = pos + t
        h_q, h_kv, hd, group = self.h_q, self.h_kv, self.hd, self.group
        n_q, n_kv = h_q * hd, h_kv * hd
        cos, ssin, perm = self.cos[pos:end], self.signed_sin[pos:end], self.perm  # [T, hd]
        keys, values = cache.k.numpy(), cache.v.numpy()  # [L, 1, Hkv, S, hd], shared with torch
        # Query row i (position pos+i) may not see keys after it: an additive -inf above the diagonal.
        mask = np.triu(np.full((t, end), -np.inf, dtype=np.float32), pos + 1) if t > 1 else None
        h = self.embed[tokens.numpy()[0]]  # [T, D]
        for i, layer in enumerate(self.layers):
            qkv = self._rms(h, layer.norm1) @ layer.w_qkv  # [T, n_q + 2 n_kv]
            if layer.b_qkv is not None:
                qkv += layer.b_qkv
            q = qkv[:, :n_q].reshape(t, h_q, hd)
            k = qkv[:, n_q : n_q + n_kv].reshape(t, h_kv, hd)
            if layer.q_norm is not None and layer.k_norm is not None:
                q, k = self._rms(q, layer.q_norm), self._rms(k, layer.k_norm)  # per head, before rotation
            q, k = q.transpose(1, 0, 2), k.transpose(1, 0, 2)  # [H, T, hd], [Hkv, T, hd]
            k_buf, v_buf = keys[i, 0], values[i, 0]  # [Hkv, S, hd]
            k_buf[:, pos:end] = k * cos + k[..., perm] * ssin
            v_buf[:, pos:end] = qkv[:, n_q + n_kv :].reshape(t, h_kv, hd).transpose(1, 0, 2)
            q = (q * cos + q[..., perm] * ssin).reshape(h_kv, group * t, hd)  # heads grouped by kv head
            scores = (q @ k_buf[:, :end].transpose(0, 2, 1)) * self.scale  # [Hkv, G*T, end]
            if mask is not None:
                scores = (scores.reshape(h_kv, group, t, end) + mask).reshape(h_kv, group * t, end)
            scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
            scores /= scores.sum(axis=-1, keepdims=True)
            y = (scores @ v_buf[:, :end]).reshape(h_q, t, hd).transpose(1, 0, 2).reshape(t, n_q)  # [T, D]
            attn = y @ layer.w_o
            if layer.b_o is not None:
                attn += layer.b_o
            h = h + attn
            gate_up = self._rms(h, layer.norm2) @ layer.w_gate_up  # [T, 2 F]
            if layer.b_gate_up is not None:
                gate_up += layer.b_gate_up
            gate = gate_up[:, : self.ffn]
            # silu(g) = g * sigmoid(g), with sigmoid through tanh: no overflow for very negative g.
            mlp = (gate * (0.5 + 0.5 * np.tanh(0.5 * gate)) * gate_up[:, self.ffn :]) @ layer.w_down
            if layer.b_down is not None:
                mlp += layer.b_down
            h = h + mlp
        cache.pos = end
        if last_only:
            h = h[-1:]
        logits = self._rms(h, self.final_norm) @ self.head_t  # [T or 1, V]
        return torch.from_numpy(logits).unsqueeze(0)  # [1, T or 1, V]


def build_model(cfg: ModelConfig, seed: int | None = None) -> Transformer:
    """A freshly initialised model; `seed` makes the initial weights reproducible."""
    if seed is None:
        return Transformer(cfg)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Transformer(cfg)
