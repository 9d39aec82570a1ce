"""Build the reference target and generic drafter from the corpora, from a seed, resumably.

    python -m workers.training.build_reference [--out DIR] [--work DIR] [--device cpu|cuda]
                                               [--resume] [--quick] [--until STAGE]

Stages, each leaving its outputs and a ``done.json`` in the work folder so ``--resume`` skips it:

1. ``data``: train the tokenizer, tokenize every domain and split into token streams, keep a few
   held-out prompts for the manifest's sample continuations. Run where the corpora were read: the
   streams, not the interpreter's stdlib, are what later stages use, so the GPU machine (another
   Python version) trains on exactly this machine's corpus.
2. ``target``: pre-train the target on the mixture of all domains (``pretrain.py``).
3. ``traces``: the target's greedy (and some sampled) continuations of prose prompts only.
4. ``drafter``: distil the generic drafter on those traces (``distill.py``).
5. ``export``: write both as Hugging Face folders in fp16 (the loaders upcast), then reload them the
   way the engine does and record validation loss per domain, sample greedy continuations, the
   recipe and a sha256 per file in ``MANIFEST.json``.

``--quick`` builds a very small pair from a sliver of the corpora in seconds (the integration test).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from workers import corpora
from workers.engine.hf_io import load_hf_folder, save_hf_folder, sha256_of_file
from workers.engine.model import Transformer
from workers.engine.tokenizer import Tokenizer
from workers.training.common import (
    TokenStream,
    device_name,
    eval_loss,
    eval_windows,
    load_streams,
    log,
    pick_device,
    python_version,
    save_streams,
    setup_threads,
)
from workers.training.distill import DistillConfig, TraceConfig, distill_drafter, generate, make_traces
from workers.training.pretrain import PretrainConfig, train_target
from workers.training.tokenizer_training import VOCAB_SIZE, train_tokenizer

REPO = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO / "workers" / "models" / "reference"
DEFAULT_WORK = REPO / "var" / "reference-build"
STAGES = ("data", "target", "traces", "drafter", "export")
SAMPLE_PROMPTS_PER_DOMAIN = 3
SAMPLE_NEW_TOKENS = 64
# A file travelling back from the GPU machine may be at most 16 MiB; snapshots are cut below that.
SNAPSHOT_SHARD_BYTES = 15 * 2**20


def _configs(args: argparse.Namespace) -> tuple[PretrainConfig, TraceConfig, DistillConfig, int]:
    """Hyper-parameters per mode; every value ends up in the manifest's recipe."""
    if args.quick:
        pre = PretrainConfig(
            dim=64,
            n_layers=2,
            n_heads=2,
            ffn_dim=128,
            seq_len=64,
            batch_size=8,
            steps=30,
            warmup=5,
            lr=3e-3,
            eval_every=15,
            eval_tokens=1024,
            seed=args.seed,
        )
        trace = TraceConfig(prompt_lens=(8, 16), gen_len=16, sequences=32, batch_size=16, seed=args.seed + 1)
        dist = DistillConfig(
            dim=32,
            n_layers=1,
            n_heads=2,
            ffn_dim=64,
            batch_size=8,
            steps=20,
            warmup=5,
            eval_every=10,
            seed=args.seed + 2,
        )
        vocab = 512
    elif args.device == "cuda":
        pre = PretrainConfig(batch_size=64, steps=3000, eval_every=100, seed=args.seed)
        trace = TraceConfig(sequences=16384, batch_size=512, seed=args.seed + 1)
        dist = DistillConfig(batch_size=64, steps=4000, seed=args.seed + 2)
        vocab = VOCAB_SIZE
    else:
        # Two CPU cores: ~2k training tokens/s for the target, so fewer, smaller batches.
        pre = PretrainConfig(
            batch_size=8, steps=1200, warmup=100, eval_every=200, eval_tokens=16_384, seed=args.seed
        )
        trace = TraceConfig(sequences=1536, batch_size=48, seed=args.seed + 1)
        # KL even though each step pays a target forward: on ~200k trace tokens, cross-entropy on the
        # tokens alone over-fitted (held-out trace agreement 0.46 vs 0.54 with KL in a side-by-side try).
        dist = DistillConfig(batch_size=8, steps=800, loss="kl", seed=args.seed + 2)
        vocab = VOCAB_SIZE
    if args.target_steps:
        pre.steps = args.target_steps
    if args.target_batch:
        pre.batch_size = args.target_batch
    if args.target_minutes:
        pre.max_seconds = args.target_minutes * 60
    if args.drafter_steps:
        dist.steps = args.drafter_steps
    if args.drafter_loss:
        dist.loss = args.drafter_loss
    if args.drafter_lr:
        dist.lr = args.drafter_lr
        dist.warmup = min(dist.warmup, max(1, dist.steps // 20))
    if args.drafter_batch:
        dist.batch_size = args.drafter_batch
    if args.drafter_minutes:
        dist.max_seconds = args.drafter_minutes * 60
    if args.trace_sequences:
        trace.sequences = args.trace_sequences
    if args.drafter_dim:
        dist.dim, dist.ffn_dim = args.drafter_dim, int(args.drafter_dim * 8 / 3) // 8 * 8
        dist.n_heads = max(1, args.drafter_dim // 32)
    if args.drafter_layers:
        dist.n_layers = args.drafter_layers
    return pre, trace, dist, vocab


# ------------------------------------------------------------------------------------------------ stages


def stage_data(work: Path, quick: bool, vocab_size: int, resume: bool) -> dict[str, Any]:
    folder = work / "data"
    if resume and (folder / "done.json").is_file():
        log(f"[data] already built in {folder}")
        return dict(json.loads((folder / "done.json").read_text()))
    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    max_docs = 24 if quick else None
    log("[data] reading corpora and training the tokenizer")
    tokenizer = train_tokenizer(vocab_size, max_docs)
    tokenizer.save(folder / "tokenizer.json")
    eos = tokenizer.eos_id
    assert eos is not None
    streams: dict[str, TokenStream] = {}
    counts: dict[str, int] = {}
    for domain in corpora.DOMAINS:
        for split in corpora.SPLITS:
            texts = corpora.texts(domain, split)[:max_docs]
            ids: list[int] = []
            for doc in tokenizer.encode_batch(texts):
                ids.append(eos)  # each document opens after an end-of-text, as at serving time
                ids.extend(doc)
            streams[f"{domain}/{split}"] = np.asarray(ids, dtype=np.int64)
            counts[f"{domain}/{split}"] = len(ids)
    save_streams(streams, folder / "streams.safetensors")
    samples = {
        d: [
            p.text
            for p in corpora.prompts(d, "test", SAMPLE_PROMPTS_PER_DOMAIN, seed=0, max_prompt_chars=600)
        ]
        for d in corpora.DOMAINS
    }
    (folder / "prompts.json").write_text(json.dumps(samples, indent=1))
    report = {
        "tokenizer": {
            "vocab_size": tokenizer.vocab_size,
            "fingerprint": tokenizer.fingerprint,
            "eos_token": tokenizer.eos_token,
        },
        "corpus": corpora.fingerprint()
        if not quick
        else {"python": corpora.fingerprint()["python"], "quick": True},
        "tokens": counts,
        "max_docs_per_split": max_docs,
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    (folder / "done.json").write_text(json.dumps(report, indent=1))
    log(f"[data] {sum(v for k, v in counts.items() if k.endswith('/train')):,} training tokens: {counts}")
    return report


def _write_snapshot(model: Transformer, folder: Path, name: str) -> None:
    """fp16 weights in shards under 15 MiB, so a GPU run cut off by its time limit still returns them."""
    folder.mkdir(parents=True, exist_ok=True)
    shard: dict[str, torch.Tensor] = {}
    size, index = 0, 0
    items = [(k, v) for k, v in model.state_dict().items() if k != "lm_head.weight"]
    for key, value in items:
        t = value.detach().to("cpu", torch.float16).contiguous()
        if shard and size + t.numel() * 2 > SNAPSHOT_SHARD_BYTES:
            save_file(shard, str(folder / f"{name}-{index}.safetensors"))
            shard, size, index = {}, 0, index + 1
        shard[key] = t
        size += t.numel() * 2
    save_file(shard, str(folder / f"{name}-{index}.safetensors"))


def stage_export(
    work: Path,
    out: Path,
    tokenizer: Tokenizer,
    target: Transformer,
    drafter: Transformer,
    streams: dict[str, TokenStream],
    recipe: dict[str, Any],
) -> dict[str, Any]:
    """HF folders in fp16 + MANIFEST.json; everything reported is measured on the reloaded files."""
    out.mkdir(parents=True, exist_ok=True)
    for name in ("target", "generic-drafter"):
        if (out / name).exists():
            shutil.rmtree(out / name)
    save_hf_folder(target, tokenizer, out / "target", dtype=torch.float16)
    save_hf_folder(drafter, tokenizer, out / "generic-drafter", dtype=torch.float16)

    # Reload exactly as the engine and the bench will (fp16 on disk, fp32 compute on CPU).
    cpu = torch.device("cpu")
    target_r, tok_t = load_hf_folder(out / "target")
    drafter_r, tok_d = load_hf_folder(out / "generic-drafter")
    assert tok_t.fingerprint == tok_d.fingerprint == tokenizer.fingerprint
    seq_len = min(256, target_r.config.max_seq_len - 1)
    val_loss: dict[str, dict[str, float]] = {"target": {}, "generic-drafter": {}}
    for domain in corpora.DOMAINS:
        windows = eval_windows(streams[f"{domain}/validation"], seq_len, 16_384)
        val_loss["target"][domain] = round(eval_loss(target_r, windows, cpu), 4)
        val_loss["generic-drafter"][domain] = round(eval_loss(drafter_r, windows, cpu), 4)
    log(f"[export] validation loss (nats/token): {val_loss}")

    prompts = json.loads((work / "data" / "prompts.json").read_text())
    samples: dict[str, list[dict[str, str]]] = {}
    new_tokens = min(SAMPLE_NEW_TOKENS, target_r.config.max_seq_len // 2)
    for domain, texts in prompts.items():
        samples[domain] = []
        for text in texts:
            ids = torch.tensor([tokenizer.encode(text)[-(target_r.config.max_seq_len - new_tokens) :]])
            cont = generate(target_r, ids, new_tokens, cpu)[0, ids.shape[1] :].tolist()
            samples[domain].append({"prompt_tail": text[-300:], "target_greedy": tokenizer.decode(cont)})
    files = {
        str(p.relative_to(out)): sha256_of_file(p)
        for p in sorted(out.rglob("*"))
        if p.is_file() and p.name != "MANIFEST.json"
    }
    manifest = {
        "what": "reference target and generic drafter (distilled on the target's prose continuations only)",
        "built_by": "python -m workers.training.build_reference",
        "files": files,
        "tokenizer_fingerprint": tokenizer.fingerprint,
        "parameters": {"target": target_r.num_params(), "generic-drafter": drafter_r.num_params()},
        "validation_loss_nats_per_token": val_loss,
        "recipe": recipe,
        "samples": samples,
    }
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")
    log(f"[export] wrote {out} ({sum((out / f).stat().st_size for f in files) / 2**20:.1f} MiB)")
    return manifest


def import_target(folder: Path, target_work: Path) -> None:
    """Make a target trained elsewhere (e.g. the GPU run's snapshot) the finished target stage."""
    from safetensors.torch import load_file

    shards = sorted(folder.glob("target-*.safetensors"))
    if not shards:
        raise SystemExit(f"--import-target: no target-*.safetensors in {folder}")
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        state.update({k: v.float() for k, v in load_file(str(shard)).items()})
    target_work.mkdir(parents=True, exist_ok=True)
    save_file(state, str(target_work / "best.safetensors"))
    recipe = json.loads((folder / "target-recipe.json").read_text())
    recipe["imported_from"] = [s.name for s in shards]
    (target_work / "done.json").write_text(json.dumps(recipe, indent=1))
    log(f"[target] imported {len(state)} tensors from {folder}")


# -------------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m workers.training.build_reference",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where the HF folders and MANIFEST.json go")
    p.add_argument("--work", type=Path, default=DEFAULT_WORK, help="data, checkpoints and traces")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--resume", action="store_true", help="reuse finished stages and the latest checkpoints")
    p.add_argument("--quick", action="store_true", help="a very small pair from a sliver of the corpora")
    p.add_argument("--until", choices=STAGES, default="export", help="stop after this stage")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target-steps", type=int)
    p.add_argument("--target-batch", type=int)
    p.add_argument("--target-minutes", type=float, help="wall-time cap on target training (best kept)")
    p.add_argument("--drafter-steps", type=int)
    p.add_argument("--drafter-minutes", type=float)
    p.add_argument("--drafter-loss", choices=("kl", "ce"))
    p.add_argument(
        "--drafter-lr", type=float, help="peak learning rate (lower it to fine-tune --init-drafter)"
    )
    p.add_argument("--drafter-batch", type=int)
    p.add_argument("--drafter-dim", type=int)
    p.add_argument("--drafter-layers", type=int)
    p.add_argument("--trace-sequences", type=int)
    p.add_argument("--snapshot", type=Path, help="also write fp16 weight shards here as training improves")
    p.add_argument(
        "--import-target",
        type=Path,
        help="adopt a target trained elsewhere: a folder of fp16 shards (target-*.safetensors, as --snapshot "
        "writes) plus target-recipe.json describing how it was trained",
    )
    p.add_argument("--init-drafter", type=Path, help="start distillation from these drafter weights")
    p.add_argument(
        "--recipe-note", type=Path, help="a JSON file recorded as recipe['note'] (e.g. a sweep's log)"
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    args = parse_args(argv)
    device = pick_device(args.device)
    setup_threads(device)
    torch.manual_seed(args.seed)
    pre, trace_cfg, dist_cfg, vocab = _configs(args)
    work, out = args.work, args.out
    if not args.resume and work.exists():
        log(f"[build] starting afresh: clearing {work} (pass --resume to continue it)")
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    stage_times: dict[str, float] = {}
    recipe: dict[str, Any] = {
        "seed": args.seed,
        "quick": args.quick,
        "device": device_name(device),
        "python": python_version(),
        "command": " ".join(["python -m workers.training.build_reference", *(argv or sys.argv[1:])]),
    }

    t = time.perf_counter()
    recipe["data"] = stage_data(work, args.quick, vocab, args.resume)
    stage_times["data"] = time.perf_counter() - t
    if args.until == "data":
        return None
    tokenizer = Tokenizer.from_file(work / "data" / "tokenizer.json")
    streams = load_streams(work / "data" / "streams.safetensors")

    if args.import_target:
        import_target(args.import_target, work / "target")
    t = time.perf_counter()
    on_best = (lambda m, _b: _write_snapshot(m, args.snapshot, "target")) if args.snapshot else None
    target, recipe["target"] = train_target(
        pre,
        streams,
        tokenizer.vocab_size,
        work / "target",
        device,
        resume=args.resume or args.import_target is not None,
        on_best=on_best,
    )
    stage_times["target"] = time.perf_counter() - t
    if args.until == "target":
        return None

    t = time.perf_counter()
    trace_file = work / "traces" / "prose.safetensors"
    if args.resume and trace_file.is_file():
        from safetensors.torch import load_file

        traces = {k: v.long() for k, v in load_file(str(trace_file)).items()}
        log(f"[traces] reusing {trace_file}")
    else:
        # Prose only: the generic drafter never sees code or structured traffic.
        traces = make_traces(target, [streams["prose/train"]], trace_cfg, device)
        trace_file.parent.mkdir(parents=True, exist_ok=True)
        save_file({k: v.to(torch.int16) for k, v in traces.items()}, str(trace_file))
    recipe["traces"] = {
        "config": asdict(trace_cfg),
        "domain": "prose",
        "rows": {k: int(v.shape[0]) for k, v in traces.items()},
        "generated_tokens": int(sum(v.shape[0] for v in traces.values()) * trace_cfg.gen_len),
    }
    stage_times["traces"] = time.perf_counter() - t
    if args.until == "traces":
        return None

    t = time.perf_counter()
    prompt_lens = {f"len{n}": n for n in trace_cfg.prompt_lens}
    probes = {d: streams[f"{d}/validation"] for d in corpora.DOMAINS}
    drafter, recipe["drafter"] = distill_drafter(
        dist_cfg,
        target,
        traces,
        prompt_lens,
        tokenizer.vocab_size,
        work / "drafter",
        device,
        probe_streams=probes,
        resume=args.resume,
        init_weights=args.init_drafter,
    )
    recipe["drafter"]["training_data"] = "target continuations of prose prompts (forward KL on target logits)"
    stage_times["drafter"] = time.perf_counter() - t
    if args.snapshot:
        _write_snapshot(drafter, args.snapshot, "drafter")
    if args.until == "drafter":
        return None

    t = time.perf_counter()
    stage_times["export"] = 0.0
    recipe["stage_wall_s"] = {k: round(v, 1) for k, v in stage_times.items()}
    if args.recipe_note:
        recipe["note"] = json.loads(args.recipe_note.read_text())
    recipe["total_wall_s"] = round(time.perf_counter() - t_start, 1)
    manifest = stage_export(work, out, tokenizer, target.float(), drafter.float(), streams, recipe)
    log(f"[build] done in {time.perf_counter() - t_start:.0f}s; export took {time.perf_counter() - t:.0f}s")
    return manifest


if __name__ == "__main__":
    main()
