#!/usr/bin/env bash
# One-shot reference build on a single CUDA machine (the way the committed weights were made).
#
#   OUT=/some/dir bash workers/training/gpu_build.sh
#
# Expects the data stage already built here (var/reference-build/data: tokenizer + token streams),
# because the corpora are read from the local interpreter's stdlib and the GPU machine runs another
# Python. Steps: a fast CUDA smoke build; three target runs with different step budgets side by side
# on the one GPU (the corpus is small, so the right number of epochs is not known in advance: each run
# keeps its best validation weights and the best run wins); prose traces from the winner; two generic
# drafter sizes distilled side by side; export. Outputs come back through $OUT as a split tar, fp16
# snapshots of the middle target run (so a run cut off by its time limit still returns weights) and
# one log. Variables: TARGET_STEPS, TARGET_MIN, DRAFTER_MIN, EXTRA (extra build_reference arguments,
# e.g. "--quick --device cpu" for a dry run), DEVICE.
set -u -o pipefail
: "${OUT:?set OUT to the folder to write results into}"
DEVICE=${DEVICE:-cuda}
TARGET_STEPS=${TARGET_STEPS:-"1200 3000 7000"}
TARGET_MIN=${TARGET_MIN:-4.3}
DRAFTER_MIN=${DRAFTER_MIN:-1.5}
EXTRA=${EXTRA:-}
PY=${PY:-python3}
W=${W:-/tmp/refbuild}
LOG=$OUT/log.txt
export PYTHONUNBUFFERED=1
mkdir -p "$OUT" "$W"
build() { $PY -m workers.training.build_reference --device "$DEVICE" --resume $EXTRA "$@"; }
say() { echo "[gpu_build $(date +%H:%M:%S)] $*" | tee -a "$LOG"; }

say "start; $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || echo no-gpu)"
$PY -c "import sys, torch, tokenizers, safetensors; print(sys.version.split()[0], torch.__version__, \
tokenizers.__version__, safetensors.__version__, torch.cuda.is_available())" 2>&1 | tee -a "$LOG"
test -f var/reference-build/data/done.json || { say "no var/reference-build/data: run --until data first"; exit 2; }

# 1. Smoke: every stage on a tiny model, so a CUDA-only failure shows in seconds, not minutes.
if ! $PY -m workers.training.build_reference --quick --device "$DEVICE" --work "$W/smoke/work" \
    --out "$W/smoke/out" >>"$LOG" 2>&1; then
  say "smoke build failed"; tail -40 "$LOG"; exit 3
fi
say "smoke build ok"

# 2. Target runs side by side, each capped in wall time (best validation weights kept).
for S in $TARGET_STEPS; do
  mkdir -p "$W/s$S" && cp -r var/reference-build/data "$W/s$S/"
  snap=()
  [ "$S" = "$(echo $TARGET_STEPS | cut -d' ' -f2)" ] && snap=(--snapshot "$OUT/snap")
  (build --work "$W/s$S" --until target --target-steps "$S" --target-minutes "$TARGET_MIN" "${snap[@]}" 2>&1 \
    | sed -u "s/^/[s$S] /" >>"$LOG") &
done
wait
say "target runs finished"

# 3. Pick the run with the lowest mean validation loss; record every run's outcome in the recipe.
BEST=$($PY - "$W" $TARGET_STEPS <<'EOF'
import json, sys
from pathlib import Path
w, runs = Path(sys.argv[1]), sys.argv[2:]
table = {}
for s in runs:
    f = w / f"s{s}" / "target" / "done.json"
    if f.is_file():
        r = json.loads(f.read_text())
        table[f"s{s}"] = {"planned_steps": int(s), "steps_run": r["steps_run"], "tokens_seen": r["tokens_seen"],
                          "wall_s": r["wall_s"], "best": r["best"], "stopped_early": r["stopped_early"]}
best = min(table, key=lambda k: table[k]["best"]["mean"])
note = {"target_selection": "three target runs with different step budgets trained side by side on one GPU; "
        "the one with the lowest mean validation loss over domains was kept", "runs": table, "chosen": best}
(w / "sweep.json").write_text(json.dumps(note, indent=1))
print(w / best)
EOF
) || { say "no target run finished"; exit 4; }
say "best target run: $BEST"; cat "$W/sweep.json" >>"$LOG"

# 4. Prose traces once, then two drafter sizes side by side (d128x2 is the reference; d160x2 a spare).
build --work "$BEST" --until traces 2>&1 | sed -u "s/^/[traces] /" >>"$LOG"
cp -r "$BEST" "$W/b2"
(build --work "$BEST" --out "$W/ref/A" --drafter-minutes "$DRAFTER_MIN" --snapshot "$OUT/snap" \
  --recipe-note "$W/sweep.json" 2>&1 | sed -u "s/^/[A] /" >>"$LOG") &
(build --work "$W/b2" --out "$W/ref/B" --drafter-minutes "$DRAFTER_MIN" --drafter-dim 160 \
  --recipe-note "$W/sweep.json" 2>&1 | sed -u "s/^/[B] /" >>"$LOG") &
wait
say "drafters and export finished"

# 5. Ship: one tar in parts under 16 MiB (the target alone is ~24 MB in fp16).
(cd "$W/ref" && tar cf - A B/generic-drafter B/MANIFEST.json) | split -b 15M - "$OUT/ref.tar.part-"
ls -la "$OUT" "$OUT/snap" | tee -a "$LOG"
say "done"
