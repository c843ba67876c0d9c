# Sourced by the GPU scripts (gpu_check.sh, gpu_scale.sh, gpu_runtime.sh) after they set LOGS
# (where logs go) and RUNS (a scratch folder, emptied): the machine's own python3 (its CUDA
# build of torch) with tierlm from src/, packages that machine lacks as wheels from .whl/ when
# that folder exists, and `check`, which runs one step under a time limit and clears `status`
# (the script's exit status) when it fails.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PY:-python3}
mkdir -p "$LOGS"
rm -f "$LOGS"/*.json
rm -rf "$RUNS"
mkdir -p "$RUNS"
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0

check() {  # check NAME SECONDS COMMAND...: run under a time limit, logged to $LOGS/NAME.log
  local name=$1 limit=$2
  shift 2
  echo "== $name"
  local t0=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee "$LOGS/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc after $((SECONDS - t0)) s"
  [ "$rc" -eq 0 ] || status=1
  return "$rc"
}
