import sys, time, random
from tdpipe import LLM, SamplingParams
llm = LLM(quantization=sys.argv[1], num_threads=2, dtype="bfloat16")
random.seed(0)
def mk(n): return [{"prompt_token_ids": [random.randrange(100, 40000) for _ in range(128)]} for _ in range(n)]
llm.generate(mk(8), SamplingParams(max_tokens=4, ignore_eos=True))
print("START", flush=True)
t = time.perf_counter()
outs = llm.generate(mk(256), SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True))
print("elapsed", time.perf_counter() - t, flush=True)
