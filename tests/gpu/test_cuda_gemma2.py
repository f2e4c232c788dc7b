"""Gemma 2's soft-capped attention scores, c tanh(s / c), in the compiled Triton kernels: the kernels against
the pure-torch reference on CUDA tensors (prefill, decode, split-K decode, with and without a window), and a
tiny Gemma 2 through the engine on CUDA against transformers' eager attention, greedy, float32. Checked under
Triton's interpreter before (tests/unit/test_triton_attention.py::test_softcap); this is the compiled code."""
import random

import pytest
import torch

from tdpipe import LLM, SamplingParams
from tdpipe.bench.parity import hf_greedy
from tdpipe.model import paged_attention as pa

from gpu_models import TINY_GEMMA2, gemma2_model
from test_triton_attention_cuda import DECODE, MIXED, TOL, batch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("shape", [MIXED, DECODE], ids=["prefill", "decode"])
def test_softcap_kernels_match_reference_on_cuda(dtype, window, shape):
    q, kc, vc, bt, cu, lens = batch(dtype, 16, 2, 3, 64, *shape, seed=5)
    q = (q.float() * 6).to(dtype)  # scores large enough that a cap of 3 bends them
    out = pa.paged_attention(q, kc, vc, bt, cu, lens, 0.5, sliding_window=window, softcap=3.0)
    ref = pa.paged_attention_ref(q, kc, vc, bt, cu, lens, 0.5, sliding_window=window, softcap=3.0)
    plain = pa.paged_attention_ref(q, kc, vc, bt, cu, lens, 0.5, sliding_window=window)
    assert (ref.float() - plain.float()).abs().max() > 0.05  # the cap matters here
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_gemma2_greedy_float32_equals_transformers(tmp_path):
    folder, hf = gemma2_model(tmp_path, seed=0)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, TINY_GEMMA2["vocab_size"]) for _ in range(n)] for n in (5, 9, 16, 17, 40)]
    with LLM(folder, dtype="float32", device="cuda", kv_cache_memory=64 << 20) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == hf_greedy(hf, prompts, 16)
