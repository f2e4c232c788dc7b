# A sitting after the lm_head moved to Int8Head and the fused SwiGLU to 2,048-row slices (reverted after this
# run as level, same bits: the code today runs without them): W8A8 (this code),
# W8A8 before both (OLD: fb71fde, the 8-bit block head), bf16 and vLLM's CPU engine in bf16, each a fresh
# process, alternated, three runs a side (two for vLLM), 256 x 128/128 on the bundled model.
#   git worktree add /work/old fb71fde && VLLM_VENV=/work/vllm-venv \
#       bash bench_results/quant/sitting_2026-11-29_int8head/run.sh
# The second sitting (after Int8Head's row scaling became one C++ pass): the same with P=b_ (files b_*.json).
set -u
cd "$(dirname "$0")/../../.."
D=bench_results/quant/sitting_2026-11-29_int8head
P=${P:-}
. bench_results/quant/sitting.sh  # tdp, vl
for run in w8a8_1 old_1 none_1 vllm_1 vllm_2 none_2 old_2 w8a8_2 w8a8_3 old_3 none_3; do
    echo "$run"
    case $run in
        w8a8*) tdp w8a8 "$run" "" ;;
        old*) tdp w8a8 "$run" "$OLD" ;;
        none*) tdp none "$run" "" ;;
        vllm*) vl "${run#vllm_}" ;;
    esac
done
