"""Bringing a model in from a GGUF file: GGUF → a verified Hugging Face folder the engine and the
model registry read.

Owns `import_gguf(gguf_path, out_folder)`. `transformers`' own GGUF loader reads the file (its
metadata, tokenizer and dequantised weights: nothing here parses GGUF tensors); the folder written
holds plain float32 weights (model.safetensors), config.json without the GGUF `quantization_config`,
generation_config.json, the tokenizer (tokenizer.json, tokenizer_config.json, chat_template.jinja
when the file carries a chat template) and gguf_import.json (where it came from and what the check
measured). It is written beside its final place and renamed into it only once checked, so a
failed or interrupted import never leaves a half folder where a model is expected.

The check: the engine loads the new folder (`workers.engine.hf_io.load_hf_folder`) and must
tokenise a probe exactly as the GGUF's tokenizer does and give the same logits as `transformers`'
GGUF-loaded model, on the full causal pass and on the cached decoding path (prefill, then one-row
steps), within `tolerance`. A conversion fault (a permuted head, a wrong norm epsilon or rotary
base) moves logits by 1e-1 or more; two correct float32 implementations differ by float rounding
(on SmolLM2-135M, `transformers`' own SDPA and eager attention differ by 1.0e-4), hence the default
tolerance of 1e-3.

Families: the ones both `transformers`' GGUF loader and the engine's `ModelConfig` implement:
llama, qwen2 and qwen3 files (llama.cpp writes Mistral models as llama, and `transformers` 5.25
loads them as Llama, the same block without a window); any other architecture is refused by name
before weights are read. Checked on files written in the tests (llama, qwen2) and on SmolLM2
(llama); `transformers` 5.25 loads a qwen3 file only when its head width is 128 (its qwen3 mapping
reads none), and a file it cannot load is refused with its reason.
GGUF files whose rotary frequencies are rescaled (Llama 3.1's `rope_freqs` tensor or
`*.rope.scaling.*` keys) are refused too: `transformers`' GGUF loader does not carry the scaling
over, so the check would compare two models that are both wrong past the original context.

Usage: python -m workers.gguf_import FILE OUT [--name NAME] [--overwrite] [--tolerance 1e-3]
(prints the summary as JSON on its last line; exit status 2 for a refused file or folder).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import shutil
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from workers.engine.hf_io import WEIGHTS_NAME, load_hf_folder, sha256_of_file
from workers.engine.model import FAMILIES

GGUF_MAGIC = b"GGUF"
# general.architecture values of the engine's families (llama.cpp writes Mistral models as "llama").
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")
DEFAULT_TOLERANCE = 1e-3
# What the import writes besides the weights: where the folder came from and what the check measured.
REPORT_NAME = "gguf_import.json"
# A chat turn when the file has a chat template (what a served model will mostly see), else plain
# text; either way numbers, punctuation and several scripts' worth of byte-level pieces.
PROBE_MESSAGES = (
    {"role": "user", "content": "Extract the person as JSON: Maria Lopez, 34, lives in Madrid (Spain)."},
)
PROBE_TEXT = "The quick brown fox jumps over the lazy dog. 12 + 30 = 42; naïve café, ok?"
# One-row decoding steps the check runs after the cached prefill.
PROBE_STEPS = 3


class GGUFImportError(ValueError):
    """A GGUF file or output folder the import refuses; the message says why and what to do."""


class NotGGUFError(GGUFImportError):
    """The file does not start with the GGUF magic bytes."""


class UnsupportedArchitectureError(GGUFImportError):
    """A GGUF model of an architecture the engine (or transformers' GGUF loader) does not run."""


class OutputExistsError(GGUFImportError):
    """The output folder already exists and overwriting was not asked for."""


class VerificationError(GGUFImportError):
    """The written folder does not reproduce the GGUF model in the engine within the tolerance."""


@dataclass(frozen=True)
class GGUFImportSummary:
    name: str  # the registry name it is meant for (default: the folder's name)
    folder: str
    source: str
    source_sha256: str
    architecture: str  # general.architecture in the file
    family: str  # the engine family (model_type) of the folder
    parameter_count: int
    tensor_types: dict[str, int]  # GGUF storage types of the source tensors, e.g. {"Q4_1": 182}
    probe_tokens: int
    tokenizer_identical: bool
    logit_max_abs_diff: float  # engine full causal pass vs transformers' GGUF-loaded model
    cached_logit_max_abs_diff: float  # engine cached prefill + one-row steps vs the same
    tolerance: float
    seconds: float
    files: list[str]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class GGUFHeader:
    architecture: str
    model_name: str | None
    tensor_types: dict[str, int]
    rope_scaled: bool


def supported_architectures() -> list[str]:
    """GGUF architectures both transformers' GGUF loader and the engine implement."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    return [arch for arch in GGUF_ARCHITECTURES if arch in GGUF_SUPPORTED_ARCHITECTURES]


def check_gguf_magic(path: Path) -> None:
    """Refuse a missing file or one that is not GGUF, before anything heavier reads it."""
    if not path.is_file():
        raise GGUFImportError(f"GGUF file {path} does not exist")
    with open(path, "rb") as f:
        magic = f.read(len(GGUF_MAGIC))
    if magic != GGUF_MAGIC:
        raise NotGGUFError(f"{path} is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r})")


def read_gguf_header(path: Path) -> GGUFHeader:
    """The architecture, name, tensor storage types and rotary scaling of a GGUF file (no weights read)."""
    from gguf import GGUFReader

    check_gguf_magic(path)
    try:
        reader = GGUFReader(str(path))
    except (ValueError, OSError) as exc:
        raise NotGGUFError(f"{path} is not a readable GGUF file: {exc}") from exc

    def string_field(key: str) -> str | None:
        found = reader.fields.get(key)
        return None if found is None else str(found.contents())

    architecture = string_field("general.architecture")
    if architecture is None:
        raise NotGGUFError(f"{path} has no general.architecture key: not a model GGUF file")
    rope_scaled = any(t.name == "rope_freqs.weight" for t in reader.tensors) or any(
        key.startswith(f"{architecture}.rope.scaling.") and key != f"{architecture}.rope.scaling.type"
        for key in reader.fields
    )
    if string_field(f"{architecture}.rope.scaling.type") not in (None, "none"):
        rope_scaled = True
    types = Counter(t.tensor_type.name for t in reader.tensors)
    return GGUFHeader(architecture, string_field("general.name"), dict(sorted(types.items())), rope_scaled)


def check_supported(header: GGUFHeader, path: Path) -> None:
    supported = supported_architectures()
    if header.architecture not in supported:
        raise UnsupportedArchitectureError(
            f"{path} holds a {header.architecture!r} model; GGUF import supports the "
            f"{', '.join(supported)} architectures (Mistral files are written as llama), what both "
            "transformers' GGUF loader and this engine run"
        )
    if header.rope_scaled:
        raise UnsupportedArchitectureError(
            f"{path} rescales its rotary frequencies (rope_freqs / rope.scaling keys), which "
            "transformers' GGUF loader does not carry over; import the model's original Hugging Face "
            "folder instead"
        )


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()  # type: ignore[no-untyped-call]


def _write_folder(model: Any, tokenizer: Any, folder: Path) -> None:
    """Plain float32 weights, the config without GGUF traces, generation config and tokenizer."""
    config = copy.deepcopy(model.config)
    # The loaded model still counts as GGUF-quantised to transformers (save_pretrained refuses it);
    # the weights written here are plain float32, so the folder must not claim otherwise.
    for key in ("quantization_config", "_model_name_or_path"):
        if hasattr(config, key):
            delattr(config, key)
    config.dtype = torch.float32
    config.architectures = [type(model).__name__]  # GGUF-loaded configs leave it empty
    config.save_pretrained(str(folder))
    if model.generation_config is not None:
        model.generation_config.save_pretrained(str(folder))

    state = {}
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    for name, tensor in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue  # stored once, as transformers does (safetensors refuses shared storage anyway)
        state[name] = tensor.detach().to("cpu", torch.float32).contiguous()
    save_file(state, str(folder / WEIGHTS_NAME), metadata={"format": "pt"})

    tokenizer.save_pretrained(str(folder))
    tok_config_path = folder / "tokenizer_config.json"
    tok_config = json.loads(tok_config_path.read_text())
    # The generic fast-tokenizer class every transformers version reads, and the model's real
    # context instead of transformers' "unlimited" placeholder.
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok_config["model_max_length"] = int(getattr(model.config, "max_position_embeddings", 2048))
    for key in ("is_local", "local_files_only"):
        tok_config.pop(key, None)
    tok_config_path.write_text(json.dumps(tok_config, indent=2, sort_keys=True) + "\n")
    for stray in ("special_tokens_map.json",):  # the same tokens are in tokenizer_config.json
        with contextlib.suppress(FileNotFoundError):
            (folder / stray).unlink()
    # safetensors creates its file owner-only; the folder is shared with the API and the workers,
    # so every file gets the mode the process's umask gave config.json.
    mode = (folder / "config.json").stat().st_mode & 0o777
    for path in folder.iterdir():
        path.chmod(mode)


def _probe_ids(tokenizer: Any) -> tuple[str, list[int]]:
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(list(PROBE_MESSAGES), tokenize=False, add_generation_prompt=True)
    else:
        text = PROBE_TEXT
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return str(text), ids


def verify_folder(folder: Path, reference: Any, tokenizer: Any) -> tuple[int, bool, float, float]:
    """(probe tokens, tokenizer identical, full-pass max |Δlogit|, cached-path max |Δlogit|) of the
    engine reading ``folder`` against ``reference`` (transformers' model) on the probe."""
    text, ids = _probe_ids(tokenizer)
    engine, engine_tokenizer = load_hf_folder(folder, max_seq_len=len(ids) + 8)
    tokenizer_identical = engine_tokenizer.encode(text) == ids
    tokens = torch.tensor([ids])  # [1, T]
    with torch.no_grad():
        expected = reference(tokens).logits.float()  # [1, T, V]
        full = engine(tokens)  # [1, T, V]
        cache = engine.new_cache(max_len=len(ids))
        split = max(1, len(ids) - PROBE_STEPS)
        parts = [engine.forward_cached(tokens[:, :split], cache)]
        parts += [engine.forward_cached(tokens[:, i : i + 1], cache) for i in range(split, len(ids))]
        cached = torch.cat(parts, dim=1)  # [1, T, V]
    vocab = expected.shape[-1]
    full_diff = float((full[..., :vocab] - expected).abs().max())
    cached_diff = float((cached[..., :vocab] - expected).abs().max())
    return len(ids), tokenizer_identical, full_diff, cached_diff


def import_gguf(
    gguf_path: str | Path,
    out_folder: str | Path,
    *,
    name: str | None = None,
    overwrite: bool = False,
    tolerance: float = DEFAULT_TOLERANCE,
) -> GGUFImportSummary:
    """Write ``out_folder`` as a verified float32 Hugging Face folder of the model in ``gguf_path``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.perf_counter()
    source = Path(gguf_path).expanduser().resolve()
    out = Path(out_folder).expanduser().absolute()
    header = read_gguf_header(source)
    check_supported(header, source)
    if out.exists() and not overwrite:
        raise OutputExistsError(f"{out} already exists; choose another folder or pass --overwrite")
    try:
        with _quiet_transformers():
            model = AutoModelForCausalLM.from_pretrained(
                str(source.parent), gguf_file=source.name, dtype=torch.float32
            )
            model.eval()  # type: ignore[no-untyped-call]
            tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    except (ValueError, RuntimeError, KeyError, NotImplementedError) as exc:
        # Metadata transformers' loader cannot map (e.g. its qwen3 mapping reads no head width, so
        # only files with transformers' default of 128 load): nothing was written.
        raise UnsupportedArchitectureError(
            f"transformers could not load {source.name} as a {header.architecture} model: {exc}"
        ) from exc
    family = str(model.config.model_type)
    if family not in FAMILIES:  # transformers may rename (a llama file named "mistral" is mistral)
        raise UnsupportedArchitectureError(f"{source} loads as {family!r}, which the engine does not run")

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.importing-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        _write_folder(model, tokenizer, staging)
        probe_tokens, tokenizer_identical, full_diff, cached_diff = verify_folder(staging, model, tokenizer)
        if not tokenizer_identical:
            raise VerificationError(
                f"the engine tokenises the probe differently from {source.name}'s own tokenizer"
            )
        worst = max(full_diff, cached_diff)
        if not worst <= tolerance:  # also refuses NaN
            raise VerificationError(
                f"the imported folder's logits differ from transformers' GGUF model by {worst:.3g} "
                f"(full pass {full_diff:.3g}, cached path {cached_diff:.3g}), over the tolerance "
                f"{tolerance:g}: refusing it"
            )
        summary = GGUFImportSummary(
            name=name or out.name,
            folder=str(out),
            source=str(source),
            source_sha256=sha256_of_file(source),
            architecture=header.architecture,
            family=family,
            parameter_count=sum(p.numel() for p in model.parameters()),
            tensor_types=header.tensor_types,
            probe_tokens=probe_tokens,
            tokenizer_identical=tokenizer_identical,
            logit_max_abs_diff=full_diff,
            cached_logit_max_abs_diff=cached_diff,
            tolerance=tolerance,
            seconds=0.0,
            files=[],
        )
        report: dict[str, Any] = {
            k: v for k, v in summary.to_dict().items() if k not in ("folder", "seconds", "files")
        }
        report["source"] = source.name  # the folder may move; the file's name and hash identify it
        # What was written, so a later run can tell the folder is still what this import checked.
        report["files_sha256"] = {p.name: sha256_of_file(p) for p in sorted(staging.iterdir())}
        (staging / REPORT_NAME).write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
        files = sorted(p.name for p in staging.iterdir())
        _move_into_place(staging, out, overwrite=overwrite)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    seconds = round(time.perf_counter() - started, 2)
    return GGUFImportSummary(**{**summary.to_dict(), "seconds": seconds, "files": files})


def imported_from(folder: str | Path, source_sha256: str) -> bool:
    """Whether ``folder`` is an import of the GGUF file with ``source_sha256`` whose every file still
    has the hash the import recorded (reads every file: seconds for a 0.5 GB model)."""
    path = Path(folder)
    try:
        report = json.loads((path / REPORT_NAME).read_text())
    except (OSError, ValueError):
        return False
    recorded = report.get("files_sha256")
    if report.get("source_sha256") != source_sha256 or not isinstance(recorded, dict):
        return False
    present = sorted(p.name for p in path.iterdir() if p.name != REPORT_NAME)
    if present != sorted(recorded):
        return False
    return all(sha256_of_file(path / name) == digest for name, digest in recorded.items())


def _move_into_place(staging: Path, out: Path, *, overwrite: bool) -> None:
    if not out.exists():
        os.rename(staging, out)  # refuses (rather than merges) if a folder appeared meanwhile
        return
    if not overwrite:
        raise OutputExistsError(f"{out} appeared while importing; nothing was written there")
    retired = out.parent / f".{out.name}.replaced-{os.getpid()}"
    os.rename(out, retired)
    os.rename(staging, out)
    shutil.rmtree(retired, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers.gguf_import", description=__doc__.split("\n")[0])
    parser.add_argument("file", type=Path, help="the .gguf file")
    parser.add_argument("out", type=Path, help="the Hugging Face folder to write (must not exist)")
    parser.add_argument("--name", help="the model's name in the summary (default: the folder's name)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing folder")
    parser.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE, help="max |logit diff|")
    args = parser.parse_args(argv)
    try:
        summary = import_gguf(
            args.file, args.out, name=args.name, overwrite=args.overwrite, tolerance=args.tolerance
        )
    except GGUFImportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(summary.to_dict(), sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
