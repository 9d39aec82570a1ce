"""GPU check: one realignment and one shadow replay of the reference pair on a CUDA device, in bf16.

For a machine with a GPU; nothing new is built. The committed reference target and generic drafter
load once onto the first GPU in bfloat16 (the target through the worker's process cache,
``workers.model_cache.TARGETS``, as a worker loads it). The traffic is ``bench/realign.py``'s
prose -> code shift (its helpers: the target's own greedy continuations of validation-split
prompts, generated here on the GPU and not timed, and not written to its CPU trace cache, whose
traces are float32 ones). Then, as a worker does it:

- ``workers.training.realign.realign`` from the generic drafter, on the GPU: the target's top-K
  pass under bf16 autocast, the drafter trained with float32 master weights under bf16 autocast;
- ``workers.canary.replay.shadow_replay`` of held-out test-split prompts of the shifted domain
  through no speculation, the generic drafter and the realigned one (both bf16), greedy, batch
  size 1, k = 4, with the lossless check on every arm.

Printed and written to bench/results/gpu_check.json: the device's name; teacher tokens/s (row
tokens through the target / seconds of the target pass); train tokens/s (completion tokens
trained on / seconds of the training phase, realign's own figure); replay tokens/s per arm (output
tokens / request time, time to first token included); peak GPU memory of the realignment and of
the replay (``torch.cuda.max_memory_allocated``); held-out hit rate before/after (the generic and
the realigned drafter's hit rate in the replay, with realign's held-out greedy agreement beside
it). Exit status 1 when an arm's output is not lossless.

Without a GPU it prints that none was found and nothing was measured, writes
``{"skipped": "no CUDA device"}`` and exits 0. On one H200 the whole check takes about a minute
(the realignment's time budget, 90 s by default, is its ceiling).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

RESULTS = ROOT / "bench" / "results"
OUT = RESULTS / "gpu_check.json"
# The shift replayed: code requests run to their length, so the replay needs no stop strings (the
# structured domain's one-line answers would need a client's stop string, which the replay lacks).
DOMAIN = "code"
LABELS = {"baseline": "no speculation", "incumbent": "generic drafter", "candidate": "realigned drafter"}


def _write(out: dict[str, Any]) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(out, indent=1) + "\n")


def _mib(n_bytes: int) -> float:
    return round(n_bytes / 2**20, 1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shifted-traces", type=int, default=384)
    parser.add_argument("--prose-traces", type=int, default=128)
    parser.add_argument("--trace-tokens", type=int, default=128)
    parser.add_argument("--eval-prompts", type=int, default=24)
    parser.add_argument("--eval-tokens", type=int, default=96)
    parser.add_argument("--time-budget-s", type=float, default=90.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    if not torch.cuda.is_available():
        print(f"no CUDA device found (torch {torch.__version__}): nothing was measured; wrote {OUT}")
        _write({"skipped": "no CUDA device"})
        return 0

    # Imported only with a GPU: the corpora and engine are not needed to say there is none.
    from bench.realign import K, eval_prompts, make_traces
    from workers.canary.replay import shadow_replay
    from workers.devices import resolve_device, weights_dtype
    from workers.engine.hf_io import load_hf_folder
    from workers.model_cache import TARGETS
    from workers.training.realign import RealignConfig, realign

    started = time.perf_counter()
    device = resolve_device("cuda")
    dtype = weights_dtype(device)
    name = torch.cuda.get_device_name(device)
    reference = ROOT / "workers" / "models" / "reference"
    manifest = json.loads((reference / "MANIFEST.json").read_text())
    target_folder = reference / "target"
    target, tokenizer = TARGETS.get(
        target_folder,
        identity=manifest["files"]["target/model.safetensors"],
        device=device,
        dtype=dtype,
        loader=lambda: load_hf_folder(target_folder, device=device, dtype=dtype),
    )
    generic, _ = load_hf_folder(reference / "generic-drafter", device=device, dtype=dtype)
    print(f"{name}: target and generic drafter loaded in {dtype} ({time.perf_counter() - started:.1f}s)")

    # bench/realign.py's helpers build their prompt tensors without a device: the GPU as the default
    # device puts them beside the weights. Not written to its trace cache (those are float32 traces).
    t0 = time.perf_counter()
    with device:
        shifted = make_traces(
            target, tokenizer, DOMAIN, args.shifted_traces, args.trace_tokens, args.seed, cache=False
        )
        prose = make_traces(
            target, tokenizer, "prose", args.prose_traces, args.trace_tokens, args.seed, cache=False
        )
    trace_s = time.perf_counter() - t0
    print(f"traces: {len(shifted)} {DOMAIN}, {len(prose)} prose ({trace_s:.1f}s, not timed)")

    cfg = RealignConfig(seed=args.seed, time_budget_s=args.time_budget_s, teacher="topk", device=str(device))
    result = realign(target, generic, tokenizer, shifted, prose, cfg)
    m = result.metrics
    print(
        f"realigned: {m['steps_run']} steps ({m['stop_reason']}), teacher {m['teacher_s']:.1f}s, "
        f"training {m['train_s']:.1f}s"
    )

    candidate = copy.deepcopy(result.model).to(dtype).eval()  # served in the target's precision
    prompts = eval_prompts(tokenizer, DOMAIN, args.eval_prompts)
    torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    replay = shadow_replay(
        target,
        tokenizer,
        {"baseline": None, "incumbent": generic, "candidate": candidate},
        prompts,
        K,
        args.eval_tokens,
        stop_at_eos=False,
    )
    replay_s = time.perf_counter() - t0
    replay_peak = torch.cuda.max_memory_allocated(device)
    arms = replay.arms
    hit_before, hit_after = arms["incumbent"].hit_rate, arms["candidate"].hit_rate
    agree_before = m["held_out_before"]["greedy_agreement"]
    agree_after = m["held_out_after"]["greedy_agreement"]
    out: dict[str, Any] = {
        "device": name,
        "torch": torch.__version__,
        "dtype": str(dtype),
        "domain": DOMAIN,
        "k": K,
        "teacher_tokens_per_s": m["teacher_tokens_per_s"],
        "train_tokens_per_s": m["train_tokens_per_s"],
        "replay_tokens_per_s": {arm: round(report.tokens_per_s, 1) for arm, report in arms.items()},
        "replay_decode_tokens_per_s": {
            arm: round(report.decode_tokens_per_s, 1) for arm, report in arms.items()
        },
        "peak_gpu_memory_mb": {"realign": m.get("peak_gpu_memory_mb"), "replay": _mib(replay_peak)},
        "held_out_hit_rate": {"before": hit_before, "after": hit_after},
        "held_out_greedy_agreement": {"before": agree_before, "after": agree_after},
        "broken_arms": {arm: arms[arm].broken for arm in replay.broken_arms},
        "speedup_over_no_speculation": {
            arm: round(replay.speedup(arm, "baseline"), 3) for arm in ("incumbent", "candidate")
        },
        "realign": {k: v for k, v in m.items() if k not in ("history", "config")},
        "traces": {"shifted": len(shifted), "prose": len(prose), "generation_s": round(trace_s, 1)},
        "replay": {"prompts": len(prompts), "new_tokens": args.eval_tokens, "wall_s": round(replay_s, 1)},
        "wall_s": round(time.perf_counter() - started, 1),
        "definitions": {
            "teacher_tokens_per_s": m["teacher_throughput_definition"],
            "train_tokens_per_s": m["throughput_definition"],
            "replay_tokens_per_s": "output tokens / request time (time to first token included), "
            "summed over prompts, batch size 1, greedy",
            "held_out_hit_rate": "accepted / drafted draft tokens in the replay of test-split prompts",
        },
    }
    _write(out)

    rows = [
        ("device", name),
        ("teacher tokens/s", f"{m['teacher_tokens_per_s']:,.0f}"),
        ("train tokens/s", f"{m['train_tokens_per_s']:,.0f}"),
        *((f"replay tokens/s, {LABELS[arm]}", f"{arms[arm].tokens_per_s:,.1f}") for arm in arms),
        ("peak GPU memory, realignment", f"{m.get('peak_gpu_memory_mb', 0):,.1f} MiB"),
        ("peak GPU memory, replay", f"{_mib(replay_peak):,.1f} MiB"),
        ("held-out hit rate before -> after", f"{hit_before or 0:.1%} -> {hit_after or 0:.1%}"),
        ("held-out greedy agreement before -> after", f"{agree_before:.3f} -> {agree_after:.3f}"),
        ("lossless", "yes" if not replay.broken_arms else f"NO: {', '.join(replay.broken_arms)}"),
        ("wall", f"{out['wall_s']:.0f}s"),
    ]
    width = max(len(label) for label, _ in rows)
    print()
    for label, value in rows:
        print(f"{label:<{width}}  {value}")
    print(f"wrote {OUT}")
    for arm in replay.broken_arms:
        print(f"{arm}: {arms[arm].broken}")
    return 1 if replay.broken_arms else 0


if __name__ == "__main__":
    sys.exit(main())
