# W8A8 before and after the fused SwiGLU middle gave the unfused layers' exact bits (acc * sx stored before
# the multiplication by sw; the row's divisions without fast-math). Old code from a git worktree of the commit
# before (OLD, default /work/old); each run a fresh process, alternated old, new, new, old, old, new.
#   git worktree add /work/old 5c79947 && bash bench_results/cpu_before_after/swiglu_exact/run.sh
set -u
cd "$(dirname "$0")/../../.."
D=bench_results/cpu_before_after/swiglu_exact
OLD=${OLD:-/work/old}
tdp() { env ${2:+PYTHONPATH=$2/src} timeout 900 .venv/bin/tdpipe bench throughput --num-prompts 256 \
    --input-len 128 --output-len 128 --kv-cache-memory 2GiB --quantization w8a8 --json $D/w8a8_$1.json 2>&1 |
    grep -E "^output tok"; }
for run in old_1 new_1 new_2 old_2 old_3 new_3; do
    echo "$run"; case $run in old*) tdp "$run" "$OLD" ;; *) tdp "$run" "" ;; esac
done
