# Temperature-1 sampling, 256 x 128/128 on the bundled model in bf16: the hashed race (this commit) against
# torch's exponential_ (the sampler before it, from an old checkout: `git worktree add /work/old <commit>`,
# then `git -C /work/old checkout 94a3417 -- src/tdpipe/sampling/sampler.py`), greedy for scale, and vLLM's
# CPU engine at temperature 1. Each run a fresh process, alternated. From the repository root:
#   VLLM_VENV=/work/vllm-venv bash bench_results/sampling/race_2026-11-29/run.sh
D=bench_results/sampling/race_2026-11-29
source bench_results/quant/sitting.sh
tt() {  # tt TEMPERATURE NAME [CHECKOUT]
  env ${3:+PYTHONPATH=$3/src} timeout 900 .venv/bin/tdpipe bench throughput --num-prompts 256 --input-len 128 \
      --output-len 128 --kv-cache-memory 2GiB --quantization none --temperature $1 --json $D/$2.json 2>&1 |
      grep -E "^output tok|matmul peak  "; }
vt() {  # vt TEMPERATURE NAME
  VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=4 timeout 900 ${VLLM_VENV:-vllm-venv}/bin/python \
      scripts/peers/vllm_throughput.py --model $M --num-prompts 256 --input-len 128 --output-len 128 \
      --temperature $1 --json $D/vllm_$2.json 2>&1 | grep "^{"; }
echo race1; tt 1.0 race_t1_a
echo old1; tt 1.0 exponential_t1_a $OLD
echo vllm1; vt 1.0 t1_a
echo greedy; tt 0.0 greedy_a
echo old2; tt 1.0 exponential_t1_b $OLD
echo race2; tt 1.0 race_t1_b
echo vllm2; vt 1.0 t1_b
