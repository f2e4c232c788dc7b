#!/usr/bin/env bash
# The simulator's fidelity table (docs/simulator.md), in one sitting so the machine's speed is the same
# throughout: calibrate the CPU row, run every policy for real at pp = 1 and 2 on one ShareGPT-like
# workload (back to back, alone on the machine), then replay each run in the simulator.
set -euo pipefail
N=${N:-200}
OUT=${OUT:-bench_results/sim}
mkdir -p "$OUT"
tdpipe simulate --hardware cpu --recalibrate --model bundled --num-devices 2 --num-prompts 4 --num-kv-blocks 64 > /dev/null
python - "$OUT/cpu_calibration.json" <<'PY'
import shutil, sys
from tdpipe.model.bundled import resolve_model
from tdpipe.sim.calibrate import cache_path, default_thread_counts
shutil.copy(cache_path(resolve_model(None), default_thread_counts()), sys.argv[1])
PY
for pp in 1 2; do
  for policy in separate hybrid throttle td-pipe; do
    tdpipe bench throughput --num-prompts "$N" --kv-cache-memory 512MiB --pp "$pp" --scheduler "$policy" \
      --json "$OUT/real_pp${pp}_${policy}.json" > "$OUT/real_pp${pp}_${policy}.txt" 2>&1
  done
done
tdpipe simulate --compare "$OUT"/real_pp1_{separate,hybrid,throttle,td-pipe}.json \
  "$OUT"/real_pp2_{separate,hybrid,throttle,td-pipe}.json --json "$OUT/fidelity.json" --markdown "$OUT/fidelity.md"
