# Temperature sampling, from the repository root: VLLM_VENV=/work/vllm-venv bash bench_results/sampling/run.sh DIR
# 256 x 128/128 on the bundled model in bf16 at temperature 1: this checkout's sampler against torch's
# exponential_ (the sampler before the hashed race, from an old checkout: `git worktree add /work/old <commit>`,
# then `git -C /work/old checkout 94a3417 -- src/tdpipe/sampling/sampler.py` and this checkout's
# src/tdpipe/bench/sampler.py copied there), greedy for scale, and vLLM's CPU engine at temperature 1. Each run
# a fresh process, alternated; then `tdpipe bench sampler` on both samplers (49,152 and 262,144 columns), and
# with GRPO=1 the GRPO-shaped rollout of `tdpipe bench prefix` on both.
D=$1
mkdir -p $D
source bench_results/quant/sitting.sh
tt() { ARGS="--temperature $1" tdp none $2 $3; }  # tt TEMPERATURE NAME [CHECKOUT]: sitting.sh's tdp
vt() { ARGS="--temperature $1" vl $2; }  # vt TEMPERATURE NAME: sitting.sh's vl
sb() {  # sb NAME VOCAB MIX [CHECKOUT]
  env ${4:+PYTHONPATH=$4/src} timeout 900 .venv/bin/tdpipe bench sampler --vocab $2 --mix $3 --threads 2 \
      --json $D/sampler_$1.json 2>&1 | tail -1; }
echo race1; tt 1.0 race_t1_a
echo old1; tt 1.0 exponential_t1_a $OLD
echo vllm1; vt 1.0 t1_a
echo greedy; tt 0.0 greedy_a
echo old2; tt 1.0 exponential_t1_b $OLD
echo race2; tt 1.0 race_t1_b
echo vllm2; vt 1.0 t1_b
for v in 49152 262144; do
  for mix in temperature mixed; do
    sb race_${mix}_$v $v $mix; sb exponential_${mix}_$v $v $mix $OLD
  done
done
# GRPO-shaped rollouts (64 prompts x n = 8 x 256 tokens, temperature 1, seeded): the fork row, both samplers
pf() {  # pf NAME [CHECKOUT]
  env ${2:+PYTHONPATH=$2/src} timeout 1200 .venv/bin/tdpipe bench prefix --workload grpo --rows fork \
      --json $D/grpo_fork_$1.json 2>&1 | grep -E "^fork|output tok"; }
[ -n "$GRPO" ] && { echo grpo-race; pf race; echo grpo-old; pf exponential $OLD; }
