"""The engine's own cost per decode step: a 1-layer, 64-wide random Llama (float32), N sequences (default 256)
of 16 prompt tokens and 128 forced output tokens, so the model costs next to nothing and the step time is
mostly scheduling, input preparation and output processing.

    .venv/bin/python scripts/engine_overhead.py [N]
    py-spy record -f raw -o out.raw -- .venv/bin/python scripts/engine_overhead.py   # where the time goes
"""
import argparse
import time

from tdpipe import LLM, SamplingParams
from tdpipe.model.random_model import random_model_folder

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
          "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
          "head_dim": 32, "vocab_size": 512, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
          "rope_theta": 10000.0, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
          "torch_dtype": "float32"}


def main(n: int) -> None:
    with LLM(random_model_folder(CONFIG), dtype="float32", kv_cache_memory=256 << 20, max_num_seqs=n) as llm:
        reqs = [{"prompt_token_ids": [3 + (i % 500)] * 16} for i in range(n)]
        llm.generate(reqs[:8], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        t = time.perf_counter()
        llm.generate(reqs, SamplingParams(temperature=0, max_tokens=128, ignore_eos=True), use_tqdm=False)
        dt = time.perf_counter() - t
    print(f"{n} sequences x 128 tokens: {dt:.2f} s, {dt / 128 * 1e3:.2f} ms per step ({n * 128 / dt:.0f} tok/s)")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("n", nargs="?", type=int, default=256, help="sequences (default 256)")
    main(p.parse_args().n)
