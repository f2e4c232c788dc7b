# One sitting, each run a fresh process, alternated: W8A8 against bf16 and against vLLM's CPU engine in bf16,
# then W8A8 with the int8 KV cache. bash bench_results/quant/sitting_2026-11-29_vnni/run.sh (VLLM_VENV: vLLM's venv)
set -u
cd "$(dirname "$0")/../../.."
D=bench_results/quant/sitting_2026-11-29_vnni
M=$(ls -d ~/.cache/tdpipe/models/SmolLM2-135M-Instruct-bf16 2>/dev/null)
tdp() { timeout 900 .venv/bin/tdpipe bench throughput --num-prompts 256 --input-len 128 --output-len 128 --kv-cache-memory 2GiB --quantization $1 ${3:-} --json $D/ab_$1${4:-}_$2.json 2>&1 | grep -E "^output tok|matmul peak  "; }
vl() { VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=4 timeout 900 ${VLLM_VENV:-vllm-venv}/bin/python scripts/peers/vllm_throughput.py --model $M --num-prompts 256 --input-len 128 --output-len 128 --json $D/ab_vllm_$1.json 2>&1 | tail -2; }
echo w8a8 1; tdp w8a8 1
echo none 1; tdp none 1
echo vllm 1; vl 1
echo vllm 2; vl 2
echo none 2; tdp none 2
echo w8a8 2; tdp w8a8 2
echo w8a8 int8kv 1; tdp w8a8 1 "--kv-cache-dtype int8" _int8kv
echo w8a8 int8kv 2; tdp w8a8 2 "--kv-cache-dtype int8" _int8kv
