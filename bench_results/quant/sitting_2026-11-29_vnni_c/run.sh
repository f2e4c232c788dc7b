# A third sitting that day, after the fused SwiGLU middle became bit-exact: each run a fresh process,
# alternated, W8A8 against bf16 and vLLM's CPU engine in bf16 (same token ids). VLLM_VENV: vLLM's venv.
#   VLLM_VENV=/work/vllm-venv bash bench_results/quant/sitting_2026-11-29_vnni_c/run.sh
set -u
cd "$(dirname "$0")/../../.."
D=bench_results/quant/sitting_2026-11-29_vnni_c
M=$(ls -d ~/.cache/tdpipe/models/SmolLM2-135M-Instruct-bf16 2>/dev/null)
tdp() { timeout 900 .venv/bin/tdpipe bench throughput --num-prompts 256 --input-len 128 --output-len 128 \
    --kv-cache-memory 2GiB --quantization $1 --json $D/ab_$1_$2.json 2>&1 |
    grep -E "^output tok|matmul peak  "; }
vl() { VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=4 timeout 900 ${VLLM_VENV:-vllm-venv}/bin/python \
    scripts/peers/vllm_throughput.py --model $M --num-prompts 256 --input-len 128 --output-len 128 \
    --json $D/ab_vllm_$1.json 2>&1 | tail -2; }
echo w8a8 1; tdp w8a8 1
echo none 1; tdp none 1
echo vllm 1; vl 1
echo vllm 2; vl 2
echo none 2; tdp none 2
echo w8a8 2; tdp w8a8 2
echo w8a8 3; tdp w8a8 3
echo none 3; tdp none 3
