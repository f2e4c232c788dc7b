# A second sitting on the reviewed kernel (the fused SwiGLU quantising through int8.cpp's pass): rotated W8A8
# (this code), unrotated (OLD, the commit before the rotation, as in run.sh), bf16 and vLLM's CPU engine in
# bf16, each a fresh process, alternated, three runs a side (two for vLLM). VLLM_VENV: vLLM's venv.
#   git worktree add /work/old 5d7a52a && VLLM_VENV=/work/vllm-venv \
#       bash bench_results/quant/sitting_2026-11-29_rotation/run_c.sh
set -u
cd "$(dirname "$0")/../../.."
D=bench_results/quant/sitting_2026-11-29_rotation
OLD=${OLD:-/work/old}
M=$(ls -d ~/.cache/tdpipe/models/SmolLM2-135M-Instruct-bf16 2>/dev/null)
tdp() { env ${3:+PYTHONPATH=$3/src} timeout 900 .venv/bin/tdpipe bench throughput --num-prompts 256 \
    --input-len 128 --output-len 128 --kv-cache-memory 2GiB --quantization $1 --json $D/c_$2.json 2>&1 |
    grep -E "^output tok|matmul peak  "; }
vl() { VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=4 timeout 900 ${VLLM_VENV:-vllm-venv}/bin/python \
    scripts/peers/vllm_throughput.py --model $M --num-prompts 256 --input-len 128 --output-len 128 \
    --json $D/c_vllm_$1.json 2>&1 | grep "^{"; }
for run in rotated_1 unrotated_1 none_1 vllm_1 vllm_2 none_2 unrotated_2 rotated_2 rotated_3 unrotated_3 none_3; do
    echo "$run"
    case $run in
        rotated*) tdp w8a8 "$run" "" ;;
        unrotated*) tdp w8a8 "$run" "$OLD" ;;
        none*) tdp none "$run" "" ;;
        vllm*) vl "${run#vllm_}" ;;
    esac
done
