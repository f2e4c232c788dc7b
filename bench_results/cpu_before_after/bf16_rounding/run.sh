# The kernels' branch-free bf16 rounding, end to end: each run a fresh process, alternated new / old.
# OLD_SRC: a checkout of the commit before (git worktree add /work/old HEAD~1), run via PYTHONPATH.
set -u
cd "$(dirname "$0")/../../.."
D=bench_results/cpu_before_after/bf16_rounding
run() { env ${3:+PYTHONPATH=$3} timeout 900 .venv/bin/tdpipe bench throughput --num-prompts 256 --input-len 128 \
    --output-len 128 --kv-cache-memory 2GiB --quantization $1 --json $D/$1_$2.json 2>&1 | grep -E "^output tok|matmul peak  "; }
O=${OLD_SRC:-/work/old/src}
echo w8a8 new 1; run w8a8 new_1
echo w8a8 old 1; run w8a8 old_1 $O
echo none old 1; run none old_1 $O
echo none new 1; run none new_1
echo w8a8 old 2; run w8a8 old_2 $O
echo w8a8 new 2; run w8a8 new_2
echo none new 2; run none new_2
echo none old 2; run none old_2 $O
