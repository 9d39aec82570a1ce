"""Model artifacts as Hugging Face folders: the only on-disk format the engine reads or writes.

Owns `save_hf_folder` (config.json naming the model's own family, `LlamaForCausalLM`,
`Qwen2ForCausalLM`, `Qwen3ForCausalLM` or `MistralForCausalLM`, with that family's keys;
model.safetensors; tokenizer.json + tokenizer_config.json), so `transformers`' `AutoModelForCausalLM`
and `AutoTokenizer` load the folder unchanged and a drafter trained from a Qwen2 drafter is saved as
a Qwen2 model, and `load_hf_folder`, which loads any local folder of a family `ModelConfig` supports
(llama, qwen2, qwen3, mistral) as a target or drafter; other `model_type`s are refused by name.

Only safetensors are read: a pickle (`pytorch_model.bin`, `*.pt`) can run code when loaded, so a
folder that holds only pickles is refused with an error saying so. Half-precision weights load into
float32 by default because CPU matmuls in fp16/bf16 are slower and less exact.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from workers.engine.model import ModelConfig, Transformer
from workers.engine.tokenizer import Tokenizer

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


class ChecksumMismatchError(ValueError):
    """A weights file whose sha256 is not the one recorded for it."""


def sha256_of_file(path: str | Path, chunk_size: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk_size):
            h.update(block)
    return h.hexdigest()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def save_hf_folder(
    model: Transformer,
    tokenizer: Tokenizer,
    folder: str | Path,
    dtype: torch.dtype = torch.float32,
    metadata: dict[str, str] | None = None,
) -> str:
    """Write the HF folder and return the sha256 of model.safetensors (record it with the artifact)."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ValueError(f"tokenizer has {tokenizer.vocab_size} tokens but the model only {cfg.vocab_size}")
    state = {}
    for name, t in model.state_dict().items():
        # Tied heads are stored once, as transformers does; safetensors refuses shared storage anyway.
        if cfg.tie_embeddings and name == "lm_head.weight":
            continue
        state[name] = t.detach().to("cpu", dtype).contiguous()
    meta = {"format": "pt", **(metadata or {})}
    weights = out / WEIGHTS_NAME
    save_file(state, str(weights), metadata=meta)

    hf = cfg.to_hf_dict()
    if tokenizer.eos_id is not None:
        hf["eos_token_id"] = tokenizer.eos_id
        hf.setdefault("bos_token_id", tokenizer.eos_id)
    hf["torch_dtype"] = _dtype_name(dtype)
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    gen = {"eos_token_id": hf.get("eos_token_id"), "bos_token_id": hf.get("bos_token_id")}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")

    tokenizer.save(out / "tokenizer.json")
    tok_cfg: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": cfg.max_seq_len,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "add_eos_token": False,
    }
    if tokenizer.eos_token is not None:
        tok_cfg.update(eos_token=tokenizer.eos_token, bos_token=tokenizer.eos_token)
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    return sha256_of_file(weights)


def _weight_files(folder: Path) -> list[Path]:
    single = folder / WEIGHTS_NAME
    if single.is_file():
        return [single]
    index = folder / INDEX_NAME
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / s for s in shards]
    found = sorted(folder.glob("*.safetensors"))
    if found:
        return found
    pickles = [p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES]
    if pickles:
        raise ValueError(
            f"{folder} holds only pickled weights ({', '.join(pickles)}); refusing to load them because "
            "unpickling can execute code. Convert the checkpoint to safetensors first."
        )
    raise FileNotFoundError(f"no model.safetensors in {folder}")


def load_hf_folder(
    folder: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    expected_sha256: str | None = None,
    max_seq_len: int | None = None,
) -> tuple[Transformer, Tokenizer]:
    """Load a local HF folder of a supported family as (model in eval mode, tokenizer).

    `expected_sha256` is checked against model.safetensors (single-file folders) before anything is
    read. `max_seq_len` caps the rotary/mask tables, which real checkpoints size for 100k+ positions.
    """
    path = Path(folder)
    if not path.is_dir():
        raise FileNotFoundError(f"model folder {path} does not exist")
    files = _weight_files(path)
    if expected_sha256 is not None:
        if len(files) != 1:
            raise ValueError("expected_sha256 needs a single model.safetensors file")
        actual = sha256_of_file(files[0])
        if actual != expected_sha256:
            raise ChecksumMismatchError(
                f"{files[0]} has sha256 {actual}, expected {expected_sha256}: refusing a changed artifact"
            )
    hf_cfg = json.loads((path / "config.json").read_text())
    cfg = ModelConfig.from_hf_dict(hf_cfg)
    if max_seq_len is not None:
        cfg.max_seq_len = min(cfg.max_seq_len, max_seq_len)

    state: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            for name in sf.keys():
                if name.endswith("rotary_emb.inv_freq"):  # derived from the config, never loaded
                    continue
                state[name] = sf.get_tensor(name).to(dtype)
    if cfg.tie_embeddings:
        state.pop("lm_head.weight", None)
    with torch.device("meta"):
        model = Transformer(cfg)  # no random init work for weights about to be overwritten
    model = model.to_empty(device=device)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=False)
    missing = [m for m in missing if not (cfg.tie_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(
            f"{path} is not a {cfg.family} checkpoint this engine understands: "
            f"missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    if cfg.tie_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
        model.invalidate_fast_path()  # a Parameter object was swapped
    model.init_buffers(device)
    model = model.to(dtype).eval()

    tok_file = path / "tokenizer.json"
    if not tok_file.is_file():
        raise FileNotFoundError(f"{path} has no tokenizer.json (a fast tokenizer is required)")
    tokenizer = Tokenizer.from_file(path)
    if tokenizer.eos_id is None and cfg.eos_token_id is not None:
        # Folders without tokenizer_config.json still name their end token by id in config.json.
        eos_token = tokenizer.tok.id_to_token(cfg.eos_token_id)
        if eos_token is not None:
            tokenizer = Tokenizer(tokenizer.tok, eos_token)
    return model, tokenizer
