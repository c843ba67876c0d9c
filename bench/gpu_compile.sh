#!/usr/bin/env bash
# GPU check (issue O): `1b` eager against --compile segments, fp32, seq 2048, at most 8 minutes
# on an H200. bench/compile.py builds an eager and a compiled stepper from the same weights and
# interleaves their steps: the reference trainer (the whole model on the GPU) and the tiered
# runtime with every block streamed from host RAM (full recompute). Per row: tokens/s, the first
# step's compile time apart, max_memory_allocated a step adds, graphs compiled, the loss
# difference. The CUDA allocator's reserved bytes and retries per step come from a short
# `tierlm train` of each mode (metrics.jsonl: cuda_reserved_bytes, cuda_alloc_retries).
# PRECISION=bf16: all of it in bf16 (what `auto` gives a compiled run on a GPU; the loss column
# is then compiled bf16 against eager bf16); a separate run, each fits one 10-minute call.
# SMOKE=1: the `tiny` preset, 64-token sequences, on the CPU (checks the script itself).
# Like bench/gpu_check.sh: the machine's python3 with tierlm from src/, wheels from .whl/ when
# present, logs in $OUT (else /tmp/gpu_compile), exit status 0 when every check passed.
set -uo pipefail
LOGS=${OUT:-/tmp/gpu_compile}
RUNS=/tmp/gpu_compile_runs
SMOKE=${SMOKE:-0}
PRECISION=${PRECISION:-fp32}
. "$(dirname "$0")/gpu_common.sh"
export TORCHINDUCTOR_CACHE_DIR="$RUNS/inductor"

if [ "$SMOKE" = 1 ]; then
  SIZE=tiny; SHAPE=(--seq-len 64 --batch-size 2); DEVICE=cpu; TRAIN=(--data.vocab_size 2048)
else
  SIZE=1b; SHAPE=(--seq-len 2048 --batch-size 1); DEVICE=cuda; TRAIN=(--data.vocab_size 32000)
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
fi
check compile_bench 300 "$PY" bench/compile.py --sizes "$SIZE" --steps 5 "${SHAPE[@]}" \
  --device "$DEVICE" --cache-dir "$RUNS/inductor" --precision "$PRECISION"
"$PY" bench/gpu_run.py corpus "$RUNS/corpus.txt" --megabytes 1
for mode in off segments; do  # the inductor cache is warm from the bench by now
  check "train_$mode" 120 "$PY" -m tierlm train --model-size "$SIZE" "${SHAPE[@]}" "${TRAIN[@]}" \
    --device "$DEVICE" --precision "$PRECISION" --offload-policy host --grad-checkpointing full \
    --compile "$mode" --max-steps 20 --data "$RUNS/corpus.txt" --eval-every 0 \
    --train.eval_batches 1 --train.sample_tokens 0 --out "$RUNS/train_$mode"
  "$PY" - "$RUNS/train_$mode/metrics.jsonl" "$mode" <<'PYEOF' | tee -a "$LOGS/allocator.md"
import json, sys
recs = [json.loads(line) for line in open(sys.argv[1]) if '"loss"' in line]
last = recs[-1]
print(f"| {sys.argv[2]} | {max(r['tokens_per_s'] for r in recs[1:]):.0f} "
      f"| {(last.get('cuda_max_allocated_bytes') or 0) / 2**30:.2f} "
      f"| {(last.get('cuda_max_reserved_bytes') or 0) / 2**30:.2f} "
      f"| {last.get('cuda_alloc_retries')} |")
PYEOF
done
echo "(compile | tokens/s | max allocated GiB | max reserved GiB | allocator retries)"
exit $status
