# The bundled model's Q4_1 file with its blocks kept packed (gguf) against its bf16 conversion (none), each
# run a fresh process, alternated gguf, none, none, gguf, gguf, none. bash
# bench_results/quant/sitting_2026-11-29_gguf/run.sh
set -u
cd "$(dirname "$0")/../../.."
D=bench_results/quant/sitting_2026-11-29_gguf
tdp() { timeout 900 .venv/bin/tdpipe bench throughput --num-prompts 256 --input-len 128 --output-len 128 \
    --kv-cache-memory 2GiB --quantization $1 --json $D/ab_$1_$2.json 2>&1 |
    grep -E "^output tok|matmul peak  "; }
echo gguf 1; tdp gguf 1
echo none 1; tdp none 1
echo none 2; tdp none 2
echo gguf 2; tdp gguf 2
echo gguf 3; tdp gguf 3
echo none 3; tdp none 3
