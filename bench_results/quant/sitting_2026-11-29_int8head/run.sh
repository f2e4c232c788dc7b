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
OLD=${OLD:-/work/old}
M=$(ls -d ~/.cache/tdpipe/models/SmolLM2-135M-Instruct-bf16 2>/dev/null)
tdp() { env ${3:+PYTHONPATH=$3/src} timeout 900 .venv/bin/tdpipe bench throughput --num-prompts 256 \
    --input-len 128 --output-len 128 --kv-cache-memory 2GiB --quantization $1 --json $D/$P$2.json 2>&1 |
    grep -E "^output tok|matmul peak  "; }
vl() { VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=4 timeout 900 ${VLLM_VENV:-vllm-venv}/bin/python \
    scripts/peers/vllm_throughput.py --model $M --num-prompts 256 --input-len 128 --output-len 128 \
    --json $D/${P}vllm_$1.json 2>&1 | grep "^{"; }
for run in w8a8_1 old_1 none_1 vllm_1 vllm_2 none_2 old_2 w8a8_2 w8a8_3 old_3 none_3; do
    echo "$run"
    case $run in
        w8a8*) tdp w8a8 "$run" "" ;;
        old*) tdp w8a8 "$run" "$OLD" ;;
        none*) tdp none "$run" "" ;;
        vllm*) vl "${run#vllm_}" ;;
    esac
done
