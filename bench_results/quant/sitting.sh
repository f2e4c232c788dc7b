# Sourced by the sitting scripts in the folders beside it, from the repository root, after they set D (their
# folder) and P (a prefix for the JSON names). The workload of every W8A8 sitting: 256 x 128/128 on the bundled
# model, 2 GiB of KV, each run a fresh process.
#   tdp QUANT NAME [CHECKOUT]  tdpipe bench throughput --quantization QUANT into $D/$P$NAME.json, with CHECKOUT's
#                              src first on PYTHONPATH (an older commit's git worktree) when given
#   vl NAME                    vLLM's CPU engine (its venv: VLLM_VENV) on the same token ids, in bf16, into
#                              $D/${P}vllm_$NAME.json
#   sit RUN...                 each RUN in turn, by its label: w8a8_N and none_N (tdp, this checkout), vllm_N (vl)
# ARGS (empty unless set): more flags for both commands, e.g. ARGS="--temperature 1.0"
ARGS=${ARGS:-}
OLD=${OLD:-/work/old}
M=$(ls -d ~/.cache/tdpipe/models/SmolLM2-135M-Instruct-bf16 2>/dev/null)
tdp() { env ${3:+PYTHONPATH=$3/src} timeout 900 .venv/bin/tdpipe bench throughput --num-prompts 256 \
    --input-len 128 --output-len 128 --kv-cache-memory 2GiB --quantization $1 $ARGS --json $D/$P$2.json 2>&1 |
    grep -E "^output tok|matmul peak  "; }
vl() { VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=4 timeout 900 ${VLLM_VENV:-vllm-venv}/bin/python \
    scripts/peers/vllm_throughput.py --model $M --num-prompts 256 --input-len 128 --output-len 128 \
    $ARGS --json $D/${P}vllm_$1.json 2>&1 | grep "^{"; }
sit() { for run in "$@"; do
    echo "$run"
    case $run in
        w8a8*) tdp w8a8 "$run" "" ;;
        none*) tdp none "$run" "" ;;
        vllm*) vl "${run#vllm_}" ;;
        *) echo "sit: unknown run $run" >&2; return 2 ;;
    esac
done; }
