"""The model's generation_config.json as the sampling defaults (vLLM's --generation-config auto) through the
real engine: LLM.generate(prompts) without SamplingParams and get_default_sampling_params() take them, an
explicit SamplingParams is used as given, "vllm" ignores the file, and AsyncLLM's frontend gets them from
the core."""
import asyncio
import json
import os

import pytest

from tdpipe import LLM, SamplingParams
from tdpipe.config import CacheConfig, EngineConfig
from tdpipe.core.async_llm import AsyncLLM

pytestmark = pytest.mark.slow

PROMPT = {"prompt_token_ids": list(range(100, 120))}


@pytest.fixture(scope="module")
def greedy_by_default(qwen2_tiny, tmp_path_factory):
    """The tiny Qwen2 whose generation_config.json says: greedy, 5 new tokens."""
    src, d = qwen2_tiny[0], tmp_path_factory.mktemp("gen_config")
    for f in os.listdir(src):
        if f != "generation_config.json":
            os.symlink(os.path.join(src, f), d / f)
    gen = json.load(open(os.path.join(src, "generation_config.json")))
    (d / "generation_config.json").write_text(json.dumps({**gen, "temperature": 0.0, "max_new_tokens": 5}))
    return str(d)


def test_offline_defaults_come_from_the_model(greedy_by_default):
    with LLM(model=greedy_by_default, dtype="float32", kv_cache_memory=32 << 20) as llm:
        d = llm.get_default_sampling_params()
        assert (d.temperature, d.max_tokens) == (0.0, 5)
        plain = llm.generate([PROMPT], use_tqdm=False)[0].outputs[0]
        greedy = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0].outputs[0]
        given = llm.generate([PROMPT], SamplingParams(max_tokens=3, seed=1), use_tqdm=False)[0].outputs[0]
    assert plain.token_ids == greedy.token_ids and len(plain.token_ids) == 5
    assert len(given.token_ids) == 3  # an explicit SamplingParams is used as given (vLLM's rule)
    with LLM(model=greedy_by_default, dtype="float32", kv_cache_memory=32 << 20, generation_config="vllm") as llm:
        d = llm.get_default_sampling_params()
    assert (d.temperature, d.max_tokens) == (1.0, 16)


def test_async_llm_gets_them_from_the_core(greedy_by_default):
    async def main():
        llm = await AsyncLLM.start(EngineConfig(model=greedy_by_default, dtype="float32",
                                                cache=CacheConfig(kv_cache_memory=32 << 20)))
        try:
            assert llm.default_sampling == {"temperature": 0.0, "max_tokens": 5}
        finally:
            await llm.shutdown()

    asyncio.run(main())
