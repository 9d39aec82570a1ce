"""GGUF import on a tiny random-weight Llama GGUF written here with the `gguf` package's own writer
(Q8_0 and float32 tensors, a byte-level BPE tokenizer with merges, ChatML chat template): the folder
it writes loads in transformers and in the engine with the GGUF model's logits, renders its chat
template, and the refusals (not GGUF, unsupported architecture, rescaled rotary, existing folder, a
folder that does not reproduce the model) say what they refuse. No network."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from safetensors.torch import load_file, save_file
from tokenizers.pre_tokenizers import ByteLevel
from transformers import AutoModelForCausalLM, AutoTokenizer
from typer.testing import CliRunner

from controlplane.cli import app
from workers.engine.hf_io import load_hf_folder
from workers.engine.model import FAMILIES
from workers.gguf_import import (
    REPORT_NAME,
    GGUFImportError,
    NotGGUFError,
    OutputExistsError,
    UnsupportedArchitectureError,
    import_gguf,
    verify_folder,
)
from workers.serve.chat import render_chat

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] "
    "+ '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "r e", "Ġ s", "a t"]
DIM, LAYERS, HEADS, KV_HEADS, FFN = 64, 2, 4, 2, 128
# Exactness of two float32 implementations of the same model: far below what a conversion fault
# (permuted heads, a wrong epsilon or rotary base) moves the logits by, which is checked too.
LOGIT_TOLERANCE = 1e-4


def _tokens() -> list[str]:
    merged = [a + b for a, b in (m.split(" ") for m in MERGES)]
    return [*SPECIALS, *sorted(ByteLevel.alphabet()), *merged]


def write_tiny_llama_gguf(
    path: Path,
    *,
    tied: bool = True,
    arch: str = "llama",
    name: str = "tiny test model",
    rope_freqs: bool = False,
    seed: int = 0,
) -> Path:
    """A two-layer Llama GGUF with random weights: what llama.cpp's converter writes, in miniature."""
    rng = np.random.default_rng(seed)
    tokens = _tokens()
    vocab = len(tokens)
    hd = DIM // HEADS
    writer = GGUFWriter(str(path), arch=arch)
    writer.add_name(name)
    writer.add_context_length(256)
    writer.add_embedding_length(DIM)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(hd)
    if arch == "qwen3":  # llama.cpp states Qwen3's head width; transformers reads it from here
        writer.add_key_length(hd)
        writer.add_value_length(hd)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(SPECIALS) + [1] * (vocab - len(SPECIALS)))  # 3: control
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML)

    def dense(name: str, rows: int, cols: int, std: float, q8: bool = True) -> None:
        weight = rng.normal(0.0, std, size=(rows, cols)).astype(np.float32)  # [out, in]
        if q8:
            writer.add_tensor(
                name, quantize(weight, GGMLQuantizationType.Q8_0), raw_dtype=GGMLQuantizationType.Q8_0
            )
        else:
            writer.add_tensor(name, weight)

    def norm(name: str, width: int) -> None:
        writer.add_tensor(name, (1.0 + rng.normal(0.0, 0.1, size=width)).astype(np.float32))

    # Large enough weights that logits are O(1-10): a layout fault would move them by a lot.
    dense("token_embd.weight", vocab, DIM, 1.0)
    for i in range(LAYERS):
        norm(f"blk.{i}.attn_norm.weight", DIM)
        dense(f"blk.{i}.attn_q.weight", HEADS * hd, DIM, 0.3)
        dense(f"blk.{i}.attn_k.weight", KV_HEADS * hd, DIM, 0.3)
        dense(f"blk.{i}.attn_v.weight", KV_HEADS * hd, DIM, 0.2, q8=False)
        dense(f"blk.{i}.attn_output.weight", DIM, HEADS * hd, 0.2)
        if arch == "qwen2":  # Qwen2 biases q, k and v
            for part, rows in (("q", HEADS * hd), ("k", KV_HEADS * hd), ("v", KV_HEADS * hd)):
                writer.add_tensor(
                    f"blk.{i}.attn_{part}.bias", rng.normal(0.0, 0.5, size=rows).astype(np.float32)
                )
        if arch == "qwen3":  # Qwen3 RMS-normalises each query and key head
            norm(f"blk.{i}.attn_q_norm.weight", hd)
            norm(f"blk.{i}.attn_k_norm.weight", hd)
        norm(f"blk.{i}.ffn_norm.weight", DIM)
        dense(f"blk.{i}.ffn_gate.weight", FFN, DIM, 0.2)
        dense(f"blk.{i}.ffn_up.weight", FFN, DIM, 0.2)
        dense(f"blk.{i}.ffn_down.weight", DIM, FFN, 0.2, q8=False)
    norm("output_norm.weight", DIM)
    if not tied:
        dense("output.weight", vocab, DIM, 0.3)
    if rope_freqs:  # what Llama 3.1 GGUFs carry for their rescaled rotary frequencies
        writer.add_tensor("rope_freqs.weight", np.ones(hd // 2, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# (GGUF architecture, general.name, tied embeddings) -> the family transformers and the engine load
VARIANTS = {
    "llama-tied": ("llama", "tiny test model", True, "llama"),
    "llama-untied": ("llama", "tiny test model", False, "llama"),
    "qwen2": ("qwen2", "tiny test model", True, "qwen2"),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def imported(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the GGUF file, the folder imported from it)."""
    arch, name, tied, family = VARIANTS[request.param]
    root = tmp_path_factory.mktemp("gguf")
    gguf = write_tiny_llama_gguf(root / "Tiny-Test.Q8_0.gguf", arch=arch, name=name, tied=tied)
    summary = import_gguf(gguf, root / "tiny")
    assert summary.family == family
    return gguf, root / "tiny"


def _gguf_model(gguf: Path) -> tuple[Any, Any]:
    model: Any = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    return model.eval(), tokenizer


def test_folder_reproduces_the_gguf_model_in_transformers_and_the_engine(imported: tuple[Path, Path]) -> None:
    gguf, folder = imported
    assert sorted(p.name for p in folder.iterdir()) == [
        "chat_template.jinja",
        "config.json",
        "generation_config.json",
        REPORT_NAME,
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert not list(folder.parent.glob(".tiny.*")), "the staging folder was left behind"
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config and "_model_name_or_path" not in config
    assert config["architectures"] == [FAMILIES[config["model_type"]]] and config["dtype"] == "float32"
    report = json.loads((folder / REPORT_NAME).read_text())
    assert report["tensor_types"] == {
        "F32": (4 + 3 * (config["model_type"] == "qwen2")) * LAYERS + 1,  # norms, v, down, biases
        "Q8_0": 5 * LAYERS + 1 + (not config["tie_word_embeddings"]),
    }
    assert report["tokenizer_identical"] and report["logit_max_abs_diff"] <= LOGIT_TOLERANCE

    reference, tokenizer = _gguf_model(gguf)
    text = "<|im_start|>user\nthe cat sat on the mat, then 42 naïve rats ran.<|im_end|>\n"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == 1 and len(ids) > 20  # the special token stays whole, the text is byte pieces
    tokens = torch.tensor([ids])
    plain: Any = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    plain.eval()
    engine, engine_tokenizer = load_hf_folder(folder, max_seq_len=128)
    assert engine_tokenizer.encode(text) == ids
    assert engine_tokenizer.eos_token == "<|im_end|>"
    with torch.no_grad():
        expected = reference(tokens).logits  # [1, T, V]
        assert expected.abs().max() > 1.0  # logits large enough for a layout fault to show
        assert (plain(tokens).logits - expected).abs().max() <= 1e-6
        assert (engine(tokens) - expected).abs().max() <= LOGIT_TOLERANCE
        cache = engine.new_cache()
        cached = torch.cat(
            [engine.forward_cached(tokens[:, :-2], cache)]
            + [engine.forward_cached(tokens[:, i : i + 1], cache) for i in range(len(ids) - 2, len(ids))],
            dim=1,
        )
        assert (cached - expected).abs().max() <= LOGIT_TOLERANCE


def test_chat_template_renders_chatml(imported: tuple[Path, Path]) -> None:
    _, folder = imported
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert render_chat(str(folder), messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def _permuted_like_llama_cpp(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """q/k rows in llama.cpp's interleaved rotary order: what a converter that forgot to undo it writes."""
    rows, cols = weight.shape
    return weight.reshape(heads, 2, rows // heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def test_the_check_refuses_a_folder_that_is_not_the_model(
    imported: tuple[Path, Path], tmp_path: Path
) -> None:
    gguf, folder = imported
    reference, tokenizer = _gguf_model(gguf)
    _, identical, full_diff, cached_diff = verify_folder(folder, reference, tokenizer)
    assert identical and max(full_diff, cached_diff) <= LOGIT_TOLERANCE
    for fault in ("norm epsilon", "rotary base", "interleaved q/k rows"):
        broken = shutil.copytree(folder, tmp_path / fault.replace(" ", "-").replace("/", ""))
        config = json.loads((broken / "config.json").read_text())
        if fault == "norm epsilon":
            config["rms_norm_eps"] = 0.5
        elif fault == "rotary base":
            config["rope_parameters"]["rope_theta"] = 10.0
        else:
            weights = load_file(str(broken / "model.safetensors"))
            for i in range(LAYERS):
                for proj, heads in (("q_proj", HEADS), ("k_proj", KV_HEADS)):
                    name = f"model.layers.{i}.self_attn.{proj}.weight"
                    weights[name] = _permuted_like_llama_cpp(weights[name], heads).contiguous()
            save_file(weights, str(broken / "model.safetensors"), metadata={"format": "pt"})
        (broken / "config.json").write_text(json.dumps(config))
        _, identical, full_diff, cached_diff = verify_folder(broken, reference, tokenizer)
        assert identical
        assert min(full_diff, cached_diff) > 1e-2, fault


def test_refusals_name_what_they_refuse(imported: tuple[Path, Path], tmp_path: Path) -> None:
    gguf, folder = imported
    text_file = tmp_path / "notes.gguf"
    text_file.write_text("not a model")
    with pytest.raises(NotGGUFError, match="is not a GGUF file"):
        import_gguf(text_file, tmp_path / "a")
    with pytest.raises(GGUFImportError, match="does not exist"):
        import_gguf(tmp_path / "missing.gguf", tmp_path / "b")
    other = write_tiny_llama_gguf(tmp_path / "gpt2.gguf", arch="gpt2")
    with pytest.raises(
        UnsupportedArchitectureError,
        match=r"'gpt2' model; GGUF import supports the llama, qwen2, qwen3 architectures",
    ):
        import_gguf(other, tmp_path / "c")
    scaled = write_tiny_llama_gguf(tmp_path / "scaled.gguf", rope_freqs=True)
    with pytest.raises(UnsupportedArchitectureError, match="rescales its rotary frequencies"):
        import_gguf(scaled, tmp_path / "d")
    before = sorted(p.name for p in folder.iterdir())
    with pytest.raises(OutputExistsError, match="already exists"):
        import_gguf(gguf, folder)
    assert sorted(p.name for p in folder.iterdir()) == before
    assert not any((tmp_path / name).exists() for name in "abcd")


@pytest.mark.slow  # a subprocess that imports torch and transformers: 10-25 s on a busy 2-core machine
def test_cli_imports_into_a_model_root_and_refuses_clearly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "models"
    monkeypatch.setenv("CONTROLPLANE_MODEL_ROOTS", json.dumps([str(root)]))
    from controlplane.config import get_settings

    get_settings.cache_clear()
    try:
        gguf = write_tiny_llama_gguf(tmp_path / "Tiny-Chat.Q8_0.gguf", seed=3)
        runner = CliRunner()
        done = runner.invoke(app, ["model", "import-gguf", str(gguf)])
        assert done.exit_code == 0, done.output
        summary = json.loads(done.stdout)
        assert summary["name"] == "tiny-chat-q8_0"
        assert Path(summary["folder"]) == (root / "tiny-chat-q8_0").absolute()
        assert summary["logit_max_abs_diff"] <= LOGIT_TOLERANCE and summary["tokenizer_identical"]

        again = runner.invoke(app, ["model", "import-gguf", str(gguf)])
        assert again.exit_code == 1 and "already exists" in again.output
        missing = runner.invoke(app, ["model", "import-gguf", str(tmp_path / "nope.gguf")])
        assert missing.exit_code == 1 and "does not exist" in missing.output
        (tmp_path / "weights.bin").write_bytes(b"PK\x03\x04 a zip, not a gguf")
        not_gguf = runner.invoke(app, ["model", "import-gguf", str(tmp_path / "weights.bin")])
        assert not_gguf.exit_code == 1 and "is not a GGUF file" in not_gguf.output
    finally:
        get_settings.cache_clear()
