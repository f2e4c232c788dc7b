import os, sys, time, random
import torch
from tdpipe import LLM, SamplingParams
from tdpipe.model import int8_linear as il
CH = int(os.environ.get("CHUNK", "0"))
if CH:
    orig = il.Int8Linear.int_mm
    def int_mm(self, q):
        M = q.shape[0]
        if self.float_rows or self.out_features < 2048 or not (CH < M <= 4 * CH):
            return orig(self, q)
        out = torch.empty(M, self.out_features, dtype=torch.int32)
        for i in range(0, M, CH):
            torch._int_mm(q[i:i + CH], self.qweight_t, out=out[i:i + CH])
        return out
    il.Int8Linear.int_mm = int_mm
llm = LLM(quantization="w8a8", num_threads=2, dtype="bfloat16", kv_cache_memory=2 * 1024**3)
random.seed(0)
def mk(n): return [{"prompt_token_ids": [random.randrange(100, 40000) for _ in range(128)]} for _ in range(n)]
llm.generate(mk(8), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
t = time.perf_counter()
outs = llm.generate(mk(256), SamplingParams(temperature=0, max_tokens=128, ignore_eos=True), use_tqdm=False)
dt = time.perf_counter() - t
import hashlib
h = hashlib.md5(str([o.outputs[0].token_ids for o in outs]).encode()).hexdigest()[:8]
print(f"CHUNK={CH} elapsed {dt:.2f} s  {256*128/dt:.1f} tok/s  tokens {h}", flush=True)
