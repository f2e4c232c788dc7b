# W8A8 with its lm_head as Int8Head (per token, rotated, oneDNN; this code) against the 8-bit block head (OLD,
# the commit before), fresh processes, alternated, three runs a side, 256 x 128/128 on the bundled model.
#   git worktree add /work/old fb71fde && bash bench_results/quant/sitting_2026-11-29_int8head/ab.sh
set -u
cd "$(dirname "$0")/../../.."
D=bench_results/quant/sitting_2026-11-29_int8head
OLD=${OLD:-/work/old}
tdp() { env ${3:+PYTHONPATH=$3/src} timeout 900 .venv/bin/tdpipe bench throughput --num-prompts 256 \
    --input-len 128 --output-len 128 --kv-cache-memory 2GiB --quantization $1 --json $D/ab_$2.json 2>&1 |
    grep -E "^output tok|matmul peak  "; }
for run in head_1 blocks_1 blocks_2 head_2 head_3 blocks_3; do
    echo "$run"
    case $run in
        head*) tdp w8a8 "$run" "" ;;
        blocks*) tdp w8a8 "$run" "$OLD" ;;
    esac
done
