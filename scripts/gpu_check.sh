#!/usr/bin/env bash
# distca GPU check: one machine, one CUDA GPU, under 8 minutes, nothing downloaded (docs/guides/gpu.md).
#
#   bash scripts/gpu_check.sh                    # results in $OUT, else outputs/gpu_check/<timestamp>
#   bash scripts/gpu_check.sh --out DIR          # results in DIR
#   bash scripts/gpu_check.sh --dry-run          # print the stage commands, run nothing
#   bash scripts/gpu_check.sh --prepare-wheels   # on a machine WITH internet: fetch the trainer's
#                                                # missing pure-Python wheels into .gpu_check_wheels/
#
# Stages (each with its own time limit; a failing stage is recorded and the next one runs). Every
# stage but deps is a pytest run: `tests` the CUDA tests of the suite, the others the tests of
# tests/test_gpu.py named test_<stage>_*, which record their results as JSON in the results folder.
#   deps       packages missing? install them from .gpu_check_wheels/ (local files only)
#   env        env.json: GPU, driver, torch/CUDA/NCCL, flash-attn or not, the attention backend
#   tests      the suite's CUDA tests (pytest -m cuda tests) -> pytest_junit.xml
#   op         distca.core_attention on the GPU vs attention per document, NCCL group of 1 (the default
#              in-place path and, through a test hook, NCCL all-to-alls; no host sync per layer) -> op_check.json
#   bench      fused-shard kernel efficiency vs shard size -> kernel_bench.json
#   calibrate  the CA cost model for this GPU -> cost_<gpu>.json, calibration.json
#   train      torchtitan smoke run, 1 GPU, CAD on (train_configs/debug_gpu.toml) -> train_smoke.json
#   summary    scripts/gpu_check_report.py: summary.json (every stage's status, time and headline
#              numbers), pytest.json (every test's outcome), kernel_efficiency.png, calibration.png
# Logs: logs/<stage>.log. Exit status: 0 all stages ok, 1 some stage failed, timed out or was
# skipped for a missing package, 2 no CUDA GPU visible (nothing run), 64 bad arguments.
#
# Environment: PYTHON (interpreter; default the first of .venv/bin/python, python3, python whose
# torch sees a GPU), GPU_CHECK_OUT (= --out), GPU_CHECK_DRY_RUN=1 (= --dry-run),
# GPU_CHECK_STAGES (= --stages, comma list), GPU_CHECK_BUDGET (total seconds, default 450),
# GPU_CHECK_WHEELS (wheel folder, default .gpu_check_wheels), GPU_CHECK_PACK (0/1: pack results
# into gpu_check.tar.gz plus headline files; default 1 when the folder is $OUT),
# GPU_CHECK_TRAIN_ARGS (extra trainer flags, e.g. "--training.steps 50 --compile.enable").
set -u -o pipefail

CALLER_PWD=$PWD
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO" || exit 1

usage() { sed -n '2,/^set -u/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; }

DRY=${GPU_CHECK_DRY_RUN:-0}
OUT_DIR=${GPU_CHECK_OUT:-}
STAGES=${GPU_CHECK_STAGES:-all}
BUDGET=${GPU_CHECK_BUDGET:-450}
WHEELS=${GPU_CHECK_WHEELS:-$REPO/.gpu_check_wheels}
PACK=${GPU_CHECK_PACK:-auto}
TRAIN_EXTRA=${GPU_CHECK_TRAIN_ARGS:-}
PREPARE=0
while [ $# -gt 0 ]; do
  case $1 in
    --dry-run) DRY=1 ;;
    --out) [ $# -ge 2 ] || { echo "gpu_check: --out needs a folder" >&2; exit 64; }; OUT_DIR=$2; shift ;;
    --out=*) OUT_DIR=${1#--out=} ;;
    --stages) [ $# -ge 2 ] || { echo "gpu_check: --stages needs a list" >&2; exit 64; }; STAGES=$2; shift ;;
    --stages=*) STAGES=${1#--stages=} ;;
    --budget) [ $# -ge 2 ] || { echo "gpu_check: --budget needs seconds" >&2; exit 64; }; BUDGET=$2; shift ;;
    --pack) PACK=1 ;;
    --no-pack) PACK=0 ;;
    --prepare-wheels) PREPARE=1 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gpu_check: unknown argument '$1' (see --help)" >&2; exit 64 ;;
  esac
  shift
done
case $BUDGET in ''|*[!0-9]*) echo "gpu_check: --budget must be whole seconds, got '$BUDGET'" >&2; exit 64 ;; esac
# Relative paths given by the caller are the caller's, not the repository's.
case ${PYTHON:-} in ''|/*) ;; */*) PYTHON=$CALLER_PWD/$PYTHON ;; esac
case $WHEELS in /*) ;; *) WHEELS=$CALLER_PWD/$WHEELS ;; esac

# Pure-Python packages the torchtitan trainer and the tests need beyond a CUDA PyTorch image (torch,
# numpy, pyarrow, pandas, tokenizers, tensorboard, einops, fsspec, huggingface_hub, matplotlib are
# expected there; pytest usually is, and comes along in case). Versions: the CPU set-up's (Makefile).
WHEEL_SPECS="torchtitan==0.2.2 tyro==1.0.17 docstring_parser==0.18.0 typeguard==4.6.1 torchdata==0.11.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 hypothesis==6.170.17 sortedcontainers==2.4.0 pytest==9.2.0 iniconfig==2.3.1 pluggy==1.7.0 packaging==26.4 pygments==2.21.0"
TRAIN_MODULES="torchtitan tyro torchdata datasets tokenizers"
TEST_MODULES="pytest hypothesis"

if [ "$PREPARE" = 1 ]; then
  PYV=${GPU_CHECK_WHEELS_PY:-3.12}
  cmd=("${PYTHON:-python3}" -m pip download --no-deps --only-binary=:all: --python-version "$PYV"
       --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d "$WHEELS" $WHEEL_SPECS)
  if [ "$DRY" = 1 ]; then printf '+ prepare-wheels cmd=%s\n' "$(printf '%q ' "${cmd[@]}")"; exit 0; fi
  mkdir -p "$WHEELS" && "${cmd[@]}" || exit 1
  echo "gpu_check: wheels for Python $PYV in $WHEELS ($(du -sh "$WHEELS" | cut -f1)); take this folder along to the GPU machine"
  exit 0
fi

# ---- output folder ------------------------------------------------------------------------------
if [ -z "$OUT_DIR" ]; then
  if [ -n "${OUT:-}" ]; then
    OUT_DIR=$OUT
    [ "$PACK" = auto ] && PACK=1
  else
    OUT_DIR=$REPO/outputs/gpu_check/$(date +%Y%m%d-%H%M%S)
  fi
fi
[ "$PACK" = auto ] && PACK=0
case $OUT_DIR in /*) ;; *) OUT_DIR=$CALLER_PWD/$OUT_DIR ;; esac

T0=$(date +%s)
log() { echo "[gpu_check $(( $(date +%s) - T0 ))s] $*"; }

# ---- the interpreter: PYTHON, else the first candidate whose torch sees a GPU ---------------------
PROBE='import json, sys
try:
    import torch
except Exception as e:
    print(f"no torch ({type(e).__name__}: {e})"); sys.exit(3)
ok = torch.cuda.is_available()
n = torch.cuda.device_count() if ok else 0
print(f"torch {torch.__version__}, CUDA build {torch.version.cuda}, GPUs visible: {n}" + ("" if torch.version.cuda else " (a CPU-only build of torch)"))
sys.exit(0 if ok else 1)'
if [ -n "${PYTHON:-}" ]; then CANDIDATES=("$PYTHON"); else CANDIDATES=("$REPO/.venv/bin/python" python3 python); fi
PY=
if [ "$DRY" = 1 ]; then
  for c in "${CANDIDATES[@]}"; do if command -v "$c" >/dev/null 2>&1; then PY=$c; break; fi; done
  PY=${PY:-python3}
else
  REPORT=
  for c in "${CANDIDATES[@]}"; do
    if ! command -v "$c" >/dev/null 2>&1; then REPORT+="  $c: not found"$'\n'; continue; fi
    msg=$(timeout 120 "$c" -c "$PROBE" 2>&1); rc=$?
    REPORT+="  $c: $(echo "$msg" | tail -n 1)"$'\n'
    if [ $rc = 0 ]; then PY=$c; break; fi
  done
  if [ -z "$PY" ]; then
    {
      echo "gpu_check: no CUDA GPU is visible to Python, so nothing was run."
      printf '%s' "$REPORT"
      if command -v nvidia-smi >/dev/null 2>&1; then
        echo "  nvidia-smi: $(nvidia-smi -L 2>&1 | head -n 2 | tr '\n' ' ')"
      else
        echo "  nvidia-smi: not found (no NVIDIA driver on this machine)"
      fi
      echo "Run it on a machine with an NVIDIA GPU and a CUDA build of PyTorch; PYTHON=/path/to/python picks the interpreter."
    } >&2
    mkdir -p "$OUT_DIR" 2>/dev/null && printf '{\n  "ok": false,\n  "reason": "no CUDA GPU visible to Python"\n}\n' >"$OUT_DIR/summary.json"
    exit 2
  fi
  log "python: $PY ($(echo "$REPORT" | grep -F "  $PY:" | tail -n 1 | sed 's/^[^:]*: //'))"
fi

# ---- where results go -----------------------------------------------------------------------------
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
if [ "$PACK" = 1 ]; then RES=$WORK/results; else RES=$OUT_DIR; fi
if [ "$DRY" != 1 ]; then
  mkdir -p "$RES/logs" "$OUT_DIR" || exit 1
  printf 'stage\tstatus\trc\tseconds\ttimeout_s\tnote\n' >"$RES/stages.tsv"
  log "results: $OUT_DIR$([ "$PACK" = 1 ] && echo " (packed into gpu_check.tar.gz)")"
fi
trap 'rm -rf "$WORK"' EXIT

export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export MPLBACKEND=Agg PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
[ "$DRY" = 1 ] && printf '+ env PYTHONPATH=%s MPLBACKEND=Agg\n+ python %s\n+ out %s\n' "$PYTHONPATH" "$PY" "$OUT_DIR"

want() { [ "$STAGES" = all ] || [[ ",$STAGES," == *",$1,"* ]]; }
FAILED=0
record() {  # stage status rc seconds timeout note
  local note=${6//$'\t'/ }
  [ "$DRY" = 1 ] && return 0
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "$5" "${note//$'\n'/ }" >>"$RES/stages.tsv"
  case $2 in ok) ;; skipped) [ "$6" = "not selected" ] || FAILED=1 ;; *) FAILED=1 ;; esac
}
RESERVE=15  # seconds kept for the summary and packing
run_stage() {  # name timeout_s cmd...
  local name=$1 limit=$2; shift 2
  if [ "$DRY" = 1 ]; then printf '+ stage=%s timeout=%s cmd=%s\n' "$name" "$limit" "$(printf '%q ' "$@")"; return 0; fi
  if ! want "$name"; then record "$name" skipped 0 0 "$limit" "not selected"; return 0; fi
  local left=$(( BUDGET - RESERVE - ($(date +%s) - T0) ))
  (( limit > left )) && limit=$left
  if (( limit < 10 )); then
    record "$name" skipped 0 0 "$limit" "time budget spent"; log "$name: skipped (time budget spent)"; return 0
  fi
  log "$name: running (limit ${limit}s, log logs/$name.log)"
  local t=$(date +%s.%N) rc
  if command -v timeout >/dev/null 2>&1; then
    timeout -k 10 "$limit" "$@" >"$RES/logs/$name.log" 2>&1; rc=$?
  else
    "$@" >"$RES/logs/$name.log" 2>&1; rc=$?
  fi
  local dt; dt=$(awk -v a="$t" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
  local status=ok note=
  if [ $rc = 124 ] || [ $rc = 137 ]; then status=timeout; note="killed after ${limit}s"
  elif [ $rc != 0 ]; then status=failed; note="exit $rc; see logs/$name.log"; fi
  record "$name" "$status" "$rc" "$dt" "$limit" "$note"
  log "$name: $status (${dt}s)"
  if [ "$status" != ok ]; then tail -n 25 "$RES/logs/$name.log" | sed 's/^/    | /'; fi
  return 0
}
skip_stage() {  # name timeout reason
  if [ "$DRY" = 1 ]; then printf '# stage=%s would be skipped here: %s\n' "$1" "$3"; return 0; fi
  want "$1" || { record "$1" skipped 0 0 "$2" "not selected"; return 0; }
  record "$1" skipped 0 0 "$2" "$3"; log "$1: skipped: $3"
}
have() { "$PY" -c "import importlib.util, sys; sys.exit(0 if all(importlib.util.find_spec(m) for m in sys.argv[1:]) else 1)" "$@" 2>/dev/null; }
missing() { local m out=; for m in "$@"; do have "$m" || out+="$m "; done; echo "${out% }"; }

# ---- deps: the packages the stages need, from local wheels only --------------------------------------
# (The suite's test modules import the trainer's packages too: the tests stage collects them all.)
NEED=pytest
want tests && NEED=$TEST_MODULES
{ want train || want tests; } && NEED+=" $TRAIN_MODULES"
TRAIN_OK=1 TRAIN_WHY= PYTEST_WHY= SUITE_WHY=
if [ "$DRY" = 1 ]; then
  printf '# deps: if any of [%s] is missing, install %s/*.whl with pip --no-index into a temporary folder on PYTHONPATH\n' "$NEED" "$WHEELS"
else
  miss=$(missing $NEED)
  if [ -n "$miss" ] && compgen -G "$WHEELS/*.whl" >/dev/null; then
    log "deps: missing [$miss]; installing $(ls "$WHEELS"/*.whl | wc -l) local wheels from $WHEELS"
    t=$(date +%s)
    SITE=$WORK/site
    if timeout 60 "$PY" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check \
         --target "$SITE" "$WHEELS"/*.whl >"$RES/logs/deps.log" 2>&1; then
      export PYTHONPATH="$SITE:$PYTHONPATH"
    fi
    miss2=$(missing $NEED)
    if [ -z "$miss2" ]; then record deps ok 0 $(( $(date +%s) - t )) 60 "installed local wheels for: $miss"
    else record deps failed 1 $(( $(date +%s) - t )) 60 "still missing after installing local wheels: $miss2 (logs/deps.log)"; fi
    miss=$miss2
  elif [ -n "$miss" ]; then
    record deps failed 1 0 0 "missing: $miss; no wheels in $WHEELS"
  else
    record deps ok 0 0 0 "all present"
  fi
  fix="run 'bash scripts/gpu_check.sh --prepare-wheels' on a machine with internet and bring $WHEELS along; docs/guides/gpu.md"
  miss_train=$(missing $TRAIN_MODULES)
  [ -n "$miss_train" ] && { TRAIN_OK=0; TRAIN_WHY="trainer packages missing: $miss_train ($fix)"; }
  have pytest || PYTEST_WHY="pytest is missing ($fix)"
  miss_tests=$(missing $TEST_MODULES)
  [ -n "$miss_tests" ] && SUITE_WHY="test packages missing: $miss_tests ($fix)"
  [ -n "$miss" ] && log "deps: missing $miss ($fix)"
fi

# ---- stages: pytest runs ------------------------------------------------------------------------------
# stage_tests NAME LIMIT: the tests of tests/test_gpu.py named test_NAME_*, results into $RES
# (they need pytest only; the suite's tests also need hypothesis).
PYTEST=("$PY" -m pytest -p no:cacheprovider -q -rA)
stage_tests() {
  local name=$1 limit=$2; shift 2
  if [ -n "$PYTEST_WHY" ]; then skip_stage "$name" "$limit" "$PYTEST_WHY"; return 0; fi
  run_stage "$name" "$limit" "${PYTEST[@]}" tests/test_gpu.py -m cuda -k "test_${name}_" \
    --gpu-check-out "$RES" --junitxml "$RES/logs/$name.xml" "$@"
}
stage_tests env 30
# The suite's CUDA tests: the kernels and the op against the float64 reference, both backends.
if [ -n "$SUITE_WHY" ]; then
  skip_stage tests 75 "$SUITE_WHY"
else
  run_stage tests 75 "${PYTEST[@]}" tests -m cuda --ignore tests/test_gpu.py --junitxml "$RES/pytest_junit.xml"
fi
stage_tests op 45
stage_tests bench 60
stage_tests calibrate 90
# Training smoke run: 1 process (one GPU: a CA group of 1), CAD on, planning with the fresh cost model.
if [ "$TRAIN_OK" = 1 ]; then
  stage_tests train 150 --gpu-check-train-args "$TRAIN_EXTRA"
else
  skip_stage train 150 "$TRAIN_WHY"
fi

[ "$DRY" = 1 ] && exit 0

# ---- summary and packing ----------------------------------------------------------------------------
timeout 20 "$PY" scripts/gpu_check_report.py --out "$RES" --total-seconds $(( $(date +%s) - T0 )) 2>&1 | tee "$RES/logs/summary.log"
if [ "$PACK" = 1 ]; then
  tar -czf "$OUT_DIR/gpu_check.tar.gz" -C "$RES" . &&
    for f in summary.json env.json kernel_efficiency.png calibration.png "$RES"/cost_*.json; do
      [ -f "$RES/${f##*/}" ] && cp "$RES/${f##*/}" "$OUT_DIR/"
    done
  log "packed: $OUT_DIR/gpu_check.tar.gz (every file) + $(cd "$OUT_DIR" && ls | grep -v gpu_check.tar.gz | tr '\n' ' ')"
fi
log "done in $(( $(date +%s) - T0 ))s: $OUT_DIR"
exit $FAILED
