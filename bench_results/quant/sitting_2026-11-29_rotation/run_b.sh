# After run.sh: the rotated quantise pass's row copy vectorised (it had called ops.cpp's ld per value) and the
# butterflies' in-register permutes made cheaper; rotated (this code) against unrotated (OLD, as in run.sh),
# alternated, each a fresh process.
#   bash bench_results/quant/sitting_2026-11-29_rotation/run_b.sh
set -u
cd "$(dirname "$0")/../../.."
D=bench_results/quant/sitting_2026-11-29_rotation
OLD=${OLD:-/work/old}
tdp() { env ${2:+PYTHONPATH=$2/src} timeout 900 .venv/bin/tdpipe bench throughput --num-prompts 256 \
    --input-len 128 --output-len 128 --kv-cache-memory 2GiB --quantization w8a8 --json $D/b_$1.json 2>&1 |
    grep -E "^output tok|matmul peak  "; }
for run in rotated_1 unrotated_1 unrotated_2 rotated_2; do
    echo "$run"; case $run in unrotated*) tdp "$run" "$OLD" ;; *) tdp "$run" "" ;; esac
done
