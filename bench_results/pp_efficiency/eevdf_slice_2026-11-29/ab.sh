#!/bin/bash
# The EEVDF slice A/B (not kept): apply slice.patch first (it adds TDPIPE_SLICE_US, read by the engine and the
# stages). Each argument TAG:US is one fresh run of the bar's workload: TAG pp1* runs pp = 1 (two threads),
# anything else pp = 2 (one thread per stage); US the slice in microseconds (0: Linux's default).
#   git apply bench_results/pp_efficiency/eevdf_slice_2026-11-29/slice.patch
#   bash bench_results/pp_efficiency/eevdf_slice_2026-11-29/ab.sh s0a:0 s100b:100 pp1a:0 s100c:100 s0b:0 pp1b:0
# The traced pair (trj_*.json): the same pp = 2 command with --trace and TDPIPE_SLICE_US=100, then 0.
cd "$(dirname "$0")/../../.."
D=bench_results/pp_efficiency/eevdf_slice_2026-11-29
for i in "$@"; do
  tag=${i%%:*}; us=${i##*:}
  if [[ $tag == pp1* ]]; then par="--threads 2"; else par="--pp 2 --threads-per-stage 1"; fi
  TDPIPE_SLICE_US=$us .venv/bin/tdpipe bench throughput --num-prompts 256 $par --scheduler throttle \
    --kv-cache-memory 2GiB --json $D/r_${tag}.json > /dev/null 2>&1
  python3 -c "
import json; d=json.load(open('$D/r_${tag}.json'))
print('${tag}', '${us}', round(d['output_tokens_per_s'],1), 'bubble', round(d['bubble_ratio'],3), 'dec', round(d.get('decode_bubble_ratio') or 0,3), 'peak', round(d['peak_gflops'],1))"
done
