#!/usr/bin/env bash
# GPU check (issues I and J): the 7B preset (Llama-2-7B shapes) on a 24 GiB card's budget, at most
# 8 minutes on an H200:
#   1. `tierlm plan` for the run's flags (hardware detected, --gpu-memory 24GiB);
#   2. the tiered runtime, --offload-policy auto, 3 steps of 8 micro-batches of 4 x 2048 tokens,
#      GPU allocations capped at 24 GiB (--gpu-memory sets set_per_process_memory_fraction),
#      --host-budget 64GiB, the default precision; no evaluation, checkpoint, export or sample
#      (a 7B checkpoint would not fit the machine's 64 GiB disk): tokens/s, max_memory_allocated,
#      the step's split (compute / transfer wait / update wait), H2D/D2H rates beside a pinned
#      copy measured in the same process, and the planner's prediction (bench/gpu_run.py);
#   3. FSDP2 with CPU offload on the same model and cap, time-boxed, for a side-by-side ratio.
# A markdown table goes to stdout and $OUT/gpu_scale.md. SMOKE=1 runs the same steps with the
# `tiny` preset, 64-token sequences, on the CPU, without the cap (checks the script itself).
# Like bench/gpu_check.sh: the machine's python3 with tierlm from src/, wheels from .whl/ when
# present, logs in $OUT (else /tmp/gpu_scale), exit status 0 when every check passed.
set -uo pipefail
LOGS=${OUT:-/tmp/gpu_scale}
RUNS=/tmp/gpu_scale_runs
SMOKE=${SMOKE:-0}
. "$(dirname "$0")/gpu_common.sh"

if [ "$SMOKE" = 1 ]; then
  MODEL=(--model-size tiny --device cpu --batch-size 2 --seq-len 64 --grad-accum-steps 8
         --data.vocab_size 2048)
  CAP=()
  HOST=(--host-budget 4GiB)
  LIMIT_PLAN=60 LIMIT_TIERED=400 LIMIT_FSDP=300 MB=1 NAME=tiny
else
  MODEL=(--model-size 7b --device cuda --batch-size 4 --seq-len 2048 --grad-accum-steps 8
         --data.vocab_size 32000)
  CAP=(--gpu-memory 24GiB)
  HOST=(--host-budget 64GiB)
  LIMIT_PLAN=40 LIMIT_TIERED=300 LIMIT_FSDP=120 MB=8 NAME=7b
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
fi
"$PY" -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda)"
echo "== free disk (the disk tier writes under $RUNS; a 7B run's state is ~110 GB in all)"
df -h / /tmp "$RUNS" | tee "$LOGS/df.log"
nproc; free -g

"$PY" bench/gpu_run.py corpus "$RUNS/corpus.txt" --megabytes "$MB"
# the held-out split (5%) must hold one batch; evaluation itself is not run
DATA=(--data "$RUNS/corpus.txt" --eval-every 0 --train.eval_batches 1 --train.sample_tokens 0)
RUN=("${MODEL[@]}" "${CAP[@]}" "${HOST[@]}" "${DATA[@]}")

check plan "$LIMIT_PLAN" "$PY" -m tierlm plan "${RUN[@]}" --offload-policy auto
check tiered "$LIMIT_TIERED" "$PY" bench/gpu_run.py run --label "$NAME tiered auto" --steps 3 \
  --json "$LOGS/tiered.json" -- "${RUN[@]}" --offload-policy auto \
  --offload-dir "$RUNS/offload" --out "$RUNS/tiered"
rm -rf "$RUNS/offload"  # the disk tier's files; FSDP needs the space for nothing, but be tidy
failed=()
before=$status  # the FSDP comparison is time-boxed: not finishing is a result, not a failure
if ! check fsdp "$LIMIT_FSDP" "$PY" bench/gpu_run.py run --label "$NAME fsdp2 cpu offload" \
    --steps 3 --json "$LOGS/fsdp.json" -- "${MODEL[@]}" "${CAP[@]}" "${DATA[@]}" \
    --backend fsdp --distributed.fsdp_cpu_offload --out "$RUNS/fsdp"; then
  failed+=("$NAME fsdp2 cpu offload=not within ${LIMIT_FSDP} s or failed (fsdp.log)")
  status=$before
fi

echo "== table"
"$PY" bench/gpu_run.py table "$LOGS/tiered.json" "$LOGS/fsdp.json" --failed "${failed[@]}" \
  | tee "$LOGS/gpu_scale.md"
"$PY" - "$LOGS/tiered.json" "$LOGS/fsdp.json" <<'PY' | tee -a "$LOGS/gpu_scale.md"
import json, sys
from pathlib import Path
runs = [json.loads(Path(f).read_text()) for f in sys.argv[1:] if Path(f).is_file()]
if len(runs) == 2 and all(r.get("tokens_per_s") for r in runs):
    print(f"\ntiered / FSDP2-offload tokens/s: {runs[0]['tokens_per_s'] / runs[1]['tokens_per_s']:.2f}x")
t = runs[0] if runs else {}
if t.get("predicted_times_s"):
    print("predicted split (s): " + ", ".join(f"{k} {v:.2f}" for k, v in t["predicted_times_s"].items()))
PY
exit $status
