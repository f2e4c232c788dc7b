# W8A8 end to end, the branch-free bf16 rounding (new) against the commit before it (old, a git worktree
# through PYTHONPATH): three alternations, each run a fresh process.
set -u
cd "$(dirname "$0")/../../../.."
D=bench_results/cpu_before_after/bf16_rounding/w8a8_ab
O=${OLD_SRC:-/work/old/src}
run() { env ${2:+PYTHONPATH=$2} timeout 900 .venv/bin/tdpipe bench throughput --num-prompts 256 --input-len 128 \
    --output-len 128 --kv-cache-memory 2GiB --quantization w8a8 --json $D/$1.json 2>&1 | grep -E "^output tok"; }
for i in 1 2 3; do
  echo new $i; run new_$i
  echo old $i; run old_$i $O
done
