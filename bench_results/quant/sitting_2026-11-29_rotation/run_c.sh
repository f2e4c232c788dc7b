# A second sitting on the reviewed kernel (the fused SwiGLU quantising through int8.cpp's pass): rotated W8A8
# (this code), unrotated (OLD, the commit before the rotation, as in run.sh), bf16 and vLLM's CPU engine in
# bf16, each a fresh process, alternated, three runs a side (two for vLLM). VLLM_VENV: vLLM's venv.
#   git worktree add /work/old 5d7a52a && VLLM_VENV=/work/vllm-venv \
#       bash bench_results/quant/sitting_2026-11-29_rotation/run_c.sh
set -u
cd "$(dirname "$0")/../../.."
D=bench_results/quant/sitting_2026-11-29_rotation
P=c_
. bench_results/quant/sitting.sh  # tdp, vl
for run in rotated_1 unrotated_1 none_1 vllm_1 vllm_2 none_2 unrotated_2 rotated_2 rotated_3 unrotated_3 none_3; do
    echo "$run"
    case $run in
        rotated*) tdp w8a8 "$run" "" ;;
        unrotated*) tdp w8a8 "$run" "$OLD" ;;
        none*) tdp none "$run" "" ;;
        vllm*) vl "${run#vllm_}" ;;
    esac
done
