# W8A8 with its inputs rotated (Hadamard blocks of 64, int8_linear.ROTATE) against the same engine without the
# rotation (the commit before, from a git worktree OLD, default /work/old), bf16, and vLLM's CPU engine in
# bf16 (same token ids); each run a fresh process, alternated. VLLM_VENV: vLLM's venv.
#   git worktree add /work/old 5d7a52a && VLLM_VENV=/work/vllm-venv \
#       bash bench_results/quant/sitting_2026-11-29_rotation/run.sh
set -u
cd "$(dirname "$0")/../../.."
D=bench_results/quant/sitting_2026-11-29_rotation
P=ab_
. bench_results/quant/sitting.sh  # tdp, vl
for run in rotated_1 unrotated_1 none_1 vllm_1 vllm_2 none_2 unrotated_2 rotated_2; do
    echo "$run"
    case $run in
        rotated*) tdp w8a8 "$run" "" ;;
        unrotated*) tdp w8a8 "$run" "$OLD" ;;
        none*) tdp none "$run" "" ;;
        vllm*) vl "${run#vllm_}" ;;
    esac
done
