#!/usr/bin/env bash
# GPU check (issue J): the runtime's measured step against the planner's prediction, at most
# 6 minutes on an H200. The 1b preset with GPU allocations capped at 8 GiB and the 3b preset at
# 24 GiB (--gpu-memory sets set_per_process_memory_fraction; the device tier gets the cap less
# 1 GiB for the CUDA context and workspace), 8 micro-batches of 4 x 1024 tokens, state in host
# RAM (--offload-policy host), full recompute, under both --microbatch-order values
# (layer-outer parks the boundary activations in host RAM). Per run (bench/gpu_run.py): measured
# vs predicted step time, bytes per link (the ledger's last step vs the plan's), the step's split
# (compute / transfer wait / update wait), max_memory_allocated; a markdown table on stdout and
# in $OUT/gpu_runtime.md. SMOKE=1 runs the same steps with the `tiny` preset, 64-token
# sequences, on the CPU, without the cap (checks the script itself).
# Like bench/gpu_check.sh: the machine's python3 with tierlm from src/, wheels from .whl/ when
# present, logs in $OUT (else /tmp/gpu_runtime), exit status 0 when every check passed.
set -uo pipefail
LOGS=${OUT:-/tmp/gpu_runtime}
RUNS=/tmp/gpu_runtime_runs
SMOKE=${SMOKE:-0}
. "$(dirname "$0")/gpu_common.sh"

if [ "$SMOKE" = 1 ]; then
  CASES=("tiny::300" "small::300")  # size:cap GiB (empty: no cap):seconds per run
  SHAPE=(--device cpu --batch-size 2 --seq-len 64 --data.vocab_size 2048)
  MB=1
else
  CASES=("1b:8:70" "3b:24:105")  # 2 x (70 + 105) s: within 6 minutes with the set-up
  SHAPE=(--device cuda --batch-size 4 --seq-len 1024 --data.vocab_size 32000)
  MB=8
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
fi
"$PY" bench/gpu_run.py corpus "$RUNS/corpus.txt" --megabytes "$MB"
COMMON=("${SHAPE[@]}" --grad-accum-steps 8 --offload-policy host --grad-checkpointing full
        --data "$RUNS/corpus.txt" --eval-every 0 --train.eval_batches 1
        --train.sample_tokens 0)

jsons=()
for case in "${CASES[@]}"; do
  IFS=: read -r size cap limit <<<"$case"
  budget=()
  [ -n "$cap" ] && budget=(--gpu-memory "${cap}GiB" --device-budget "$((cap - 1))GiB")
  for order in microbatch-outer layer-outer; do
    extra=()
    [ "$order" = layer-outer ] && extra=(--boundary-activations host)
    name="${size}-${cap:-nocap}-${order}"
    check "$name" "$limit" "$PY" bench/gpu_run.py run --label "$size ${cap:+${cap} GiB }$order" \
      --steps 3 --json "$LOGS/$name.json" -- --model-size "$size" "${COMMON[@]}" "${budget[@]}" \
      --microbatch-order "$order" "${extra[@]}" --out "$RUNS/$name"
    jsons+=("$LOGS/$name.json")
  done
done

echo "== table"
"$PY" bench/gpu_run.py table "${jsons[@]}" | tee "$LOGS/gpu_runtime.md"
"$PY" - "${jsons[@]}" <<'PY' | tee -a "$LOGS/gpu_runtime.md"
import json, sys
from pathlib import Path
print("\n| run | measured / predicted step | H2D measured / predicted | D2H measured / predicted |"
      " predicted split (s) |")
print("| --- | --- | --- | --- | --- |")
for f in sys.argv[1:]:
    if not Path(f).is_file():
        continue
    r = json.loads(Path(f).read_text())
    moved = r.get("predicted_moved_bytes") or {}
    def ratio(a, b):
        return f"{a / b:.2f}x" if a and b else "-"
    split = ", ".join(f"{k} {v:.2f}" for k, v in (r.get("predicted_times_s") or {}).items())
    print(f"| {r['label']} | {ratio(r['step_s'], r.get('predicted_step_s'))} | "
          f"{ratio(r['h2d_bytes'], moved.get('h2d'))} | {ratio(r['d2h_bytes'], moved.get('d2h'))} "
          f"| {split} |")
PY
exit $status
