# W8A8 with its lm_head as Int8Head (per token, rotated, oneDNN; this code) against the 8-bit block head (OLD,
# the commit before), fresh processes, alternated, three runs a side, 256 x 128/128 on the bundled model.
#   git worktree add /work/old fb71fde && bash bench_results/quant/sitting_2026-11-29_int8head/ab.sh
set -u
cd "$(dirname "$0")/../../.."
D=bench_results/quant/sitting_2026-11-29_int8head
P=ab_
. bench_results/quant/sitting.sh  # tdp, vl
for run in head_1 blocks_1 blocks_2 head_2 head_3 blocks_3; do
    echo "$run"
    case $run in
        head*) tdp w8a8 "$run" "" ;;
        blocks*) tdp w8a8 "$run" "$OLD" ;;
    esac
done
