# A sitting on the code of 2026-11-29 with the norms' fusion (add_rms_norm_quant): W8A8 against bf16 and vLLM's
# CPU engine in bf16 on the same token ids, 256 x 128/128 on the bundled model, each run a fresh process,
# alternated, three runs a side (two for vLLM). VLLM_VENV: vLLM's venv.
#   VLLM_VENV=/work/vllm-venv bash bench_results/quant/sitting_2026-11-29_s33/run.sh
set -u
cd "$(dirname "$0")/../../.."
D=bench_results/quant/sitting_2026-11-29_s33
P=${P:-}
. bench_results/quant/sitting.sh  # sit
sit w8a8_1 none_1 vllm_1 vllm_2 none_2 w8a8_2 w8a8_3 none_3
