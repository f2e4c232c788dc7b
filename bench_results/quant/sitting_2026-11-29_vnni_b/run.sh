# W8A8 against bf16 after the kernels' branch-free bf16 rounding: three pairs, each run a fresh process,
# alternated (w8a8, none, none, w8a8, w8a8, none). bash bench_results/quant/sitting_2026-11-29_vnni_b/run.sh
set -u
cd "$(dirname "$0")/../../.."
D=bench_results/quant/sitting_2026-11-29_vnni_b
tdp() { timeout 900 .venv/bin/tdpipe bench throughput --num-prompts 256 --input-len 128 --output-len 128 \
    --kv-cache-memory 2GiB --quantization $1 --json $D/ab_$1_$2.json 2>&1 | grep -E "^output tok|matmul peak  "; }
echo w8a8 1; tdp w8a8 1
echo none 1; tdp none 1
echo none 2; tdp none 2
echo w8a8 2; tdp w8a8 2
echo w8a8 3; tdp w8a8 3
echo none 3; tdp none 3
