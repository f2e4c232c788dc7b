"""--tokenizer FOLDER (vLLM's): a model folder without tokenizer files runs with another folder's tokenizer and
chat template, offline and behind AsyncLLM; a missing or bad --tokenizer is one error naming it. And vLLM's
skip_tokenizer_init: no tokenizer at all, token ids in and out, offline only."""
import asyncio
import os
import shutil

import pytest

from tdpipe import LLM, SamplingParams
from tdpipe.config import CacheConfig, EngineConfig
from tdpipe.core.async_llm import AsyncLLM
from tdpipe.model.weights import MissingModelFile

pytestmark = pytest.mark.slow

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def split_folders(qwen2_tiny, tmp_path_factory):
    """(weights-only folder, tokenizer folder whose chat template is marked): the tiny Qwen2 cut in two."""
    src = qwen2_tiny[0]
    weights, tok = tmp_path_factory.mktemp("weights_only"), tmp_path_factory.mktemp("tokenizer_only")
    for f in os.listdir(src):
        if f not in TOKENIZER_FILES:
            os.symlink(os.path.join(src, f), weights / f)
    for f in TOKENIZER_FILES:
        shutil.copy(os.path.join(src, f), tok / f)
    template = (tok / "chat_template.jinja").read_text()
    (tok / "chat_template.jinja").write_text("MARKED " + template)
    return str(weights), str(tok)


def test_the_model_runs_with_another_folders_tokenizer(qwen2_tiny, split_folders):
    weights, tok = split_folders
    with pytest.raises(MissingModelFile, match="no tokenizer files"):
        LLM(model=weights, dtype="float32", kv_cache_memory=32 << 20)
    with LLM(model=qwen2_tiny[0], dtype="float32", kv_cache_memory=32 << 20) as llm:
        ref = llm.generate(["The capital of France is"], GREEDY, use_tqdm=False)[0]
    with LLM(model=weights, tokenizer=tok, dtype="float32", kv_cache_memory=32 << 20) as llm:
        out = llm.generate(["The capital of France is"], GREEDY, use_tqdm=False)[0]
        chat = llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids == ref.prompt_token_ids and out.outputs[0].text == ref.outputs[0].text
    assert chat.error is None and chat.prompt.startswith("MARKED ")
    with pytest.raises(MissingModelFile, match="tokenizer /nonexistent: not a folder"):
        LLM(model=weights, tokenizer="/nonexistent", dtype="float32", kv_cache_memory=32 << 20)
    with pytest.raises(MissingModelFile, match="no tokenizer files"):
        LLM(model=weights, tokenizer=weights, dtype="float32", kv_cache_memory=32 << 20)


def test_async_llm_tokenizes_with_it(split_folders):
    weights, tok = split_folders

    async def main():
        llm = await AsyncLLM.start(EngineConfig(model=weights, tokenizer=tok, dtype="float32",
                                                cache=CacheConfig(kv_cache_memory=32 << 20)))
        try:
            assert llm.tokenizer.chat_template.startswith("MARKED ")
            outs = [o async for o in llm.generate("The capital of France is", GREEDY, "r0")]
            assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 6 and outs[-1].outputs[0].text
        finally:
            await llm.shutdown()

    asyncio.run(main())


def test_skip_tokenizer_init_runs_token_ids_alone(qwen2_tiny, split_folders):
    weights, _ = split_folders
    ids = [{"prompt_token_ids": list(range(100, 120))}]
    with LLM(model=qwen2_tiny[0], dtype="float32", kv_cache_memory=32 << 20) as llm:
        ref = llm.generate(ids, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    with LLM(model=weights, skip_tokenizer_init=True, dtype="float32", kv_cache_memory=32 << 20) as llm:
        assert llm.get_tokenizer() is None
        out = llm.generate(ids + ["some text"], GREEDY, use_tqdm=False)
        with pytest.raises(ValueError, match="skip_tokenizer_init"):
            llm.chat([{"role": "user", "content": "hi"}], GREEDY)
    assert out[0].outputs[0].token_ids == ref and out[0].outputs[0].text == ""
    assert out[1].outputs[0].finish_reason == "error" and "give prompt_token_ids" in out[1].error
    with pytest.raises(ValueError, match="offline only"):
        AsyncLLM(EngineConfig(model=weights, skip_tokenizer_init=True))
