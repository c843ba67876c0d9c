#!/usr/bin/env bash
# GPU check (issue M): one long sequence on one GPU through the long-sequence path, with the
# defaults a user would have: `1b` at seq 32768, batch 1, `--precision auto`, the card capped
# at 24 GiB (--gpu-memory, torch.cuda.set_per_process_memory_fraction), `--offload-policy auto`
# and `--grad-checkpointing dynamic` (boundary activations parked on the host, the fused
# attention kernel, the chunked loss). First what `tierlm plan` predicts for it, then 6 steps of
# `tierlm train`; the table: measured tokens/s and torch.cuda.max_memory_allocated against the
# plan's device total and tokens/s. At most 8 minutes on an H200.
# SMOKE=1: the `tiny` preset at seq 1024 on the CPU (checks the script itself).
# Like bench/gpu_check.sh: the machine's python3 with tierlm from src/, wheels from .whl/ when
# present, logs in $OUT (else /tmp/gpu_long_context), exit status 0 when every check passed.
set -uo pipefail
LOGS=${OUT:-/tmp/gpu_long_context}
RUNS=/tmp/gpu_long_context_runs
SMOKE=${SMOKE:-0}
. "$(dirname "$0")/gpu_common.sh"

if [ "$SMOKE" = 1 ]; then
  SIZE=tiny; SEQ=1024; DEVICE=cpu; HW=(--hardware cpu); CAP=(); VOCAB=2048
else
  SIZE=1b; SEQ=32768; DEVICE=cuda; HW=(--hardware auto); CAP=(--gpu-memory 24GiB); VOCAB=32000
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
fi
COMMON=(--model-size "$SIZE" --seq-len "$SEQ" --batch-size 1 --grad-accum-steps 1
        --offload-policy auto --grad-checkpointing dynamic "${CAP[@]}")
check plan 120 "$PY" -m tierlm plan "${COMMON[@]}" "${HW[@]}" --json
"$PY" bench/gpu_run.py corpus "$RUNS/corpus.txt" --megabytes 2
check train 420 "$PY" -m tierlm train "${COMMON[@]}" --device "$DEVICE" \
  --data.vocab_size "$VOCAB" --max-steps 6 --data "$RUNS/corpus.txt" --eval-every 0 \
  --train.eval_batches 1 --train.sample_tokens 0 --out "$RUNS/train"
"$PY" - "$LOGS/plan.log" "$RUNS/train/metrics.jsonl" "$SEQ" <<'PYEOF' | tee -a "$LOGS/long_context.md"
import json, sys
text = open(sys.argv[1]).read()
plan = json.JSONDecoder().raw_decode(text[text.index("{"):])[0]
recs = [json.loads(line) for line in open(sys.argv[2]) if '"loss"' in line]
steady = recs[1:] or recs
tok = sorted(r["tokens_per_s"] for r in steady)[len(steady) // 2]
alloc = max((r.get("cuda_max_allocated_bytes") or 0) for r in recs) / 2**30
print("| seq | measured tokens/s (median) | planned tokens/s | measured max allocated GiB "
      "| planned device total GiB |")
print("|---|---|---|---|---|")
print(f"| {sys.argv[3]} | {tok:.0f} | {plan.get('tokens_per_s', 0):.0f} "
      f"| {alloc:.2f} | {plan.get('device_total_bytes', 0) / 2**30:.2f} |")
PYEOF
exit $status
